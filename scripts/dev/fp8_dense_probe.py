"""Probe: the FP8 block-scaled grouped kernel with one group as a dense GEMM, against
torch._scaled_mm (per-tensor, row-wise, fast) and F.scaled_mm-free block loop, on the dense
suite's shapes. Prints TFLOP/s and ratios; a developer probe, not a benchmark of record."""

import json
import sys

import torch

import distgemm
from distgemm._library import ops
from distgemm.bench.common import Timer




timer = Timer()
SHAPES = [(8192, 8192, 8192), (4096, 7168, 2048), (4096, 2112, 7168), (4096, 24576, 1536),
          (4096, 4096, 7168), (4096, 7168, 16384), (128, 7168, 2048), (2048, 2048, 2048)]
rows = []
for m, n, k in SHAPES:
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
    one = torch.ones((), device="cuda")
    offs = torch.tensor([m], dtype=torch.int32, device="cuda")
    kb, nb = (k + 127) // 128, (n + 127) // 128
    sxb = (torch.rand(kb, m, device="cuda") + 0.5).t()
    swb = torch.rand(1, kb, nb, device="cuda") + 0.5
    w = b.unsqueeze(0)
    flop = 2 * m * n * k
    r = {"m": m, "n": n, "k": k}
    fns = {
        "ours_row": lambda: ops.grouped_mm_fp8(a, w, offs, sa.view(-1), sb.view(1, -1), 1, torch.bfloat16),
        "ours_block": lambda: ops.grouped_mm_fp8(a, w, offs, sxb, swb, 2, torch.bfloat16),
        "scaled_mm_row": lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
        "scaled_mm_tensor": lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "scaled_mm_tensor_fast": lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                          out_dtype=torch.bfloat16, use_fast_accum=True),
        "distgemm_gemm_row": lambda: distgemm.gemm(a, b, scale_a=sa.view(-1), scale_b=sb.view(-1)),
    }
    r.update(timer.compare(fns))
    for key in list(r):
        if isinstance(r[key], float):
            r[key + "_tflops"] = flop / r[key] / 1e9
    if "ours_row" in r:
        r["row_vs_scaled_mm_row"] = r["scaled_mm_row"] / r["ours_row"]
        r["row_vs_scaled_mm_tensor"] = r["scaled_mm_tensor"] / r["ours_row"]
        r["row_vs_distgemm_gemm_row"] = r["distgemm_gemm_row"] / r["ours_row"]
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    rows.append(r)
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "fp8_dense_probe.json", "w"), indent=1)
