"""Rank body of the tensor-parallel fuzz (tests/multigpu/test_tp_fuzz.py; on CPU with gloo it
checks the harness against the collectives path).

Every rank draws the same cases from one seed (random.Random, not hypothesis: the ranks must
agree on every case) and rebuilds every rank's operands from per-(case, operand, owner)
generator seeds, so each can compute the plain FP64 reference of its own output. A case:
all_gather_matmul / matmul_reduce_scatter / dist_matmul; m rows per rank 1..1500 (odd ones
too); K and N mostly multiples of 16 (the fused path) and now and then anything (the
collectives fallback); bf16 / fp16 / float8 (e4m3, e4m3 x e5m2) with per-tensor or row-wise
scales (the row-wise scale_a of a shard is a slice of one vector, as users pass it) and fast
accumulation; bias or full c; alpha / beta; out_dtype; return_gathered; DISTGEMM_TP_ALGO
auto / fused / decomposed, DISTGEMM_TP_PIECES, DISTGEMM_RS_SPLIT_GFLOPS, and now and then
DISTGEMM_TP_BACKEND=collectives. Operands sit in sentinel buffers (tests/fuzz_helpers.py).

After each case the ranks exchange their outcome over a gloo group (independent of the GPU
streams): a case that raised on any rank is followed by distgemm.recover() on all ranks
(when the package has it), so that one failure does not hide the cases after it.
"""

from __future__ import annotations

import datetime
import random
import time

import torch
import torch.distributed as dist

import distgemm
from tests.fuzz_helpers import (Bound, Tally, accumulation_eps, bitwise_equal, canary_report, compare, settings_of,
                                is_cuda_fatal, place, write_report_line)
