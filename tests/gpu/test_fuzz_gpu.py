"""Property tests (hypothesis) of every single-GPU op against the FP64 reference.

distgemm.gemm: bf16/fp16 (out: same or fp32) and float8 (e4m3, e4m3 x e5m2, with per-tensor,
row-wise or no scales, fast accumulation on and off), M/N/K from 1 to 4096 incl. odd sizes,
alpha/beta, c full / bias / (1, N) / expanded, operands transposed, pitched, strided,
broadcast or at misaligned offsets. distgemm.grouped_mm: forward (trans_w=True) and dgrad
(trans_w=False), G 1..64, random routing with zero-token experts and unrouted tail rows,
T 0..4096, out= with accumulate on and off, out_dtype fp32, every grouped backend (mostly
auto; DISTGEMM_FUZZ_GROUPED_BACKENDS lists the others, default "cublas,torch"); N and K
multiples of 8, and 1 case in 20 not (then a clean refusal is accepted and counted).
distgemm.grouped_mm_wgrad: fp32 / 16-bit out, new or given out, accumulate. The FP8 grouped
ops (float8 x and w with row-wise or 128-block scales in the layouts users hold, forward and
dgrad, e5m2 x; the FP8 wgrad from quantize_fp8's padded transposed layout): the same routing,
G up to 1000, N and K multiples of 16 (1 case in 20 not: computed or cleanly refused), x at
16- and 8-byte offsets (misaligned views are copied), scales over 2^-10..2^10, unrouted
tokens' data and scales NaN. offs is now and then a strided view.

Every operand lives in a larger buffer of NaN sentinels (tests/fuzz_helpers.py): the
buffers must be unchanged afterwards (inputs and their surroundings; for out= the bytes
around the view and the rows the op must not write), and a read past an input shows up as
NaN. Results: the tolerances of tests/reference.py norm-wise (per expert for the grouped
ops) plus an element-wise bound; FP8 inputs enter the reference dequantized, c in the
output dtype it is converted to.

DISTGEMM_FUZZ_EXAMPLES cases per op (default 60), derandomized; DISTGEMM_FUZZ_TIME_S caps
each op's wall time; DISTGEMM_FUZZ_REPORT=<path> appends one JSON line per op. Mismatches
are collected (no shrinking, so a failing run stays bounded) and fail the test at the end
with the first failing cases.
"""

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import distgemm  # noqa: E402
from tests.fuzz_helpers import (Bound, Placed, Tally, accumulation_eps, canary_report, compare,  # noqa: E402
                                compare_segments, settings_of, fuzz_examples, fuzz_time_cap, is_cuda_fatal, place, place_out,
                                same_values, sentinel_fill)
from tests.reference import ref_gemm  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = os.environ.get("DISTGEMM_FUZZ_DEVICE", "cuda")  # "cpu": harness check through the reference path
EXAMPLES = fuzz_examples(60)

FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=False,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.large_base_example])

SPECIAL = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 255, 256, 257, 511,
           512, 513, 1000, 1023, 1024, 1025, 2047, 2048, 2049, 3000, 4095, 4096]
DIM = st.one_of(st.sampled_from(SPECIAL), st.integers(1, 64), st.integers(1, 600), st.integers(1, 4096))
F8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
KINDS = {"bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16),
         "e4m3": (F8["e4m3"], F8["e4m3"]), "e4m3xe5m2": (F8["e4m3"], F8["e5m2"]),
         "e5m2xe4m3": (F8["e5m2"], F8["e4m3"])}
LAYOUTS = ["contig", "contig", "pitched", "transposed", "col_strided", "row_strided", "misaligned"]
ALPHAS = [1.0, 1.0, 0.5, -1.0, 2.0, 0.0, -0.375, 1.75]
BETAS = [1.0, 0.5, -1.0, 0.0, 2.0, -0.25]


def _run_case(tally: Tally, case: dict, body) -> None:
    """Runs one case: problems, exceptions and canary hits go to the tally."""
    if tally.should_skip():
        return
    try:
        problems, refused = body(case)
        tally.record(case, problems, refused=refused)
    except Exception as e:  # a valid input must not raise
        if is_cuda_fatal(e):
            tally.fatal = f"{type(e).__name__}: {str(e)[:300]}"
        tally.record(case, [f"exception {type(e).__name__}: {str(e)[:300]}"], exception=True)


def _fuzz(op: str, cases, check) -> None:
    """Runs check on EXAMPLES cases drawn from the strategy `cases`; fails at the end on any problem."""
    tally = Tally(op, EXAMPLES, fuzz_time_cap())

    @FUZZ
    @given(cases)
    def run(case):
        _run_case(tally, case, check)

    run()
    tally.finish()


