"""The FP8 fast-accumulation rows where the autotuner once picked our tile over torch._scaled_mm
and then ran behind it: its pick and the ratio (peer time / ours) timed by the bench Timer."""
import json

import torch

import distgemm
from distgemm import autotune
from distgemm.bench.common import Timer
t = Timer()
for m, n, k in [(8192, 28672, 4096), (16384, 14336, 28672), (4096, 28672, 28672), (8192, 14336, 14336)]:
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
    ours = lambda: distgemm.gemm(a, b, scale_a=sa, scale_b=sb, use_fast_accum=True)
    ours()
    be = autotune.last_backend()
    peer = lambda: torch._scaled_mm(a, b.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)
    r = t.compare({"ours": ours, "peer": peer})
    print(json.dumps({"shape": [m, n, k], "backend": be, "ratio": round(r["peer"] / r["ours"], 4)}), flush=True)
