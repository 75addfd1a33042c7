"""Shared pieces of the fuzz suites (tests/gpu/test_fuzz_gpu.py, tests/multigpu/test_tp_fuzz.py).

- Canaries: every operand is a view into a larger buffer whose other bytes hold a NaN bit
  pattern (`place`). Afterwards the whole buffer must be byte-for-byte what it was: a write
  past an output view or into an input is a canary hit, and a read past an input's bounds
  shows up as NaN in the result.
- Checks: a result is compared with the FP64 reference norm-wise, with the tolerances of
  tests/reference.py, and element by element against a bound built from the same
  constants (`Bound`), which a wrong tile or row cannot hide under on a large output.
- Tallies: per op, the cases run, mismatches, canary hits and exceptions; a JSON line per op
  in $DISTGEMM_FUZZ_REPORT when set, and an assertion listing the first failing cases.

Budget knobs: DISTGEMM_FUZZ_EXAMPLES (cases per op), DISTGEMM_FUZZ_TIME_S (optional wall
clock cap per op: the remaining examples are skipped and the report says so).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Optional, Sequence

import torch

from tests.reference import FLOAT8, rel_error, tolerance

# ---------------------------------------------------------------- budget


def fuzz_examples(default: int) -> int:
    return max(1, int(os.environ.get("DISTGEMM_FUZZ_EXAMPLES", str(default))))


def fuzz_time_cap() -> Optional[float]:
    value = os.environ.get("DISTGEMM_FUZZ_TIME_S", "")
    return float(value) if value else None


# ---------------------------------------------------------------- canary buffers

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# NaN bit patterns (a payload bit set, so not the NaN a kernel would produce itself);
# int32 operands (offs) get a large positive value a kernel must never read.
_SENTINEL = {torch.bfloat16: 0x7FC1, torch.float16: 0x7E01, torch.float32: 0x7FC00001,
             torch.float64: 0x7FF8000000000001, torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F,
             torch.int32: 0x5A5A5A5A}
GUARD_BYTES = 256


def sentinel_fill(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """n elements of `dtype` holding the sentinel bit pattern."""
    raw = torch.full((n,), _SENTINEL[dtype], dtype=_INT_OF_SIZE[dtype.itemsize], device=device)
    return raw.view(dtype)


def _span(shape, strides) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, strides))


def row_major_strides(shape, pitch_pad: int = 0) -> tuple:
    """Strides of a row-major layout whose last-dim rows are `pitch_pad` elements longer."""
    strides, step = [], 1
    for i, s in enumerate(reversed(shape)):
        strides.append(step)
        step *= (s + pitch_pad) if i == 0 else s
    return tuple(reversed(strides))


def layout_strides(shape, layout: str, pad: int = 0) -> tuple:
    """Strides of named layouts of a 2-D or 3-D operand (the last two dims a matrix (R, C)):
    'contig', 'pitched' (row pitch C + pad), 'transposed' (column-major, pitch R + pad),
    'col_strided' (every other column), 'row_strided' (every other row), 'bcast' (one row
    repeated: stride 0, 2-D only)."""
    *batch, r, c = shape
    if layout == "contig":
        inner = (c, 1)
    elif layout == "pitched":
        inner = (c + pad, 1)
    elif layout == "transposed":
        inner = (1, r + pad)
    elif layout == "col_strided":
        inner = (2 * c + pad, 2)
    elif layout == "row_strided":
        inner = (2 * (c + pad), 1)
    elif layout == "bcast":
        assert not batch
        return (0, 1)
    else:
        raise ValueError(layout)
    matrix = _span((r, c), inner)
    if not batch:
        return inner
    return (matrix + pad,) + inner  # 3-D: the matrices one after another (plus a gap)


class Placed:
    """A view of the given values inside a sentinel-filled buffer (its canaries)."""

    def __init__(self, values: torch.Tensor, strides: Optional[Sequence[int]] = None, offset: int = 0,
                 guard_bytes: int = GUARD_BYTES):
        dtype, dev = values.dtype, values.device
        shape = tuple(values.shape)
        strides = tuple(strides) if strides is not None else row_major_strides(shape)
        guard = max(1, guard_bytes // dtype.itemsize)
        start = guard + offset
        self.buf = sentinel_fill(start + _span(shape, strides) + guard, dtype, dev)
        self.view = self.buf.as_strided(shape, strides, start)
        # write through a view without the broadcast (stride-0) dimensions
        index = tuple(0 if st == 0 else slice(None) for st in strides)
        self.view[index] = values[index]
        self.mask = torch.zeros(self.buf.numel(), dtype=torch.bool, device=dev)
        self.mask.as_strided(shape, strides, start).fill_(True)
        self.snapshot = self.buf.clone()

    def refresh_snapshot(self) -> None:
        self.snapshot = self.buf.clone()

    def changed(self) -> tuple:
        """(inside the view changed, outside it changed), compared byte for byte."""
        item = self.buf.element_size()
        now = self.buf.view(torch.uint8).view(-1, item)
        before = self.snapshot.view(torch.uint8).view(-1, item)
        diff = (now != before).any(1)
        return bool((diff & self.mask).any()), bool((diff & ~self.mask).any())


def place(values: torch.Tensor, layout: str = "contig", pad: int = 0, offset: int = 0) -> Placed:
    strides = (row_major_strides(tuple(values.shape)) if values.dim() < 2
               else layout_strides(tuple(values.shape), layout, pad))
    return Placed(values, strides, offset)


def place_out(shape, dtype, device, init: Optional[torch.Tensor], offset_bytes: int) -> Placed:
    """A contiguous, 16-byte aligned output view (`out=`) in a sentinel buffer; its own
    elements hold `init` (or the sentinel when None)."""
    assert offset_bytes % 16 == 0
    values = init if init is not None else sentinel_fill(int(torch.Size(shape).numel()), dtype,
                                                          device).view(shape)
    return Placed(values.to(dtype), None, offset_bytes // dtype.itemsize)


def canary_report(named: dict, output_names: Sequence[str] = ()) -> list:
    """Problems of the placed operands: any write outside a view, and any write into an
    input (names not in output_names)."""
    problems = []
    for name, placed in named.items():
        if placed is None:
            continue
        inside, outside = placed.changed()
        if outside:
            problems.append(f"canary: bytes around {name} were overwritten")
        if inside and name not in output_names:
            problems.append(f"canary: input {name} was modified")
    return problems


# ---------------------------------------------------------------- result checks

_UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -22}
_TINY = {torch.bfloat16: 2.0 ** -126, torch.float16: 2.0 ** -23, torch.float32: 2.0 ** -126}


def accumulation_eps(in_dtype: torch.dtype, k: int, fast_accum: bool = False) -> float:
    """Relative accumulation error allowed against |a| @ |b|.T: the accumulation term of
    tests/reference.tolerance (FP8 with fast accumulation: the bf16-output tolerance that
    test_fp8_matches_scaled_mm holds it to), at least K FP32 roundings."""
    if in_dtype in FLOAT8:
        eps = 8e-3 if fast_accum else tolerance(torch.float32, in_dtype)
    else:
        eps = tolerance(torch.float32, in_dtype)
    return max(eps, k * 2.0 ** -24)


class Bound:
    """Element-wise error bound |out - ref| <= u_out |ref| + acc * S + u_out * R + tiny:
    S the absolute-value product (|alpha| |sa| |sb| |a| @ |b|.T), R magnitudes rounded
    on the way (|beta c|, accumulated partial sums), u_out twice the output's unit
    roundoff."""

    def __init__(self, ref: torch.Tensor):
        self.ref = ref
        self.products = torch.zeros_like(ref)
        self.rounded = torch.zeros_like(ref)

    def add_products(self, s: torch.Tensor) -> None:
        self.products = self.products + s

    def add_rounded(self, r: torch.Tensor) -> None:
        self.rounded = self.rounded + r.abs()

    def limit(self, out_dtype, acc_eps: float) -> torch.Tensor:
        u = _UNIT[out_dtype]
        return (u * self.ref.abs() + acc_eps * self.products + u * self.rounded
                + 2 * _TINY[out_dtype])


def compare(out: torch.Tensor, ref: torch.Tensor, bound: Optional[Bound], in_dtype, acc_eps: float,
            fast_accum: bool = False, what: str = "out") -> list:
    """Problems of `out` against the FP64 reference (empty when it is right)."""
    if out.numel() == 0:
        return []
    problems = []
    o = out.double()
    finite = torch.isfinite(o)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        return [f"{what}: {bad} non-finite values of {o.numel()}"]
    tol = tolerance(out.dtype, in_dtype)
    if in_dtype in FLOAT8 and fast_accum:
        tol = max(tol, 8e-3)
    err = rel_error(o, ref)
    if err > tol:
        problems.append(f"{what}: relative error {err:.3e} > {tol:.1e}")
    if bound is not None:
        excess = (o - ref).abs() - bound.limit(out.dtype, acc_eps)
        worst = float(excess.max())
        if worst > 0:
            n_bad = int((excess > 0).sum())
            idx = int(excess.argmax())
            pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), excess.shape))
            problems.append(f"{what}: {n_bad} elements beyond the element-wise bound, worst at {pos}: "
                            f"got {float(o.reshape(-1)[idx]):.6g}, expected {float(ref.reshape(-1)[idx]):.6g}")
    return problems


def compare_segments(out: torch.Tensor, ref: torch.Tensor, bound: Optional[Bound], segments: torch.Tensor,
                     n_segments: int, in_dtype, acc_eps, what: str = "out") -> list:
    """compare() with the norm-wise tolerance held per segment (expert): segments[i] is the
    segment of out[i] (a row, or a whole matrix of a batch), so a wrong small expert cannot
    hide in the norm of a large one. acc_eps may be a tensor broadcasting against out."""
    if out.numel() == 0:
        return []
    o = out.double()
    finite = torch.isfinite(o)
    if not bool(finite.all()):
        return [f"{what}: {int((~finite).sum())} non-finite values of {o.numel()}"]
    tol = tolerance(out.dtype, in_dtype)
    diff = o - ref
    err2 = torch.zeros(n_segments, dtype=torch.float64, device=o.device)
    ref2 = torch.zeros(n_segments, dtype=torch.float64, device=o.device)
    err2.index_add_(0, segments, diff.pow(2).reshape(o.shape[0], -1).sum(1))
    ref2.index_add_(0, segments, ref.pow(2).reshape(o.shape[0], -1).sum(1))
    rel = err2.sqrt() / ref2.sqrt().clamp_min(1e-30)
    problems = []
    bad = torch.nonzero(rel > tol).reshape(-1)
    if bad.numel():
        worst = int(rel.argmax())
        problems.append(f"{what}: {bad.numel()} segments beyond relative error {tol:.1e}, worst segment "
                        f"{worst}: {float(rel[worst]):.3e} (first: {bad[:5].tolist()})")
    if bound is not None:
        excess = diff.abs() - bound.limit(out.dtype, acc_eps)
        if float(excess.max()) > 0:
            idx = int(excess.argmax())
            pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), excess.shape))
            problems.append(f"{what}: {int((excess > 0).sum())} elements beyond the element-wise bound, worst "
                            f"at {pos}: got {float(o.reshape(-1)[idx]):.6g}, expected "
                            f"{float(ref.reshape(-1)[idx]):.6g}")
    return problems


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Unchanged: the same bits, or the same values (-0.0 and +0.0 equal: adding a zero
    product to a negative zero gives +0.0)."""
    return bitwise_equal(a, b) or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


