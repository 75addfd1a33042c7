"""Host suite: the CPU time to enqueue one repeated call (the GPU kept busy, so enqueueing never
waits on it), distgemm's public op against the call a user would make instead, on shapes where
the host shows: ``gemm`` in bf16 (``torch.matmul``), in FP8 with one scale per tensor or per
row (``torch._scaled_mm``) and with 128-block scales (``F.scaled_mm``, its scales prepared once
in its layouts), and ``grouped_mm`` in bf16 (``torch._grouped_mm``). Each row also says which
backend ours ran. Ratio = the peer's host time / ours (> 1: ours cheaper). Results:
bench/results/<gpu>_host.json + .png."""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

import distgemm

from .common import gpu_slug, host_ms, plot_ratios, print_row, write_results
from .gemm_suite import _inputs

CALLS = 200
# (label, M, N, K): a decode-sized, a small and a mid-sized GEMM.
GEMM_SHAPES = (("m128", 128, 4096, 4096), ("m1024", 1024, 4096, 4096), ("m4096", 4096, 4096, 4096))
GEMM_SHAPES_QUICK = GEMM_SHAPES[:2]
# (label, groups, tokens per group, N, K): the 8 x 512 tokens, and a finer-grained layer.
GROUPED_SHAPES = (("8x512", 8, 512, 768, 2048), ("64x64", 64, 64, 1536, 2048))


def _peer_fp8(a, b, sa, sb, scaling: str) -> Callable[[], torch.Tensor]:
    """The vendor call a user of that recipe makes, its operands and scales in its forms."""
    if scaling == "block":
        from .._torch_block_scaled import cublas_scale_a, cublas_scale_b, scaled_mm_block

        bt, csa, csb = b.t(), cublas_scale_a(sa), cublas_scale_b(sb)
        return lambda: scaled_mm_block(a, bt, csa, csb)
    bt = b.t()
    return lambda: torch._scaled_mm(a, bt, sa, sb, out_dtype=torch.bfloat16)


def gemm_cases(quick: bool) -> List[Tuple[str, Callable[[], object], Callable[[], object]]]:
    """(label, ours, peer) for every dense recipe and shape."""
    cases = []
    for label, m, n, k in (GEMM_SHAPES_QUICK if quick else GEMM_SHAPES):
        a, b, _, _ = _inputs(m, n, k, fp8=False)
        cases.append((f"gemm bf16 {label}", lambda a=a, b=b: distgemm.gemm(a, b), lambda a=a, b=b: torch.matmul(a, b.T)))
        for scaling in ("tensor", "row", "block"):
            a8, b8, sa, sb = _inputs(m, n, k, fp8=True, scaling=scaling)
            # distgemm takes row-wise scales as M and N values; torch._scaled_mm as (M, 1) and (1, N)
            ours_sa, ours_sb = (sa.reshape(-1), sb.reshape(-1)) if scaling == "row" else (sa, sb)
            cases.append((f"gemm fp8 {scaling} {label}",
                          lambda a=a8, b=b8, sa=ours_sa, sb=ours_sb: distgemm.gemm(a, b, scale_a=sa, scale_b=sb),
                          _peer_fp8(a8, b8, sa, sb, scaling)))
    return cases


def grouped_cases() -> List[Tuple[str, Callable[[], object], Callable[[], object]]]:
    cases = []
    for label, g, per, n, k in GROUPED_SHAPES:
        offs = torch.full((g,), per, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
        x = torch.randn(g * per, k, device="cuda").to(torch.bfloat16)
        w = (torch.randn(g, n, k, device="cuda") * 0.05).to(torch.bfloat16)
        wt = w.transpose(-2, -1)
        cases.append((f"grouped_mm bf16 {label}", lambda x=x, w=w, offs=offs: distgemm.grouped_mm(x, w, offs),
                      lambda x=x, wt=wt, offs=offs: torch._grouped_mm(x, wt, offs=offs, out_dtype=torch.bfloat16)))
    return cases


def run(out_dir: str, quick: bool) -> Dict[str, object]:
    print(f"\n== host suite: CPU us to enqueue one repeated call ({CALLS} calls, the GPU busy); "
          "ratio = peer / ours (>1: ours cheaper)")
    rows, labels, ratios = [], [], []
    for label, ours, peer in gemm_cases(quick) + grouped_cases():
        try:
            peer()
        except (RuntimeError, TypeError, ValueError, ImportError, AttributeError) as e:  # a torch without it
            print_row(label, {"peer": f"unavailable ({str(e)[:60]})"})
            continue
        ours()  # the first call settles the choice (autotuning), as in training
        ours_us = host_ms(ours, calls=CALLS) * 1e3
        backend = distgemm.autotune.last_backend()
        peer_us = host_ms(peer, calls=CALLS) * 1e3
        ratio = peer_us / ours_us
        rows.append({"case": label, "ours_us": round(ours_us, 2), "peer_us": round(peer_us, 2),
                     "peer_over_ours": round(ratio, 3), "ours_backend": backend})
        labels.append(label)
        ratios.append(ratio)
        print_row(label, {"ours": f"{ours_us:.1f} us", "peer": f"{peer_us:.1f} us", "ratio": f"{ratio:.2f}x",
                          "ours ran": str(backend)})
    slug = gpu_slug(1)
    path = write_results(out_dir, slug, "host", rows, {})
    plot_ratios(path.replace(".json", ".png"), "host time per repeated call: peer / distgemm (>1: ours cheaper)",
                labels, {"peer / ours": ratios}, "ratio")
    worst = min(ratios) if ratios else float("nan")
    return {"host (worst peer/ours)": round(worst, 3)}
