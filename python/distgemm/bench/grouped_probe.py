"""Why did our grouped forward on 8 experts x 512 tokens time twice as slow when the suite
interleaved the implementations? ``python -m distgemm.bench.grouped_probe``: times our forward
right after each other implementation (and after itself), on the same inputs and timer."""

from __future__ import annotations

import json
import os

import torch

import distgemm

from .common import Timer, median
from .grouped_suite import _backend_call


def main() -> None:
    g, mean, n, k = 8, 512, 768, 2048
    offs = torch.full((g,), mean, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
    x = torch.randn(g * mean, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(g, n, k, device="cuda") * 0.05).to(torch.bfloat16)
    ours = _backend_call("cutlass", lambda: distgemm.grouped_mm(x, w, offs))
    before = {
        "ours": ours,
        "multistream_cublas": _backend_call("cublas", lambda: distgemm.grouped_mm(x, w, offs)),
        "torch_grouped_mm": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
        "loop": lambda: [torch.matmul(x[e * mean:(e + 1) * mean], w[e].T) for e in range(g)],
        "bmm": lambda: torch.bmm(x.view(g, mean, k), w.transpose(1, 2)),
    }
    timer = Timer()
    flops = 2.0 * g * mean * n * k
    result = {}
    for name, pred in before.items():
        pred(), ours()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            timer.queue_ahead()
            pred()
            start.record()  # ours only, right behind the other implementation's kernels
            ours()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = median(times)
        result[name] = round(flops / ms / 1e9, 1)
        print(f"ours right after {name:20s} {ms * 1e3:7.1f} us  {result[name]} TFLOP/s", flush=True)
    out = os.environ.get("PROBE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "tflops_after": result}, f, indent=1)


if __name__ == "__main__":
    main()
