"""Where the time of a tensor-parallel call goes, one process per GPU (``torchrun
--nproc-per-node=P scripts/dev/tp_timeline.py --only 'attn-out t4096'``): a few calls of
ours are profiled (CUPTI through torch.profiler) and every kernel and copy of the window is
written per rank to DIR/timeline_<label>_<variant>_rank<r>.json; rank 0 prints, per shape and
variant, the window per call and how much of it each stream spent in GEMMs, copies, waits and
idle. A developer's tool: it tells a launch gap from a late flag from a slow GEMM."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist

import distgemm

from distgemm.bench.common import parse_variants, with_settings
from distgemm.bench.tp_suite import graphed, shapes, shard_operands


def _kind(event: dict) -> str:
    name = event["name"]
    if event.get("cat") == "gpu_memcpy" or "Memcpy" in name:
        return "copy"
    for small in ("wait_flag", "signal", "begin_call", "scatter_scales"):
        if small in name:
            return small
    return "gemm"


def profile_calls(fn, calls: int, graph: bool):
    """Device events of `calls` back-to-back calls of fn: [(kind, name, stream, start_us, dur_us)].
    With `graph`, the calls are captured once and one replay is profiled: the device's own
    timeline, without the profiler's (large) host overhead pacing the launches."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    replay = graphed(fn, calls) if graph else None
    if replay is not None:
        replay()
        torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if replay is not None:
            replay()
        else:
            for _ in range(calls):
                fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and
              e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        return []
    t0 = min(e["ts"] for e in events)
    return sorted(((_kind(e), e["name"][:60], e.get("tid"), round(e["ts"] - t0, 2), round(e["dur"], 2))
                   for e in events), key=lambda x: x[3])


def summarize(events, calls: int) -> dict:
    """Per call: the window, and per stream the time in each kind plus the idle time."""
    if not events:
        return {}
    span = max(s + d for _, _, _, s, d in events)
    streams = {}
    for kind, _, tid, start, dur in events:
        st = streams.setdefault(str(tid), {})
        st[kind] = st.get(kind, 0.0) + dur
    out = {"window_us_per_call": round(span / calls, 1)}
    for tid, kinds in streams.items():
        busy = sum(kinds.values())
        out[f"stream {tid}"] = {**{k: round(v / calls, 1) for k, v in sorted(kinds.items())},
                                "idle": round((span - busy) / calls, 1)}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="timeline")
    parser.add_argument("--only", required=True, help="comma-separated substrings of shape labels")
    parser.add_argument("--variants", default="", help="'name:VAR=value,...;name2:...' (default: as is)")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--graph", action="store_true", help="profile a CUDA graph replay of the calls")
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    os.makedirs(args.out, exist_ok=True)
    variants = {"default": {}, **parse_variants(args.variants)}
    only = [s for s in args.only.split(",") if s]
    for label, kind, m, k, n in shapes(world, False, only):
        torch.manual_seed(0)
        _, _, call = shard_operands(kind, m, k, n, world, group)
        for name, envs in variants.items():
            events = profile_calls(with_settings(envs, call), args.calls, args.graph)
            slug = label.replace(" ", "_")
            with open(os.path.join(args.out, f"timeline_{slug}_{name}_rank{rank}.json"), "w") as f:
                json.dump({"label": label, "variant": name, "env": envs, "calls": args.calls,
                           "events": events}, f)
            if rank == 0:
                print(f"{label:28s} {name:12s}", json.dumps(summarize(events, args.calls)), flush=True)
    distgemm.check_errors()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