def _gen(seed: int):
    return torch.Generator(device=DEV).manual_seed(seed)


def _values(shape, dtype, gen, scale=1.0):
    x = torch.randn(*shape, generator=gen, device=DEV) * scale
    if dtype in F8.values():
        x = x.clamp(-240, 240)
    return x.to(dtype)


def _layout(name: str, pad: int):
    """(layout, pad, offset elements) for tests.fuzz_helpers.place."""
    if name == "misaligned":
        return "contig", 0, 1
    return name, pad, 0


# ---------------------------------------------------------------- distgemm.gemm


@st.composite
def gemm_cases(draw):
    kind = draw(st.sampled_from(["bf16", "bf16", "fp16", "fp16", "e4m3", "e4m3", "e4m3xe5m2", "e5m2xe4m3"]))
    a_dtype, _ = KINDS[kind]
    fp8 = a_dtype in F8.values()
    outs = [None, torch.bfloat16, torch.float16, torch.float32] if fp8 else [None, a_dtype, torch.float32]
    case = dict(kind=kind, m=draw(DIM), n=draw(DIM), k=draw(DIM), out_dtype=draw(st.sampled_from(outs)),
                a_layout=draw(st.sampled_from(LAYOUTS + ["bcast"])), b_layout=draw(st.sampled_from(LAYOUTS)),
                pad=draw(st.sampled_from([1, 3, 8, 16, 24])), alpha=draw(st.sampled_from(ALPHAS)),
                c=draw(st.sampled_from(["none", "none", "full", "bias", "bias_2d", "expanded"])),
                c_layout=draw(st.sampled_from(["contig", "pitched", "transposed", "misaligned"])),
                c_dtype=draw(st.sampled_from(["out", "out", "other"])), beta=draw(st.sampled_from(BETAS)),
                seed=draw(st.integers(0, 2 ** 31 - 1)))
    if fp8:
        # float8 calls need both scales (distgemm refuses to assume 1)
        case.update(scale_a=draw(st.sampled_from(["tensor", "tensor_1", "row", "row_col", "row_view"])),
                    scale_b=draw(st.sampled_from(["tensor", "tensor_1", "row", "row_col", "row_view"])),
                    fast_accum=draw(st.booleans()))
    return case


def _scale(kind: str, length: int, gen):
    """(placed scale or None): 'tensor' a 0-d value, 'tensor_1' shape (1,), 'row' (L,),
    'row_col' (L, 1), 'row_view' (L,) at a 4-byte (misaligned) offset of its buffer."""
    if kind == "none":
        return None
    n = 1 if kind.startswith("tensor") else length
    values = torch.rand(n, generator=gen, device=DEV) + 0.5
    if kind == "tensor":
        return place(values.reshape(()))
    if kind == "row_col":
        return place(values.reshape(n, 1))
    return place(values, offset=1 if kind == "row_view" else 0)


def check_gemm(case):
    a_dtype, b_dtype = KINDS[case["kind"]]
    fp8 = a_dtype in F8.values()
    m, n, k = case["m"], case["n"], case["k"]
    gen = _gen(case["seed"])
    out_dtype = case["out_dtype"] or (a_dtype if not fp8 else torch.bfloat16)
    a_vals = _values((m, k), a_dtype, gen)
    if case["a_layout"] == "bcast":
        a_vals = a_vals[:1].expand(m, k)
        a = place(a_vals, "bcast")
    else:
        a = place(a_vals, *_layout(case["a_layout"], case["pad"]))
    b = place(_values((n, k), b_dtype, gen, 1.0 if fp8 else 0.5), *_layout(case["b_layout"], case["pad"]))
    c = None
    c_dtype = out_dtype
    if case["c_dtype"] == "other":
        c_dtype = torch.float32 if out_dtype != torch.float32 else (torch.bfloat16 if not fp8 else torch.float16)
    if case["c"] == "full":
        c = place(_values((m, n), c_dtype, gen), *_layout(case["c_layout"], case["pad"]))
    elif case["c"] in ("bias", "bias_2d", "expanded"):
        bias = _values((n,), c_dtype, gen)
        if case["c"] == "bias":
            c = place(bias, offset=1 if case["c_layout"] == "misaligned" else 0)
        elif case["c"] == "bias_2d":
            c = place(bias.reshape(1, n))
        else:
            c = place(bias.reshape(1, n).expand(m, n), "bcast")
    sa = _scale(case.get("scale_a", "none"), m, gen) if fp8 else None
    sb = _scale(case.get("scale_b", "none"), n, gen) if fp8 else None
    fast = case.get("fast_accum", False)
    alpha, beta = case["alpha"], case["beta"]

    def v(p):
        return None if p is None else p.view

    out = distgemm.gemm(a.view, b.view, v(c), alpha=alpha, beta=beta, out_dtype=case["out_dtype"],
                        scale_a=v(sa), scale_b=v(sb), use_fast_accum=fast)
    if DEV == "cuda":
        torch.cuda.synchronize()
    problems = canary_report({"a": a, "b": b, "c": c, "scale_a": sa, "scale_b": sb})
    if tuple(out.shape) != (m, n) or out.dtype != out_dtype:
        return problems + [f"out: shape {tuple(out.shape)} {out.dtype}, expected ({m}, {n}) {out_dtype}"], False
    if not out.is_contiguous():
        problems.append("out: not contiguous")
    # c enters in the output dtype (the op converts it), as FP8 inputs enter dequantized
    cc = None if c is None else c.view.expand(m, n).to(out_dtype)
    sav, sbv = v(sa), v(sb)
    ref = ref_gemm(a.view, b.view, cc, alpha, beta, sav, sbv)
    bound = Bound(ref)
    bound.add_products(ref_gemm(a.view.double().abs(), b.view.double().abs(), None, abs(alpha), 0.0,
                                None if sav is None else sav.abs(), None if sbv is None else sbv.abs()))
    if cc is not None:
        bound.add_rounded(beta * cc.double())
    problems += compare(out, ref, bound, a_dtype, accumulation_eps(a_dtype, k, fast), fast)
    return problems, False


