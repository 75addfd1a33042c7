"""Targets for Nsight Compute: each GEMM below runs twice (warm-up, autotuning), then once
between cudaProfilerStart/Stop, so that
``ncu --profile-from-start off --kernel-name regex:'device_kernel|nvjet' python scripts/dev/ncu_probe.py``
profiles one launch of each. A developer probe: where the FP8 wgrad (FP32 main_grad) and the
store-bound bf16 FP32 wgrads lose time against the forward GEMM and cuBLAS.
``NCU_PROBE=fp8_configs``: every compiled FP8 block forward and wgrad configuration instead."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from distgemm._library import ops

E4M3 = torch.float8_e4m3fn


def fp8_operands(g: int, per: int, n: int, k: int) -> SimpleNamespace:
    """Random e4m3 operands and scales of one balanced shape: the block forward's x, w and
    their scales, and the wgrad's dy^T, x^T padded per expert (as it reads them) with an FP32
    out."""
    t = g * per
    kb, nb = (k + 127) // 128, (n + 127) // 128
    tp = 128 * ((t + 127) // 128 + g)
    return SimpleNamespace(
        tag=f"{g}x{per}_n{n}_k{k}",
        offs=torch.full((g,), per, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32),
        x=torch.randn(t, k, device="cuda").to(E4M3), w=torch.randn(g, n, k, device="cuda").to(E4M3),
        sx=(torch.rand(kb, t, device="cuda") + 0.5).t(), sw=torch.rand(g, kb, nb, device="cuda") + 0.5,
        dy_t=torch.randn(n, tp, device="cuda").to(E4M3), x_t=torch.randn(k, tp, device="cuda").to(E4M3),
        s_dy=torch.rand(tp // 128, n, device="cuda") + 0.5, s_x=torch.rand(tp // 128, k, device="cuda") + 0.5,
        out=torch.zeros(g, n, k, device="cuda"))


def fp8_forward(o: SimpleNamespace, config: int):
    return lambda: ops.grouped_mm_fp8(o.x, o.w, o.offs, o.sx, o.sw, 2, torch.bfloat16, config)


def fp8_wgrad(o: SimpleNamespace, accumulate: bool, config: int):
    return lambda: ops.grouped_mm_wgrad_fp8_out(o.dy_t, o.x_t, o.offs, o.s_dy, o.s_x, o.out, accumulate, config)


def fp8_targets(g: int, per: int, n: int, k: int) -> dict:
    o = fp8_operands(g, per, n, k)
    return {
        f"fp8_forward_block_{o.tag}": fp8_forward(o, -1),
        f"fp8_wgrad_accumulate_{o.tag}": fp8_wgrad(o, True, -1),
        f"fp8_wgrad_overwrite_{o.tag}": fp8_wgrad(o, False, -1),
    }


def bf16_wgrad_targets(g: int, per: int, n: int, k: int) -> dict:
    bf = torch.bfloat16
    t = g * per
    offs = torch.full((g,), per, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
    x, dy = torch.randn(t, k, device="cuda", dtype=bf), torch.randn(t, n, device="cuda", dtype=bf)
    dyt, xb = dy.view(g, per, n).transpose(1, 2), x.view(g, per, k)
    tag = f"{g}x{per}_n{n}_k{k}"
    config = ops.grouped_configs(2, bf, torch.float32, 90).index("coop_128x128_c2x1")
    return {
        f"bf16_wgrad_ours_{tag}": lambda: ops.grouped_mm_wgrad(dy, x, offs, torch.float32, 0, config),
        f"bf16_wgrad_bmm_{tag}": lambda: torch.bmm(dyt, xb, out_dtype=torch.float32),
    }


def fp8_config_targets(g: int, per: int, n: int, k: int) -> dict:
    """Every compiled FP8 block forward and accumulating wgrad configuration of one shape."""
    o = fp8_operands(g, per, n, k)
    targets = {}
    for c, name in enumerate(ops.grouped_configs(0, E4M3, torch.bfloat16, 90, 2)):
        targets[f"fp8_forward_{name}_{o.tag}"] = fp8_forward(o, c)
    for c, name in enumerate(ops.grouped_configs(2, E4M3, torch.float32, 90, 2)):
        targets[f"fp8_wgrad_{name}_{o.tag}"] = fp8_wgrad(o, True, c)
    return targets


def main() -> None:
    if os.environ.get("NCU_PROBE") == "fp8_configs":
        targets = fp8_config_targets(8, 4096, 4096, 7168)
    else:
        targets = {**fp8_targets(8, 4096, 4096, 7168), **fp8_targets(64, 512, 4096, 7168),
                   **bf16_wgrad_targets(128, 256, 1536, 2048)}
    for fn in targets.values():
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in targets.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()
    print("profiled in order:", " ".join(targets))


if __name__ == "__main__":
    main()
