"""Developer probe: the MoE memory-bound passes (distgemm.moe.activation in each form, the weight
quantization, and the routing: permute's gather, unpermute's combine and both backwards) in GB/s
of bytes moved, beside a plain device copy of the same bytes, on the shapes of the moe and
moe_layer suites. Writes PROBE_OUT (JSON) when set. With --ncu, runs each kernel once inside a
profiler range (for `ncu --profile-from-start off`)."""

import json
import os
import sys

import torch

from distgemm import moe
from distgemm.bench.common import Timer

T = 32768
SHAPES = ((8, 7168, 2048), (64, 2048, 768))


def routing_cases(x, experts, k=4):
    """permute / unpermute of x's tokens to `experts` experts, top-k (uniform routing), forward
    and backward, with the bytes a single pass must move: the gather reads and writes T * k rows;
    the combine reads T * k rows and writes T; its backward reads T rows (and T * k for the
    weights' gradient) and writes T * k."""
    tokens, hidden = x.shape
    gen = torch.Generator(device=x.device).manual_seed(0)
    ids = torch.randint(experts, (tokens, k), generator=gen, device=x.device)
    weights = torch.rand(tokens, k, generator=gen, device=x.device)
    rows = tokens * k * hidden * 2
    p = moe.permute(x, ids, experts)
    y = p.rows.clone()
    yg = y.clone().requires_grad_()
    wg = weights.clone().requires_grad_()
    out = moe.unpermute(yg, p.row_map, wg, ids, experts)
    dout = torch.randn_like(out)
    xg = x.clone().requires_grad_()
    rows_g = moe.permute(xg, ids, experts).rows
    drows = torch.randn_like(rows_g)
    return {
        f"permute (top-{k})": (lambda: moe.permute(x, ids, experts), 2 * rows),
        f"unpermute (top-{k})": (lambda: moe.unpermute(y, p.row_map, weights, ids, experts), rows + rows // k),
        f"unpermute backward (top-{k})": (lambda: torch.autograd.grad(out, (yg, wg), dout, retain_graph=True),
                                          rows // k + 2 * rows),
        f"permute backward (top-{k})": (lambda: torch.autograd.grad(rows_g, xg, drows, retain_graph=True),
                                        rows + rows // k),
    }


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
        cases.update(routing_cases(x, experts))
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
