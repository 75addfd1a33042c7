"""Achieved memory bandwidth of distgemm.quantize_fp8 per granularity, next to a plain cast of
x to float8 (the same bytes: read x, write one byte per element) and the PyTorch reference.

    python scripts/dev/quantize_bandwidth.py [--rows 16384] [--cols 7168] [--groups 32]

Bytes counted: the input once, the FP8 data and the scales once (the per-tensor scale reads x
twice; counted once, so its figure is the effective rate)."""

from __future__ import annotations

import argparse

import torch

import distgemm
from distgemm.quantize import reference_quantize_fp8


def timed(fn, iters: int = 50) -> float:
    """Median milliseconds per call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=7168)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    x = torch.randn(args.rows, args.cols, device="cuda").to(getattr(torch, args.dtype))
    counts = torch.distributions.Dirichlet(torch.ones(args.groups)).sample() * args.rows
    offs = counts.floor().long().cumsum(0).clamp(max=args.rows).to(torch.int32).cuda()
    offs[-1] = args.rows
    cast_out = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    moved = x.numel() * (x.element_size() + 1)
    cast_ms = timed(lambda: cast_out.copy_(x))
    print(f"x {tuple(x.shape)} {args.dtype} on {torch.cuda.get_device_name()}")
    print(f"{'plain cast to float8 (copy_)':34s} {moved / cast_ms / 1e6:8.0f} GB/s  {cast_ms * 1e3:8.1f} us")
    cases = [("tensor", {}), ("row", {}), ((1, 128), {}), ((128, 128), {}),
             ((1, 128), dict(transpose=True)), ((1, 128), dict(transpose=True, offs=offs))]
    for granularity, kw in cases:
        data, scale = distgemm.quantize_fp8(x, granularity, **kw)
        nbytes = x.numel() * x.element_size() + data.numel() + scale.numel() * 4
        ms = timed(lambda: distgemm.quantize_fp8(x, granularity, **kw))
        ref_ms = timed(lambda: reference_quantize_fp8(x, granularity, torch.float8_e4m3fn, **kw), iters=5)
        name = f"{granularity}{' transposed' if kw.get('transpose') else ''}{' grouped' if 'offs' in kw else ''}"
        print(f"{name:34s} {nbytes / ms / 1e6:8.0f} GB/s  {ms * 1e3:8.1f} us   (PyTorch reference "
              f"{ref_ms / ms:5.1f}x slower)")


if __name__ == "__main__":
    main()