def test_gemm_fuzz():
    _fuzz("gemm", gemm_cases(), check_gemm)


# ---------------------------------------------------------------- grouped routing


def _counts(case, tokens: int, groups: int) -> list:
    """Rows per expert: zero-token experts, skewed or uniform weights, `tail` rows unrouted."""
    g = torch.Generator().manual_seed(case["seed"] + 1)
    routed = max(0, tokens - case["tail"])
    live = torch.rand(groups, generator=g) >= case["zero_frac"]
    if routed and not bool(live.any()):
        live[int(torch.randint(groups, (1,), generator=g))] = True
    if case["skew"] == "zipf":
        weights = 1.0 / torch.arange(1, groups + 1, dtype=torch.float64) ** 1.2
        weights = weights[torch.randperm(groups, generator=g)]
    elif case["skew"] == "one":
        weights = torch.zeros(groups, dtype=torch.float64)
        weights[int(torch.nonzero(live)[0]) if bool(live.any()) else 0] = 1.0
    else:
        weights = torch.rand(groups, generator=g, dtype=torch.float64)
    weights = weights * live
    if routed == 0 or float(weights.sum()) == 0.0:
        return [0] * groups
    counts = (weights / weights.sum() * routed).floor().long()
    counts[int(weights.argmax())] += routed - int(counts.sum())
    return counts.tolist()


def _offs(case, counts) -> Placed:
    """The group ends; 1 case in 6 as a strided view (every other int32 of its buffer)."""
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEV)
    return Placed(ends, (2,)) if case.get("offs_strided") else place(ends)