def is_cuda_fatal(exc: BaseException) -> bool:
    """An exception after which the CUDA context cannot be trusted (sticky errors)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in ("illegal memory access", "misaligned address", "unspecified launch failure",
                                   "an illegal instruction", "device-side assert", "CUDA error: an illegal"))


@contextlib.contextmanager
def settings_of(variables: dict):
    """Runs a block under distgemm.settings with these DISTGEMM_* variables' values (None: the
    default), the previous settings restored after it."""
    import distgemm

    overrides = {distgemm._settings.variable_field(k): v for k, v in variables.items()}
    with distgemm.settings(**overrides):
        yield


# ---------------------------------------------------------------- tallies


class Tally:
    """Counts of one op's fuzz cases; `finish` writes the report line and fails on problems."""

    def __init__(self, op: str, requested: int, time_cap: Optional[float] = None):
        self.op, self.requested, self.time_cap = op, requested, time_cap
        self.cases = self.mismatches = self.canary_hits = self.exceptions = self.refusals = 0
        self.skipped = 0
        self.failures: list = []
        self.fatal: Optional[str] = None
        self.start = time.monotonic()

    def out_of_time(self) -> bool:
        return self.time_cap is not None and time.monotonic() - self.start > self.time_cap

    def should_skip(self) -> bool:
        if self.fatal is not None or self.out_of_time():
            self.skipped += 1
            return True
        return False

    def record(self, case, problems: Sequence[str], refused: bool = False, exception: bool = False) -> None:
        self.cases += 1
        self.refusals += int(refused)
        self.exceptions += int(exception)
        canary = [p for p in problems if p.startswith("canary")]
        numeric = [p for p in problems if not p.startswith("canary")]
        self.canary_hits += int(bool(canary))
        self.mismatches += int(bool(numeric))
        if problems and len(self.failures) < 25:
            self.failures.append({"case": describe(case), "problems": list(problems)[:6]})

    def line(self) -> dict:
        return {"op": self.op, "cases": self.cases, "mismatches": self.mismatches,
                "canary_hits": self.canary_hits, "exceptions": self.exceptions, "refusals": self.refusals,
                "requested": self.requested, "skipped": self.skipped,
                "time_capped": self.skipped > 0 and self.fatal is None,
                "seconds": round(time.monotonic() - self.start, 2), "fatal": self.fatal,
                "failures": self.failures[:10]}

    def finish(self, extra: Optional[dict] = None) -> dict:
        line = self.line()
        if extra:
            line.update(extra)
        write_report_line(line)
        detail = "\n".join(f"  {f['case']}\n    " + "\n    ".join(f["problems"]) for f in self.failures[:10])
        assert self.fatal is None, f"{self.op}: stopped after a fatal CUDA error: {self.fatal}\n{detail}"
        assert self.mismatches == 0 and self.canary_hits == 0, (
            f"{self.op}: {self.mismatches} mismatching cases and {self.canary_hits} canary hits "
            f"in {self.cases} cases; first failures:\n{detail}")
        assert self.cases > 0, f"{self.op}: no case ran"
        return line


def write_report_line(line: dict) -> None:
    path = os.environ.get("DISTGEMM_FUZZ_REPORT")
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def describe(case) -> str:
    if isinstance(case, dict):
        return ", ".join(f"{k}={v}" for k, v in case.items())
    return repr(case)