from tests.reference import ref_gemm

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "dist_matmul")
F8 = (torch.float8_e4m3fn, torch.float8_e5m2)
KINDS = {"bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16),
         "e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn), "e4m3xe5m2": (torch.float8_e4m3fn, torch.float8_e5m2)}
_TAGS = {name: i for i, name in enumerate(("a", "b", "c", "bias", "sa", "sb"))}


def draw_case(rng: random.Random) -> dict:
    op = rng.choices(OPS, weights=[45, 45, 10])[0]
    kind = rng.choice(["bf16", "bf16", "fp16", "e4m3", "e4m3", "e4m3xe5m2"] if op != "dist_matmul"
                      else ["bf16", "fp16"])
    fp8 = KINDS[kind][0] in F8

    def dim():
        return 16 * rng.randint(1, 128) if rng.random() < 0.85 else rng.randint(1, 700)

    case = dict(op=op, kind=kind,
                m=rng.choice([rng.randint(1, 16), rng.randrange(1, 1501, 2), 64 * rng.randint(1, 24),
                              rng.randint(1, 1500)]),
                k=dim(), n=dim(), c=rng.choice(["none", "none", "bias", "full"]),
                alpha=rng.choice([1.0, 1.0, 0.5, -2.0, 1.25]), beta=rng.choice([1.0, 0.5, -1.0, 2.0]),
                a_layout=rng.choices(["contig", "misaligned", "pitched"], weights=[80, 10, 10])[0],
                b_layout=rng.choices(["contig", "transposed"], weights=[85, 15])[0] if not fp8 else "contig",
                seed=rng.randrange(2 ** 31))
    if op == "dist_matmul":
        case["out_dtype"] = None
    else:
        case["out_dtype"] = rng.choice([None, "bf16", "fp16", "fp32"] if fp8 else [None, None, "fp32"])
    if fp8:
        # float8 calls need both scales (distgemm refuses to assume 1)
        case.update(scale_a=rng.choice(["tensor", "row"]), scale_b=rng.choice(["tensor", "row"]),
                    fast_accum=rng.random() < 0.5)
    if op == "all_gather_matmul":
        case["return_gathered"] = rng.random() < 0.4
    algo = rng.choice(["auto", "fused"] if fp8 else ["auto", "fused", "decomposed"])
    env = {"DISTGEMM_TP_ALGO": algo,
           "DISTGEMM_TP_PIECES": rng.choice(["auto", "auto", "1", "2", "3", "4", "2t", "3t"]) if algo != "fused" else None,
           "DISTGEMM_RS_SPLIT_GFLOPS": rng.choice([None, None, "0"]) if op == "matmul_reduce_scatter" else None,
           "DISTGEMM_TP_BACKEND": "collectives" if rng.random() < 0.08 else None}
    case["env"] = {k: v for k, v in env.items() if v is not None}
    return case


_OUT_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _gen(dev, seed: int, tag: str, owner: int = 0) -> torch.Generator:
    return torch.Generator(device=dev).manual_seed((seed * 1_000_003 + _TAGS[tag] * 1009 + owner) % (2 ** 63))


def _vals(shape, dtype, gen, dev, scale=1.0):
    x = torch.randn(*shape, generator=gen, device=dev) * scale
    if dtype in F8:
        x = x.clamp(-240, 240)
    return x.to(dtype)


def _scale_values(kind, length, dev, gen, owner):
    """A rank's scale as values: per tensor (one value, different per rank) or row-wise."""
    if kind == "tensor":
        return torch.full((1,), 0.25 * (owner + 1) + 0.125, device=dev)
    return torch.rand(length, generator=gen, device=dev) + 0.5


def _placed_a(values, layout):
    if layout == "misaligned":
        return place(values, offset=1)
    if layout == "pitched":
        return place(values, "pitched", 8)
    return place(values)


def _placed_b(values, layout):
    return place(values, "transposed", 0) if layout == "transposed" else place(values)


def run_case(case: dict, rank: int, world: int, dev) -> dict:
    """Runs one case on this rank; returns {'problems': [...], 'exception': str or None}."""
    a_dtype, b_dtype = KINDS[case["kind"]]
    fp8 = a_dtype in F8
    m, k, n, op = case["m"], case["k"], case["n"], case["op"]
    rows = m * world
    seed, alpha, beta = case["seed"], case["alpha"], case["beta"]
    out_dtype = _OUT_DTYPES[case["out_dtype"]] or (torch.bfloat16 if fp8 else a_dtype)
    c_dtype = out_dtype if not fp8 else torch.bfloat16
    sa_kind, sb_kind = case.get("scale_a", "none"), case.get("scale_b", "none")
    placed, extra = {}, {}
    if op in ("all_gather_matmul", "dist_matmul"):
        a_full = _vals((rows, k), a_dtype, _gen(dev, seed, "a"), dev)
        placed["a"] = _placed_a(a_full[rank * m:(rank + 1) * m], case["a_layout"])
        b_own = _vals((n, k), b_dtype, _gen(dev, seed, "b", rank), dev, 0.5)
        placed["b"] = _placed_b(b_own, case["b_layout"])
        c_full = None
        if case["c"] == "bias":
            placed["c"] = place(_vals((n,), c_dtype, _gen(dev, seed, "c", rank), dev))
            c_full = placed["c"].view.expand(rows, n)
        elif case["c"] == "full":
            placed["c"] = place(_vals((rows, n), c_dtype, _gen(dev, seed, "c", rank), dev))
            c_full = placed["c"].view
        sa_rows = sb = None
        if fp8 and sa_kind != "none":
            parts = [_scale_values(sa_kind, m, dev, _gen(dev, seed, "sa", q), q) for q in range(world)]
            if sa_kind == "row":  # one vector of all rows; this rank passes its slice (a view)
                placed["sa_all"] = place(torch.cat(parts))
                extra["scale_a"] = placed["sa_all"].view[rank * m:(rank + 1) * m]
                sa_rows = placed["sa_all"].view
            else:
                placed["scale_a"] = place(parts[rank])
                extra["scale_a"] = placed["scale_a"].view
                sa_rows = torch.cat([p.expand(m) for p in parts])
        if fp8 and sb_kind != "none":
            placed["scale_b"] = place(_scale_values(sb_kind, n, dev, _gen(dev, seed, "sb", rank), rank))
            extra["scale_b"] = sb = placed["scale_b"].view
        c_arg = placed["c"].view if "c" in placed else None
        if op == "dist_matmul":
            out = distgemm.dist_matmul(placed["a"].view, placed["b"].view, c_arg, alpha, beta)
            gathered = None
        else:
            res = distgemm.all_gather_matmul(
                placed["a"].view, placed["b"].view, c=c_arg, alpha=alpha, beta=beta,
                out_dtype=_OUT_DTYPES[case["out_dtype"]], return_gathered=case["return_gathered"],
                use_fast_accum=case.get("fast_accum", False), **extra)
            out, gathered = res if case["return_gathered"] else (res, None)
        ref = ref_gemm(a_full, b_own, c_full, alpha, beta if c_full is not None else 0.0, sa_rows, sb)
        bound = Bound(ref)
        bound.add_products(ref_gemm(a_full.double().abs(), b_own.double().abs(), None, abs(alpha), 0.0,
                                    None if sa_rows is None else sa_rows.abs(), None if sb is None else sb.abs()))
        if c_full is not None:
            bound.add_rounded(beta * c_full.double())
        expect_shape = (rows, n)
    else:  # matmul_reduce_scatter: a (M, K_local), b (N, K_local) per rank, rows of the sum
        mine = slice(rank * m, (rank + 1) * m)
        ref = torch.zeros(m, n, dtype=torch.float64, device=dev)
        products = torch.zeros_like(ref)
        partials = torch.zeros_like(ref)
        for q in range(world):
            a_q = _vals((rows, k), a_dtype, _gen(dev, seed, "a", q), dev)
            b_q = _vals((n, k), b_dtype, _gen(dev, seed, "b", q), dev, 0.5)
            sa_q = (_scale_values(sa_kind, rows, dev, _gen(dev, seed, "sa", q), q)
                    if fp8 and sa_kind != "none" else None)
            sb_q = (_scale_values(sb_kind, n, dev, _gen(dev, seed, "sb", q), q)
                    if fp8 and sb_kind != "none" else None)
            if q == rank:
                placed["a"] = _placed_a(a_q, case["a_layout"])
                placed["b"] = _placed_b(b_q, case["b_layout"])
                if sa_q is not None:
                    placed["scale_a"] = place(sa_q)
                    extra["scale_a"] = placed["scale_a"].view
                if sb_q is not None:
                    placed["scale_b"] = place(sb_q)
                    extra["scale_b"] = placed["scale_b"].view
            sa_rows = None if sa_q is None else (sa_q[mine] if sa_q.numel() > 1 else sa_q)
            part = ref_gemm(a_q[mine], b_q, None, alpha, 0.0, sa_rows, sb_q)
            ref += part
            partials += part.abs()
            products += ref_gemm(a_q[mine].double().abs(), b_q.double().abs(), None, abs(alpha), 0.0,
                                 None if sa_rows is None else sa_rows.abs(), None if sb_q is None else sb_q.abs())
        c_term = None
        if case["c"] == "bias":  # the same bias on every rank, added once
            placed["c"] = place(_vals((n,), c_dtype, _gen(dev, seed, "bias"), dev))
            c_term = beta * placed["c"].view.double().expand(m, n)
        elif case["c"] == "full":  # this rank's output rows
            placed["c"] = place(_vals((m, n), c_dtype, _gen(dev, seed, "c", rank), dev))
            c_term = beta * placed["c"].view.double()
        if c_term is not None:
            ref += c_term
        out = distgemm.matmul_reduce_scatter(
            placed["a"].view, placed["b"].view, c=placed["c"].view if "c" in placed else None, alpha=alpha,
            beta=beta, out_dtype=_OUT_DTYPES[case["out_dtype"]], use_fast_accum=case.get("fast_accum", False),
            **extra)
        gathered = None
        bound = Bound(ref)
        bound.add_products(products)
        bound.add_rounded(world * partials)  # the partial sums travel in the output dtype
        if c_term is not None:
            bound.add_rounded(c_term)
        expect_shape = (m, n)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        distgemm.check_errors(dev)
    problems = canary_report(placed)
    if tuple(out.shape) != expect_shape or out.dtype != out_dtype:
        return {"problems": problems + [f"out: shape {tuple(out.shape)} {out.dtype}, expected {expect_shape} "
                                        f"{out_dtype}"], "exception": None}
    if gathered is not None and not bitwise_equal(gathered, a_full):
        problems.append("return_gathered: the gathered operand differs from every rank's shards")
    problems += compare(out, ref, bound, a_dtype, accumulation_eps(a_dtype, k * (world if op == "matmul_reduce_scatter" else 1),
                                                                    case.get("fast_accum", False)),
                        case.get("fast_accum", False))
    return {"problems": problems, "exception": None}


def _recover(dev) -> str:
    """After a case that raised somewhere: every rank resets the group (distgemm.recover, a
    collective); returns '' or why the fuzz cannot go on."""
    try:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:  # a sticky CUDA error: nothing after it can be trusted
        return f"CUDA error after the case: {e}"
    recover = getattr(distgemm, "recover", None)
    if recover is None:
        return "distgemm.recover() is not available: the group's state after an error is undefined"
    try:
        recover()
    except Exception as e:
        return f"distgemm.recover() raised {type(e).__name__}: {e}"
    return ""


def fuzz(rank: int, world: int, n_cases: int, seed: int, time_cap, report: bool = True):
    """The fuzz loop, run on every rank."""
    dev = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    status_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
    tallies = {op: Tally(f"tp.{op}", n_cases, time_cap) for op in OPS}
    start, stop_reason = time.monotonic(), ""
    exception_cases = 0
    for i in range(n_cases):
        case = draw_case(random.Random(seed * 1_000_003 + i))
        try:
            with settings_of(case["env"]):
                status = run_case(case, rank, world, dev)
        except Exception as e:
            status = {"problems": [f"exception {type(e).__name__}: {str(e)[:400]}"], "exception": type(e).__name__,
                      "fatal": is_cuda_fatal(e)}
        status["stop"] = rank == 0 and time_cap is not None and time.monotonic() - start > time_cap
        statuses = [None] * world
        dist.all_gather_object(statuses, status, group=status_group)
        problems = [f"rank {r}: {p}" for r, s in enumerate(statuses) for p in s["problems"]]
        raised = any(s["exception"] for s in statuses)
        tally = tallies[case["op"]]
        tally.record(case, problems, exception=raised)
        if any(s.get("fatal") for s in statuses):
            tally.fatal = "a CUDA error that leaves the context unusable: " + "; ".join(problems)[:500]
            stop_reason = tally.fatal
            break
        if raised:
            exception_cases += 1
            why = _recover(dev)
            reasons = [None] * world
            dist.all_gather_object(reasons, why, group=status_group)
            why = "; ".join(f"rank {r}: {w}" for r, w in enumerate(reasons) if w)
            if why:
                stop_reason = f"stopped after case {i}: {why}"
                break
            if exception_cases >= 10:
                stop_reason = f"stopped after {exception_cases} cases that raised"
                break
        if statuses[0]["stop"]:
            stop_reason = f"time cap of {time_cap} s reached after {i + 1} cases"
            break
    ran = sum(t.cases for t in tallies.values())
    for t in tallies.values():
        t.skipped = 0
    lines = [t.line() for t in tallies.values()]
    for line in lines:
        line.update(total_requested=n_cases, total_ran=ran, stop_reason=stop_reason, world=world)
        if report and rank == 0:
            write_report_line(line)
    failing = [ln for ln in lines if ln["mismatches"] or ln["canary_hits"]]
    detail = "\n".join(f"{ln['op']}: {ln['mismatches']} mismatching / {ln['canary_hits']} canary-hit cases of "
                       f"{ln['cases']}:\n" + "\n".join(f"  {f['case']}\n    " + "\n    ".join(f["problems"])
                                                      for f in ln["failures"][:6]) for ln in failing)
    assert not failing, f"tensor-parallel fuzz ({ran} cases; {stop_reason or 'all ran'}):\n{detail}"
    assert not stop_reason.startswith("stopped") and "CUDA error" not in stop_reason, stop_reason
    assert ran > 0, "no case ran"
