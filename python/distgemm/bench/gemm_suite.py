"""Dense GEMM suite: distgemm.gemm against cuBLAS (torch.matmul) in bf16, against
torch._scaled_mm in fp8 with one scale per tensor or per row, and against F.scaled_mm (cuBLAS)
with DeepSeek-V3's 128-block scales; same inputs, same timer; plus the tile-configuration sweep."""

from __future__ import annotations

import itertools

import torch
from tqdm import tqdm

import distgemm
from distgemm._library import device_arch, ops

from .common import Timer, entry, geomean, gpu_slug, plot_ratios, print_row, write_results

LLM_NK = (4096, 8192, 14336, 28672)


def shapes(quick: bool):
    square = [(4096, 4096, 4096), (8192, 8192, 8192)]
    if quick:
        return square + [(4096, 14336, 4096), (8192, 4096, 14336)]
    return square + [(m, n, k) for m in (4096, 8192, 16384) for n in LLM_NK for k in LLM_NK]


def _inputs(m, n, k, fp8: bool, scaling: str = "tensor"):
    """a (M, K), b (N, K) and the scales in the form distgemm.gemm takes: one per tensor, per
    row ((M, 1), (1, N), torch._scaled_mm's form), or per 1 x 128 of a ((M, K/128), M-major)
    and per 128 x 128 block of b ((N/128, K/128))."""
    a = torch.randn(m, k, device="cuda")
    b = torch.randn(n, k, device="cuda")
    if not fp8:
        return a.to(torch.bfloat16), b.to(torch.bfloat16), None, None
    a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    if scaling == "row":
        return a, b, torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
    if scaling == "block":
        kb, nb = -(-k // 128), -(-n // 128)
        return a, b, (torch.rand(kb, m, device="cuda") + 0.5).t(), torch.rand(nb, kb, device="cuda") + 0.5
    return a, b, torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")


def _rel(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm()).item()


# (suite, dtype label, fp8, fast accumulation, scaling)
VARIANTS = (("gemm_bf16", "bf16", False, False, None),
            ("gemm_fp8", "fp8_e4m3", True, False, "tensor"),
            ("gemm_fp8_rowwise", "fp8_e4m3_rowwise", True, False, "row"),
            ("gemm_fp8_fast_accum", "fp8_e4m3_fast_accum", True, True, "tensor"))
# The --suites gemm_fp8_block variant: 128-block scales against F.scaled_mm.
BLOCK_VARIANT = ("gemm_fp8_block", "fp8_e4m3_block", True, False, "block")


def _block_fns(a, b, sa, sb) -> dict:
    """ours (distgemm.gemm: the autotuner's pick of our grouped kernel and F.scaled_mm), the
    peer (F.scaled_mm, its scales prepared once in its layouts, as its users hold them) and our
    kernel alone (the one-group grouped GEMM)."""
    from distgemm._torch_block_scaled import cublas_scale_a, cublas_scale_b, scaled_mm_block
    from distgemm.grouped_fp8 import grouped_mm_fp8

    psa, psb, b_kn = cublas_scale_a(sa), cublas_scale_b(sb), b.t()
    offs = torch.full((1,), a.shape[0], dtype=torch.int32, device=a.device)
    w, sw = b.unsqueeze(0), sb.unsqueeze(0)
    return {"ours": lambda: distgemm.gemm(a, b, scale_a=sa, scale_b=sb),
            "peer": lambda: scaled_mm_block(a, b_kn, psa, psb),
            "kernel": lambda: grouped_mm_fp8(a, w, offs, scale_x=sa, scale_w=sw)}


def run(out_dir: str, quick: bool = False, variants=VARIANTS) -> dict:
    """Each variant: distgemm.gemm as users call it (the autotuner's pick among our tiles and,
    for FP8, torch._scaled_mm / F.scaled_mm where it computes the same call) against the peer;
    for FP8 also our tile heuristic's kernel alone, so the file says what our own kernels reach."""
    from distgemm import autotune

    timer = Timer()
    result = {}
    for suite, dtype, fp8, fast, scaling in variants:
        peer = {None: "cublas", "block": "f_scaled_mm_block"}.get(scaling, "scaled_mm")
        rows = []
        print(f"\n== dense GEMM {dtype}: distgemm vs {peer} (TFLOP/s, ratio = {peer} time / ours)")
        for m, n, k in tqdm(shapes(quick), desc=f"gemm {dtype}", leave=False):
            a, b, sa, sb = _inputs(m, n, k, fp8, scaling)
            fns = {}
            if scaling == "block":
                fns = _block_fns(a, b, sa, sb)
            elif fp8:
                fns["ours"] = lambda: distgemm.gemm(a, b, scale_a=sa, scale_b=sb, use_fast_accum=fast)
                fns["peer"] = lambda: torch._scaled_mm(a, b.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                       use_fast_accum=fast)
                flat_a, flat_b = sa.reshape(-1), sb.reshape(-1)
                fns["kernel"] = lambda: ops.gemm(a, b, None, 1.0, 0.0, torch.bfloat16, flat_a, flat_b, fast, -1)
            else:
                fns["ours"] = lambda: distgemm.gemm(a, b)
                fns["peer"] = lambda: torch.matmul(a, b.T)
            err = _rel(fns["ours"](), fns["peer"]())
            backend = autotune.last_backend()
            flops = 2.0 * m * n * k
            times = timer.compare(fns)
            t_ours, t_peer = times["ours"], times["peer"]
            row = {"shape": {"m": m, "n": n, "k": k, "dtype": dtype}, "distgemm": entry(t_ours, flops),
                   peer: entry(t_peer, flops), "ratio": round(t_peer / t_ours, 4), "rel_err": err,
                   "backend": backend}
            shown = {"ours": row["distgemm"]["tflops"], peer: row[peer]["tflops"], "ratio": f"{row['ratio']:.3f}"}
            if "kernel" in times:
                row["our_kernel"] = entry(times["kernel"], flops)
                row["our_kernel_ratio"] = round(t_peer / times["kernel"], 4)
                shown["kernel_ratio"] = f"{row['our_kernel_ratio']:.3f}"
            shown["backend"] = backend
            rows.append(row)
            print_row(f"{dtype} M={m} N={n} K={k}", shown)
        geo = round(geomean([r["ratio"] for r in rows]), 4)
        summary = {peer: geo}
        if fp8:
            summary[f"our_kernel_vs_{peer}"] = round(geomean([r["our_kernel_ratio"] for r in rows]), 4)
            summary["backends"] = {b: sum(r["backend"] == b for r in rows) for b in {r["backend"] for r in rows}}
        print(f"geomean distgemm / {peer} ({dtype}): {summary}")
        slug = gpu_slug(1)
        path = write_results(out_dir, slug, suite, rows, summary)
        plot_ratios(path.replace(".json", ".png"), f"distgemm {dtype} GEMM vs {peer} on {slug}",
                    [f"{r['shape']['m']}x{r['shape']['n']}x{r['shape']['k']}" for r in rows],
                    {f"{peer} time / distgemm time": [r["ratio"] for r in rows]}, "speed-up")
        result[suite] = geo
    return result


def tune(out_dir: str, quick: bool = False) -> None:
    """Times every compiled configuration and swizzle on a spread of shapes; the heuristic's
    tile efficiencies and swizzle rule are read off this file."""
    timer = Timer()
    arch = device_arch(torch.device("cuda"))
    sweep = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 14336, 4096), (4096, 4096, 14336),
             (8192, 28672, 8192), (16384, 8192, 28672), (16384, 4096, 4096), (1024, 8192, 8192),
             (256, 8192, 8192), (64, 8192, 8192), (16, 4096, 4096), (2048, 2048, 2048)]
    if quick:
        sweep = sweep[:3]
    records = []
    for fp8, fast in ((False, False), (True, False), (True, True)):
        dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
        label = ("fp8_fast" if fast else "fp8") if fp8 else "bf16"
        names = ops.gemm_configs(dt, dt, torch.bfloat16, True, arch, fast)
        for m, n, k in tqdm(sweep, desc=f"tune {label}", leave=False):
            a, b, sa, sb = _inputs(m, n, k, fp8)
            heuristic = ops.gemm_select_config(m, n, k, dt, dt, torch.bfloat16, True, arch,
                                               torch.cuda.get_device_properties(0).multi_processor_count,
                                               fast)
            fns = {f"{name}/s{sw}": (lambda ci=ci, sw=sw: ops.gemm(a, b, None, 1.0, 0.0, torch.bfloat16,
                                                                   sa, sb, fast, ci, sw))
                   for (ci, name), sw in itertools.product(enumerate(names), (1, 2, 4, 8))}
            fns["heuristic"] = lambda: ops.gemm(a, b, None, 1.0, 0.0, torch.bfloat16, sa, sb, fast, -1, 0)
            times = timer.compare(fns, warmup=2, reps=10)
            auto = times.pop("heuristic")
            best = min(times, key=times.get)
            flops = 2.0 * m * n * k
            records.append({"dtype": label, "m": m, "n": n, "k": k,
                            "heuristic": names[heuristic], "heuristic_ms": auto,
                            "best": best, "best_ms": times[best],
                            "tflops": {key: round(flops / t / 1e9, 1) for key, t in times.items()}})
            print(f"tune {records[-1]['dtype']} {m}x{n}x{k}: best {best} {flops / times[best] / 1e9:.0f} "
                  f"TF/s, heuristic {names[heuristic]} {flops / auto / 1e9:.0f} TF/s", flush=True)
    geo = {"heuristic_vs_best": round(geomean([r["best_ms"] / r["heuristic_ms"] for r in records]), 4)}
    print(f"wrote {write_results(out_dir, gpu_slug(1), 'gemm_configs', records, geo)}")
