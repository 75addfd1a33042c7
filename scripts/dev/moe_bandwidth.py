"""Developer probe: the MoE memory-bound passes (distgemm.moe.activation in each form, the weight
quantization) in GB/s of bytes moved, beside a plain device copy of the same bytes, on the
shapes of the moe suite. Writes PROBE_OUT (JSON) when set. With --ncu, runs each kernel once
inside a profiler range (for `ncu --profile-from-start off`)."""

import json
import os
import sys

import torch

from distgemm import moe
from distgemm.bench.common import Timer

T = 32768
SHAPES = ((8, 7168, 2048), (64, 2048, 768))


def main():
    ncu = "--ncu" in sys.argv
    dev = "cuda"
    timer = None if ncu else Timer()
    rows = []
    for experts, hidden, ffn in SHAPES:
        counts = [T // experts] * experts
        offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
        x = torch.randn(T, hidden, device=dev).bfloat16()
        h = torch.randn(T, 2 * ffn, device=dev).bfloat16()
        da = torch.randn(T, ffn, device=dev).bfloat16()
        w1 = torch.randn(experts, 2 * ffn, hidden, device=dev).bfloat16()
        tp = 128 * (T // 128 + experts)
        cases = {
            "x: rows + transpose": (lambda: moe.activation(x, offs=offs, bf16=False, fp8_rows=True, fp8_transposed=True),
                                    2 * T * hidden + T * hidden + hidden * tp),
            "swiglu: rows + transpose": (lambda: moe.activation(h, "swiglu", offs=offs, bf16=False, fp8_rows=True,
                                                                fp8_transposed=True), 4 * T * ffn + T * ffn + ffn * tp),
            "swiglu backward: rows + transpose": (lambda: moe.activation(h, "swiglu", dy=da, offs=offs, bf16=False,
                                                                         fp8_rows=True, fp8_transposed=True),
                                                  6 * T * ffn + 2 * T * ffn + 2 * ffn * tp),
            "weight: both copies": (lambda: moe.quantize_weight(w1, "block"), 4 * w1.numel()),
            "weight: forward copy": (lambda: moe.quantize_weight(w1, "block", copies="forward"), 3 * w1.numel()),
        }
        for name, (fn, nbytes) in cases.items():
            src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            copy = lambda: dst.copy_(src)  # noqa: E731  (reads and writes nbytes in all)
            if ncu:
                fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                continue
            t = timer.compare({"ours": fn, "copy": copy}, warmup=3, reps=15)
            row = {"shape": f"{experts}x{T // experts} H{hidden} F{ffn}", "case": name, "bytes": nbytes,
                   "ours_ms": round(t["ours"], 4), "copy_ms": round(t["copy"], 4),
                   "ours_GBps": round(nbytes / t["ours"] / 1e6, 1), "copy_GBps": round(nbytes / t["copy"] / 1e6, 1),
                   "ours_vs_copy": round(t["ours"] / t["copy"], 3)}
            rows.append(row)
            print(f"{row['shape']:<20} {name:<36} {row['ours_ms']:.3f} ms  {row['ours_GBps']:7.0f} GB/s  "
                  f"copy {row['copy_GBps']:7.0f} GB/s  ours/copy time {row['ours_vs_copy']:.2f}x", flush=True)
        if ncu:
            break
    if os.environ.get("PROBE_OUT") and rows:
        from distgemm.bench.common import env_info

        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump({"env": env_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
