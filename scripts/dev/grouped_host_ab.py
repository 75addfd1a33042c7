"""Host time of a repeated distgemm.grouped_mm call (the repeat-call fast path) with the call
signature as built now (it records the operands' 16-byte alignment) against one without
that field, interleaved over rounds in one process. A developer probe; prints microseconds."""

import json
import statistics

import torch

import distgemm
from distgemm import grouped
from distgemm.bench.common import host_ms

bf = torch.bfloat16
g, mean, n, k = 8, 512, 768, 2048
offs = torch.full((g,), mean, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
x = torch.randn(g * mean, k, device="cuda").to(bf)
w = torch.randn(g, n, k, device="cuda").to(bf)
with_alignment = grouped._call_signature


def without_alignment(x, w, offs, out_dtype, trans_w):
    sig = with_alignment(x, w, offs, out_dtype, trans_w)
    return None if sig is None else sig[:14] + sig[15:]


times = {"with_alignment": [], "without_alignment": [], "torch_grouped_mm": []}
for _ in range(7):
    for name, sig in (("with_alignment", with_alignment), ("without_alignment", without_alignment)):
        grouped._call_signature = sig
        grouped._REPEAT_CALLS.clear()
        times[name].append(host_ms(lambda: distgemm.grouped_mm(x, w, offs), calls=40) * 1e3)
    times["torch_grouped_mm"].append(host_ms(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), calls=40) * 1e3)
print(json.dumps({name: round(statistics.median(v), 2) for name, v in times.items()}))
print("backend:", distgemm.autotune.last_backend())
