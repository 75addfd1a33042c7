"""Where a grouped GEMM's device time goes, per compiled configuration, next to torch.bmm of
the same total shape: event-timed median of the whole call (the bench's Timer), and from the
profiler each kernel's own duration (argument builder, GEMM) and the span from the first
kernel's start to the last one's end. ``python scripts/dev/grouped_profile.py [rows.json]``;
PROFILE_OUT names the JSON written."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from distgemm._library import device_arch, ops
from distgemm.bench.common import Timer, env_info

# (groups, tokens per group, N, K, pass): the sweep's worst rows and a few large ones.
DEFAULT_ROWS = [
    (4, 256, 2048, 768, "forward"), (4, 256, 2048, 768, "dgrad"), (4, 256, 2048, 768, "wgrad"),
    (32, 128, 2048, 768, "dgrad"), (8, 256, 7168, 2048, "forward"), (8, 4096, 4096, 7168, "forward"),
    (4, 2048, 28672, 4096, "wgrad"), (128, 256, 1536, 2048, "wgrad"), (8, 4096, 1536, 2048, "wgrad"),
]
KIND = {"forward": 0, "dgrad": 1, "wgrad": 2}


def kernel_times(fn, calls: int = 10) -> dict:
    """Mean device microseconds per call of each kernel fn launches, and of the span."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.cuda._sleep(1_000_000)  # the GPU ahead of the host: device time alone
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "sleep" not in e.name and "spin_kernel" not in e.name]
    if not kernels:  # this torch's profiler lists no device events: the table says what it has
        return {"table": prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8)}
    per_name: dict = {}
    for e in kernels:
        per_name.setdefault(e.name[:90], []).append(e.time_range.elapsed_us())
    # spans: consecutive groups of len(kernels)/calls kernels
    per_call = len(kernels) // calls if calls else 0
    spans = []
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    for c in range(calls):
        chunk = ordered[c * per_call:(c + 1) * per_call]
        if chunk:
            spans.append(chunk[-1].time_range.end - chunk[0].time_range.start)
    return {"kernels_us": {k: round(sum(v) / len(v), 2) for k, v in per_name.items()},
            "span_us": round(sorted(spans)[len(spans) // 2], 2) if spans else None,
            "kernels_per_call": per_call}


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rows = DEFAULT_ROWS
    if len(sys.argv) > 1:
        rows = [tuple(r) for r in json.load(open(sys.argv[1]))]
    timer = Timer()
    arch = device_arch(torch.device("cuda"))
    bf = torch.bfloat16
    records = []
    for g, mean, n, k, pass_name in rows:
        t = g * mean
        offs = torch.full((g,), mean, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
        x = torch.randn(t, k, device="cuda", dtype=bf)
        w = (torch.randn(g, n, k, device="cuda") * 0.05).to(bf)
        dy = torch.randn(t, n, device="cuda", dtype=bf)
        kind = KIND[pass_name]
        out_dtype = torch.float32 if kind == 2 else bf
        if kind == 0:
            call = lambda c: ops.grouped_mm(x, w, offs, bf, True, 0, c)
            xb, wb = x.view(g, mean, k), w.transpose(1, 2)
            peer = lambda: torch.bmm(xb, wb)
        elif kind == 1:
            call = lambda c: ops.grouped_mm(dy, w, offs, bf, False, 0, c)
            dyb = dy.view(g, mean, n)
            peer = lambda: torch.bmm(dyb, w)
        else:
            call = lambda c: ops.grouped_mm_wgrad(dy, x, offs, torch.float32, 0, c)
            dyt, xb = dy.view(g, mean, n).transpose(1, 2), x.view(g, mean, k)
            peer = lambda: torch.bmm(dyt, xb, out_dtype=torch.float32)  # torch >= 2.9
        names = ops.grouped_configs(kind, bf, out_dtype, arch)
        fns = {cfg: (lambda i=i: call(i)) for i, cfg in enumerate(names)}
        fns["bmm"] = peer
        times = timer.compare(fns, warmup=3, reps=15)
        flops = 2.0 * t * n * k
        rec = {"groups": g, "tokens_per_group": mean, "n": n, "k": k, "pass": pass_name,
               "ms": {c: round(v, 5) for c, v in times.items()},
               "vs_bmm": {c: round(times["bmm"] / v, 3) for c, v in times.items() if c != "bmm"},
               "tflops": {c: round(flops / v / 1e9, 1) for c, v in times.items()},
               "profile": {c: kernel_times(fn) for c, fn in fns.items()}}
        records.append(rec)
        best = max(rec["vs_bmm"], key=rec["vs_bmm"].get)
        print(f"{pass_name} {g}x{mean} N{n} K{k}: bmm {times['bmm'] * 1e3:.1f} us; best {best} "
              f"{times[best] * 1e3:.1f} us ({rec['vs_bmm'][best]}x); "
              + " ".join(f"{c}={rec['vs_bmm'][c]}" for c in names), flush=True)
        for c, p in rec["profile"].items():
            if "table" in p:
                print(p["table"], flush=True)
                continue
            print(f"   {c}: span {p['span_us']} us, " + "; ".join(f"{kn[:48]}={us}" for kn, us in p["kernels_us"].items()), flush=True)
    out = os.environ.get("PROFILE_OUT", "grouped_profile.json")
    with open(out, "w") as f:
        json.dump({"env": env_info(1), "rows": records}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
