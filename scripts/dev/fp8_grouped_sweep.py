"""Sweep: every compiled FP8 grouped configuration (build with DISTGEMM_TUNING_INSTANCES=ON)
on the DeepSeek-V3 MoE shapes, forward (block, row) and wgrad, with the heuristic's pick.
Prints TFLOP/s per config; writes JSON. A developer probe for choosing the default tiles."""

import json
import sys

import torch

import distgemm
from distgemm._library import ops

E4M3 = torch.float8_e4m3fn


def bench(fn, iters=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def offs_of(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32).cuda()


SHAPES = [(8, 4096, 4096, 7168), (8, 4096, 7168, 2048), (32, 1024, 4096, 7168),
          (32, 1024, 7168, 2048), (64, 512, 4096, 7168), (4, 8192, 7168, 2048)]
rows = []
for g, per, n, k in SHAPES:
    t = g * per
    offs = offs_of([per] * g)
    x, w = torch.randn(t, k, device="cuda").to(E4M3), torch.randn(g, n, k, device="cuda").to(E4M3)
    kb, nb = (k + 127) // 128, (n + 127) // 128
    sx_b, sw_b = (torch.rand(kb, t, device="cuda") + 0.5).t(), torch.rand(g, kb, nb, device="cuda") + 0.5
    sx_r, sw_r = torch.rand(t, device="cuda") + 0.5, torch.rand(g, n, device="cuda") + 0.5
    flop = 2 * t * n * k
    for mode, code, sx, sw in (("block", 2, sx_b, sw_b), ("row", 1, sx_r, sw_r)):
        names = ops.grouped_configs(0, E4M3, torch.bfloat16, 90, code)
        for config in [-1] + list(range(len(names))):
            ms = bench(lambda: ops.grouped_mm_fp8(x, w, offs, sx, sw, code, torch.bfloat16, config))
            r = dict(op=f"forward_{mode}", g=g, per=per, n=n, k=k,
                     config="heuristic" if config < 0 else names[config], ms=ms, tflops=flop / ms / 1e9)
            print(json.dumps(r), flush=True)
            rows.append(r)
    # wgrad: dy^T (N, Tp), x^T (K, Tp), padded per expert (balanced: per is a multiple of 128).
    tp = 128 * ((t + 127) // 128 + g)
    dy_t, x_t = torch.randn(n, tp, device="cuda").to(E4M3), torch.randn(k, tp, device="cuda").to(E4M3)
    s_dy, s_x = torch.rand(tp // 128, n, device="cuda") + 0.5, torch.rand(tp // 128, k, device="cuda") + 0.5
    out = torch.zeros(g, n, k, device="cuda")
    names = ops.grouped_configs(2, E4M3, torch.float32, 90, 2)
    for config in [-1] + list(range(len(names))):
        ms = bench(lambda: ops.grouped_mm_wgrad_fp8_out(dy_t, x_t, offs, s_dy, s_x, out, True, config))
        r = dict(op="wgrad_block", g=g, per=per, n=n, k=k,
                 config="heuristic" if config < 0 else names[config], ms=ms, tflops=flop / ms / 1e9)
        print(json.dumps(r), flush=True)
        rows.append(r)
    del x, w, dy_t, x_t, out
    torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "fp8_grouped_sweep.json", "w"), indent=1)