def _place_rows(values: torch.Tensor, layout: str) -> Placed:
    """A (rows, cols) operand in a canary buffer: "noncontig" / "pitched" (rows 16 bytes
    longer), "offset<B>" (the view B bytes into its buffer), else contiguous."""
    item = values.element_size()
    if layout in ("noncontig", "pitched"):
        return place(values, "pitched", 16 // item)
    offset = int(layout[len("offset"):]) if layout.startswith("offset") else 0
    return place(values, offset=offset // item)


def _rows_with_tail(rows: int, cols: int, routed: int, dtype, gen, layout: str):
    """A (rows, cols) input whose rows past `routed` hold NaN sentinels (no group owns them)."""
    values = _values((rows, cols), dtype, gen)
    if rows > routed:
        values[routed:] = sentinel_fill((rows - routed) * cols, dtype, DEV).view(rows - routed, cols)
    return _place_rows(values, layout)


# DISTGEMM_GROUPED_BACKEND per case: mostly auto; the others as listed in
# DISTGEMM_FUZZ_GROUPED_BACKENDS (default "cublas,torch"; empty: auto only)
BACKENDS = ["auto"] * 6 + [b for b in os.environ.get("DISTGEMM_FUZZ_GROUPED_BACKENDS", "cublas,torch").split(",")
                           if b.strip()]
# N, K: multiples of 8 (what the grouped kernels take); now and then not, where the op must
# either compute the right result or refuse cleanly (ValueError / NotImplementedError / RuntimeError).
GROUPED_DIM = st.one_of(st.integers(1, 96).map(lambda i: 8 * i), st.sampled_from([8, 16, 64, 128, 264, 1024, 2048]))


def _routing_draws(draw) -> dict:
    """The routing and output draws of the grouped cases (see _counts)."""
    return dict(unaligned=draw(st.sampled_from([False] * 19 + [True])),
                zero_frac=draw(st.sampled_from([0.0, 0.0, 0.25, 0.5, 0.9, 1.0])),
                tail=draw(st.sampled_from([0, 0, 0, 1, 7, 100, 5000])),
                skew=draw(st.sampled_from(["uniform", "zipf", "one"])),
                out_mode=draw(st.sampled_from(["new", "out", "out_acc"])),
                offs_strided=draw(st.sampled_from([False] * 5 + [True])))


@st.composite
def grouped_cases(draw, wgrad: bool):
    dtype = draw(st.sampled_from(["bf16", "fp16"]))
    case = dict(dtype=dtype, groups=draw(st.one_of(st.integers(1, 8), st.integers(1, 64), st.just(64))),
                tokens=draw(st.one_of(st.integers(1, 64), st.integers(0, 4096), st.integers(0, 4096),
                                     st.sampled_from([0, 1, 4096]))),
                n=draw(GROUPED_DIM), k=draw(GROUPED_DIM),
                **_routing_draws(draw),
                out_fp32=draw(st.booleans()), pass_out_dtype=draw(st.booleans()),
                x_layout=draw(st.sampled_from(["contig", "contig", "offset16", "offset2", "noncontig"])),
                w_layout=draw(st.sampled_from(["contig", "contig", "noncontig"])),
                out_offset=draw(st.sampled_from([0, 16, 48, 512])),
                backend=draw(st.sampled_from(BACKENDS)), seed=draw(st.integers(0, 2 ** 31 - 1)))
    if not wgrad:
        case["trans_w"] = draw(st.booleans())
    if case["unaligned"]:
        case["n"] = max(1, case["n"] - draw(st.integers(1, 7)))
        case["k"] = max(1, case["k"] - draw(st.integers(0, 7)))
    if case["groups"] * case["n"] * case["k"] > 64 * 1024 * 1024:  # keep one case under ~1 GB
        case["k"] = max(8, (64 * 1024 * 1024 // (case["groups"] * case["n"])) // 8 * 8)
    return case


def _run_grouped_case(op, args, kwargs, case, operands, out, shape, out_dtype):
    """Runs a grouped op under the case's backend: (result, problems, refused); the result is
    None when the op refused (as the case allows) or returned the wrong shape or dtype."""
    with settings_of({"DISTGEMM_GROUPED_BACKEND": case["backend"]}):
        try:
            y = op(*args, **kwargs)
            if DEV == "cuda":
                torch.cuda.synchronize()
        except Exception as e:
            if _refused(case, e):
                if DEV == "cuda":
                    torch.cuda.synchronize()
                return None, canary_report(operands, ("out",)), True
            raise
    problems = canary_report(operands, ("out",))
    if out is not None:
        if y.data_ptr() != out.view.data_ptr():
            problems.append("out=: the result is not the given out tensor")
        y = out.view
    if tuple(y.shape) != shape or y.dtype != out_dtype:
        return None, problems + [f"out: shape {tuple(y.shape)} {y.dtype}, expected {shape} {out_dtype}"], False
    return y, problems, False


def _refused(case, exc: Exception) -> bool:
    return case["unaligned"] and isinstance(exc, (ValueError, NotImplementedError, RuntimeError)) \
        and not is_cuda_fatal(exc)


def _forward_problems(y, out, init, acc, counts, xd, wd_nk, in_dtype, k) -> list:
    """Problems of a grouped forward / dgrad result y (T, N): with out=, the rows past
    offs[-1] left as they were; the routed rows against each expert's FP64 product of xd
    (routed, K) and wd_nk (G, N, K), plus init where out accumulated, held per expert."""
    problems = []
    routed, tokens, groups = sum(counts), y.shape[0], len(counts)
    if out is not None and routed < tokens and not same_values(y[routed:], init[routed:]):
        problems.append(f"out: rows past offs[-1] = {routed} were written")
    if routed == 0:
        return problems
    ref = torch.empty(routed, y.shape[1], dtype=torch.float64, device=DEV)
    products = torch.empty_like(ref)
    s = 0
    for g, c in enumerate(counts):
        if c:
            torch.matmul(xd[s:s + c], wd_nk[g].T, out=ref[s:s + c])
            torch.matmul(xd[s:s + c].abs(), wd_nk[g].abs().T, out=products[s:s + c])
            s += c
    bound = Bound(ref)
    bound.products = products
    if acc:
        ref += init[:routed].double()
        bound.add_rounded(init[:routed].double())
    segments = torch.repeat_interleave(torch.arange(groups, device=DEV), torch.tensor(counts, device=DEV))
    return problems + compare_segments(y[:routed], ref, bound, segments, groups, in_dtype,
                                       accumulation_eps(in_dtype, k))


def _wgrad_problems(y, init, acc, counts, operands_of, in_dtype) -> list:
    """Problems of a grouped wgrad result y (G, N, K): experts without tokens zero (or, when
    accumulating, unchanged); each other expert g against the FP64 product a @ b.T of
    operands_of(g) = (a (N, count), b (K, count)), plus init where out accumulated."""
    problems = []
    live = [g for g, c in enumerate(counts) if c]
    empty = [g for g, c in enumerate(counts) if not c]
    if empty:
        idx = torch.tensor(empty, device=DEV)
        if acc and not same_values(y[idx], init[idx]):
            problems.append(f"out: experts without tokens were changed (accumulate=True), of {empty[:8]}")
        elif not acc and bool((y[idx] != 0).any()):
            problems.append(f"out: experts without tokens are not zero, of {empty[:8]}")
    if not live:
        return problems
    ref = torch.empty(len(live), y.shape[1], y.shape[2], dtype=torch.float64, device=DEV)
    products = torch.empty_like(ref)
    for i, g in enumerate(live):
        a, b = operands_of(g)
        torch.matmul(a, b.T, out=ref[i])
        torch.matmul(a.abs(), b.abs().T, out=products[i])
    idx = torch.tensor(live, device=DEV)
    bound = Bound(ref)
    bound.products = products
    if acc:
        ref += init[idx].double()
        bound.add_rounded(init[idx].double())
    eps = torch.tensor([accumulation_eps(in_dtype, counts[g]) for g in live], dtype=torch.float64,
                       device=DEV).reshape(-1, 1, 1)
    return problems + compare_segments(y[idx], ref, bound, torch.arange(len(live), device=DEV), len(live),
                                       in_dtype, eps)


# ---------------------------------------------------------------- distgemm.grouped_mm


def check_grouped_mm(case):
    dtype = torch.bfloat16 if case["dtype"] == "bf16" else torch.float16
    groups, tokens, n, k, trans_w = case["groups"], case["tokens"], case["n"], case["k"], case["trans_w"]
    counts = _counts(case, tokens, groups)
    routed = sum(counts)
    gen = _gen(case["seed"])
    x = _rows_with_tail(tokens, k, routed, dtype, gen, case["x_layout"])
    w_shape = (groups, n, k) if trans_w else (groups, k, n)
    w_vals = _values(w_shape, dtype, gen, 0.25)
    w = place(w_vals, "transposed", 0) if case["w_layout"] == "noncontig" else place(w_vals)
    offs = _offs(case, counts)
    out_dtype = torch.float32 if case["out_fp32"] else dtype
    acc = case["out_mode"] == "out_acc"
    out, init = None, None
    kwargs = {"trans_w": trans_w}
    if case["out_mode"] != "new":
        out = place_out((tokens, n), out_dtype, DEV, _values((tokens, n), out_dtype, gen) if acc else None,
                        case["out_offset"])
        init = out.view.clone()  # accumulate: random values; else the sentinel (must be overwritten)
        kwargs.update(out=out.view, accumulate=acc)
        if case["pass_out_dtype"]:
            kwargs["out_dtype"] = out_dtype
    elif case["out_fp32"] or case["pass_out_dtype"]:
        kwargs["out_dtype"] = out_dtype
    operands = {"x": x, "w": w, "offs": offs, "out": out}
    y, problems, refused = _run_grouped_case(distgemm.grouped_mm, (x.view, w.view, offs.view), kwargs, case,
                                             operands, out, (tokens, n), out_dtype)
    if refused or y is None:
        return problems, refused
    w_nk = w.view.double() if trans_w else w.view.double().transpose(1, 2)
    problems += _forward_problems(y, out, init, acc, counts, x.view[:routed].double(), w_nk, dtype, k)
    return problems, False


def test_grouped_mm_fuzz():
    _fuzz("grouped_mm", grouped_cases(wgrad=False), check_grouped_mm)


# ---------------------------------------------------------------- distgemm.grouped_mm_wgrad


def check_grouped_mm_wgrad(case):
    dtype = torch.bfloat16 if case["dtype"] == "bf16" else torch.float16
    groups, tokens, n, k = case["groups"], case["tokens"], case["n"], case["k"]
    counts = _counts(case, tokens, groups)
    routed = sum(counts)
    gen = _gen(case["seed"])
    dy = _rows_with_tail(tokens, n, routed, dtype, gen, case["x_layout"])
    x = _rows_with_tail(tokens, k, routed, dtype, gen, "noncontig" if case["w_layout"] == "noncontig" else "contig")
    offs = _offs(case, counts)
    out_dtype = torch.float32 if case["out_fp32"] else dtype
    acc = case["out_mode"] == "out_acc"
    out, init = None, None
    if case["out_mode"] == "new":
        # out_dtype left out: the default, float32
        kwargs = {} if case["out_fp32"] and not case["pass_out_dtype"] else {"out_dtype": out_dtype}
    else:
        out = place_out((groups, n, k), out_dtype, DEV, _values((groups, n, k), out_dtype, gen) if acc else None,
                        case["out_offset"])
        init = out.view.clone()
        # out_dtype None: follows out; or given, matching it
        kwargs = {"out": out.view, "accumulate": acc, "out_dtype": out_dtype if case["pass_out_dtype"] else None}
    operands = {"dy": dy, "x": x, "offs": offs, "out": out}
    y, problems, refused = _run_grouped_case(distgemm.grouped_mm_wgrad, (dy.view, x.view, offs.view), kwargs,
                                             case, operands, out, (groups, n, k), out_dtype)
    if refused or y is None:
        return problems, refused
    starts = [0] + torch.tensor(counts).cumsum(0).tolist()

    def operands_of(g):
        rows = slice(starts[g], starts[g + 1])
        return dy.view[rows].double().T, x.view[rows].double().T

    problems += _wgrad_problems(y, init, acc, counts, operands_of, dtype)
    return problems, False


def test_grouped_mm_wgrad_fuzz():
    _fuzz("grouped_mm_wgrad", grouped_cases(wgrad=True), check_grouped_mm_wgrad)


# ---------------------------------------------------------------- FP8 grouped ops
#
# distgemm.grouped_mm with float8 x and w: row-wise scales ((T,), (G, N), a scalar or one per
# expert) or 128-block scales (x per 1 x 128 in any of the layouts users hold, w per 128 x 128
# as (G, N/128, K/128) or a transposed view), forward and dgrad (w (G, K, N), or a (G, N, K)
# tensor viewed transposed), e5m2 x against e4m3 w; distgemm.grouped_mm_wgrad with FP8 dy and
# x from quantize_fp8(..., transpose=True, offs=offs). Routing, tails, out= and canaries as
# above. The reference dequantizes the FP8 operands in FP64 (each block's scale written out
# here, not taken from the library), so only the tensor cores' partial sums and the bf16 / FP32
# output rounding separate the two.

# K and N: multiples of 16 (FP8 rows are 16-byte aligned), across 128-block boundaries.
FP8_DIM = st.one_of(st.integers(1, 64).map(lambda i: 16 * i),
                    st.sampled_from([16, 112, 128, 144, 240, 256, 272, 384, 1040, 2048]))
ROW_SCALES = ["row", "row", "row_scalar", "row_per_expert"]


@st.composite
def fp8_grouped_cases(draw, wgrad: bool):
    case = dict(x_dtype=draw(st.sampled_from(["e4m3"] * 4 + ["e5m2"])),
                groups=draw(st.one_of(st.integers(1, 8), st.integers(1, 64), st.sampled_from([160, 1000]))),
                tokens=draw(st.one_of(st.integers(1, 300), st.integers(0, 4096), st.sampled_from([0, 1, 128, 4096]))),
                n=draw(FP8_DIM), k=draw(FP8_DIM),
                **_routing_draws(draw),
                out_offset=draw(st.sampled_from([0, 16, 48, 512])),
                x_layout=draw(st.sampled_from(["contig", "contig", "offset16", "pitched", "offset8"])),
                scale_range=draw(st.sampled_from([1.0, 1.0, 2.0 ** 8, 2.0 ** -8])),
                seed=draw(st.integers(0, 2 ** 31 - 1)))
    if wgrad:
        case.update(dy_layout=draw(st.sampled_from(["contig", "contig", "pitched"])),
                    scale_layout=draw(st.sampled_from(["as_quantized", "as_quantized", "contiguous"])))
    else:
        case.update(mode=draw(st.sampled_from(["block", "block"] + ROW_SCALES)), trans_w=draw(st.booleans()),
                    w_layout=draw(st.sampled_from(["contig", "contig", "other_major"])),
                    sx_layout=draw(st.sampled_from(["t_major", "row_major", "pitched"])),
                    sw_layout=draw(st.sampled_from(["contig", "contig", "transposed"])))
    if case["unaligned"]:
        case["n"] = max(1, case["n"] - draw(st.integers(1, 15)))
        case["k"] = max(1, case["k"] - draw(st.integers(0, 15)))
    if case["groups"] * case["n"] * case["k"] > 64 * 1024 * 1024:
        case["k"] = max(16, (64 * 1024 * 1024 // (case["groups"] * case["n"])) // 16 * 16)
    return case


def _fp8_scales(shape, case, gen) -> torch.Tensor:
    """Positive FP32 scales spread over [r/4, 4r) log-uniformly, r the case's scale range."""
    e = torch.rand(tuple(shape), generator=gen, device=DEV) * 4 - 2
    return (2.0 ** e) * case["scale_range"]


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int):
    """A (..., rows, cols) FP64 tensor of each element's block scale."""
    s = scale.double()
    if block_rows > 1:
        s = s.repeat_interleave(block_rows, dim=-2)[..., :rows, :]
    if block_cols > 1:
        s = s.repeat_interleave(block_cols, dim=-1)[..., :cols]
    return s


def _nan_past(values: torch.Tensor, routed: int, dim: int = 0) -> torch.Tensor:
    """values with the entries of unrouted tokens (index >= routed along dim) set to NaN."""
    values = values.clone()
    if values.shape[dim] > routed:
        values.narrow(dim, routed, values.shape[dim] - routed).fill_(float("nan"))
    return values


def _fp8_row_scale_w(case, groups, n, gen):
    """Row-wise w scales: (G, N), a 0-d scalar or (G,) per expert; (placed, (G, N) FP64)."""
    if case["mode"] == "row_scalar":
        s = _fp8_scales((), case, gen)
        return place(s), s.double().expand(groups, n)
    if case["mode"] == "row_per_expert":
        s = _fp8_scales((groups,), case, gen)
        return place(s), s.double().reshape(groups, 1).expand(groups, n)
    s = _fp8_scales((groups, n), case, gen)
    return place(s), s.double()


def _fp8_block_scale_x(case, tokens, kb, routed, gen):
    """Block scales of x, (T, Kb): T-major (strides (1, T)), row-major or pitched;
    (placed, values); the unrouted tokens' scales NaN."""
    s = _nan_past(_fp8_scales((tokens, kb), case, gen), routed)
    if case["sx_layout"] == "t_major":
        return Placed(s, (1, max(tokens, 1)) if tokens else (1, 1)), s
    if case["sx_layout"] == "pitched":
        return place(s, "pitched", 3), s
    return place(s), s


def check_grouped_mm_fp8(case):
    x_dtype, trans_w = F8[case["x_dtype"]], case["trans_w"]
    groups, tokens, n, k = case["groups"], case["tokens"], case["n"], case["k"]
    counts = _counts(case, tokens, groups)
    routed = sum(counts)
    gen = _gen(case["seed"])
    x = _rows_with_tail(tokens, k, routed, x_dtype, gen, case["x_layout"])
    w_nk = _values((groups, n, k), F8["e4m3"], gen)
    # forward: w (G, N, K), contiguous or N-major (copied); dgrad: w (G, K, N), contiguous
    # (copied transposed) or K-major (read in place, as GroupedLinear caches it)
    w_vals = w_nk if trans_w else w_nk.transpose(1, 2)
    w = place(w_vals, "transposed", 0) if case["w_layout"] == "other_major" else place(w_vals)
    offs = _offs(case, counts)
    kb, nb = (k + 127) // 128, (n + 127) // 128
    if case["mode"] == "block":
        sx, sx_vals = _fp8_block_scale_x(case, tokens, kb, routed, gen)
        sw_nk = _fp8_scales((groups, nb, kb), case, gen)
        sw_vals = sw_nk if trans_w else sw_nk.transpose(1, 2)  # (G, Kb, Nb) for a (G, K, N) w
        sw = Placed(sw_vals, (sw_vals.shape[1] * sw_vals.shape[2], 1, sw_vals.shape[1])) \
            if case["sw_layout"] == "transposed" else place(sw_vals.contiguous())
        x_scale = _expand_blocks(sx_vals, tokens, k, 1, 128)
        w_scale = _expand_blocks(sw_nk, n, k, 128, 128)
    else:
        sx_vals = _nan_past(_fp8_scales((tokens,), case, gen), routed)
        sx = place(sx_vals)
        sw, w_rows = _fp8_row_scale_w(case, groups, n, gen)
        x_scale = sx_vals.double().reshape(-1, 1)
        w_scale = w_rows.reshape(groups, n, 1)
    acc = case["out_mode"] == "out_acc"
    out, init = None, None
    kwargs = {"trans_w": trans_w, "scale_x": sx.view, "scale_w": sw.view}
    if case["out_mode"] != "new":
        out = place_out((tokens, n), torch.bfloat16, DEV,
                        _values((tokens, n), torch.bfloat16, gen) if acc else None, case["out_offset"])
        init = out.view.clone()
        kwargs.update(out=out.view, accumulate=acc)
    operands = {"x": x, "w": w, "offs": offs, "out": out, "scale_x": sx, "scale_w": sw}
    case = dict(case, backend="auto")
    y, problems, refused = _run_grouped_case(distgemm.grouped_mm, (x.view, w.view, offs.view), kwargs, case,
                                             operands, out, (tokens, n), torch.bfloat16)
    if refused or y is None:
        return problems, refused
    problems += _forward_problems(y, out, init, acc, counts, x.view[:routed].double() * x_scale[:routed],
                                  w_nk.double() * w_scale, x_dtype, k)
    return problems, False


def test_grouped_mm_fp8_fuzz():
    _fuzz("grouped_mm_fp8", fp8_grouped_cases(wgrad=False), check_grouped_mm_fp8)


def _padded_starts(counts) -> list:
    """Each group's first column in quantize_fp8's padded transposed layout: 128 * (g + start // 128)."""
    starts, s = [], 0
    for g, c in enumerate(counts):
        starts.append(128 * (g + s // 128))
        s += c
    return starts


def check_grouped_mm_wgrad_fp8(case):
    dy_dtype = F8[case["x_dtype"]]
    groups, tokens, n, k = case["groups"], case["tokens"], case["n"], case["k"]
    counts = _counts(case, tokens, groups)
    routed = sum(counts)
    gen = _gen(case["seed"])
    # bf16 activations (unrouted rows NaN: the quantizer must not read them either), quantized
    # the way a user does; then placed in canary buffers
    dy_rows = _nan_past(torch.randn(tokens, n, generator=gen, device=DEV) * case["scale_range"], routed)
    x_rows = _nan_past(torch.randn(tokens, k, generator=gen, device=DEV) * case["scale_range"], routed)
    offs = _offs(case, counts)
    try:
        dy8, sdy8 = distgemm.quantize_fp8(dy_rows.to(torch.bfloat16), (1, 128), dtype=dy_dtype, transpose=True,
                                          offs=offs.view)
        x8, sx8 = distgemm.quantize_fp8(x_rows.to(torch.bfloat16), (1, 128), transpose=True, offs=offs.view)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        if case["unaligned"] and not is_cuda_fatal(e):
            return [], True
        raise
    tp = dy8.shape[1]

    dy = _place_rows(dy8, case["dy_layout"])
    x = _place_rows(x8, case["x_layout"])
    if case["scale_layout"] == "contiguous":
        sdy, sx = place(sdy8.contiguous()), place(sx8.contiguous())
    else:
        sdy, sx = Placed(sdy8, sdy8.stride()), Placed(sx8, sx8.stride())
    acc = case["out_mode"] == "out_acc"
    out, init = None, None
    kwargs = {"scale_dy": sdy.view, "scale_x": sx.view}
    if case["out_mode"] != "new":
        out = place_out((groups, n, k), torch.float32, DEV,
                        _values((groups, n, k), torch.float32, gen) if acc else None, case["out_offset"])
        init = out.view.clone()
        kwargs.update(out=out.view, accumulate=acc)
    operands = {"dy": dy, "x": x, "offs": offs, "out": out, "scale_dy": sdy, "scale_x": sx}
    case = dict(case, backend="auto")
    y, problems, refused = _run_grouped_case(distgemm.grouped_mm_wgrad, (dy.view, x.view, offs.view), kwargs,
                                             case, operands, out, (groups, n, k), torch.float32)
    if refused or y is None:
        return problems, refused
    # the reference: each group's padded columns, dequantized with their 128-token scales
    dyd = dy8.double() * _expand_blocks(sdy8, n, tp, 1, 128)
    xd = x8.double() * _expand_blocks(sx8, k, tp, 1, 128)
    starts = _padded_starts(counts)
    # the quantizer's padding columns are zero (a group reading past its tokens would still
    # match the reference): check that they are
    covered = torch.zeros(tp, dtype=torch.bool, device=DEV)
    for g, c in enumerate(counts):
        covered[starts[g]:starts[g] + c] = True
    if bool((dy8[:, ~covered].float() != 0).any()) or bool((x8[:, ~covered].float() != 0).any()):
        problems.append("quantize_fp8: padding columns of the transposed layout are not zero")

    def operands_of(g):
        cols = slice(starts[g], starts[g] + counts[g])
        return dyd[:, cols], xd[:, cols]

    problems += _wgrad_problems(y, init, acc, counts, operands_of, dy_dtype)
    return problems, False


def test_grouped_mm_wgrad_fp8_fuzz():
    _fuzz("grouped_mm_wgrad_fp8", fp8_grouped_cases(wgrad=True), check_grouped_mm_wgrad_fp8)
