"""Why the dense autotuner and the sweep benchmark can rank a short memory-bound GEMM differently
(25 x 9216 x 7168: the tuner kept our tile, the sweep timed it 5.5% behind cuBLAS). Times the
same candidates (every compiled tile and cuBLAS) on the same operands, in one process, under
each timing discipline, several times over:

- tuner:              autotune's own (_medians: rounds of 5 consecutive calls per candidate,
                      L2 flushed and ~0.5 ms queued before each)
- tuner_sleep2ms:     the same with the benchmark's ~1 ms of queued work
- tuner_interleaved:  the tuner's calls, the candidates taking turns call by call, ~1 ms queued
- tuner_timer_flush:  the tuner's discipline flushing with the benchmark Timer's buffer
- tuner_events_first: the tuner's discipline, each call's events made before its flush and wait
- bench:              bench.common.Timer.compare (the candidates interleaved in a fresh order
                      every call, L2 flushed and ~1 ms queued before each)
- bench_tuner_flush:  the same flushing with the tuner's buffer
- tuner_choice:       what autotune.choose picks (cache cleared first)

Measured at 058ed21, 46e44de and 8cc6327 (bench/results/h200_tuner_probe_*.json): the tuner's
timings read these shapes 15-20% slower than the benchmark's, cuBLAS more than our tiles,
whatever the discipline; the flush buffer alone flipped the ranking, because until the flush buffer moved to the GPU
the Timer's buffer lived on the host (made with device=None): the benchmark did not flush the
GPU's L2 at all. Both now flush the GPU, so the *_flush variants no longer differ by design.
``python scripts/dev/tuner_probe.py [MxNxK ...]``; ``PROBE_OUT`` names the JSON."""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Optional

import torch

import distgemm
from distgemm import autotune, dense
from distgemm._library import ops
from distgemm.bench.common import Timer, env_info

SHAPES = [(25, 9216, 7168), (16, 9216, 7168), (128, 16384, 7168)]
REPEATS = 3


def _time(order: dict, reps: int, flush: torch.Tensor, sleep_cycles: int, interleave: bool = False,
          events_first: bool = False) -> dict:
    """Median device time of `reps` calls of each candidate: all of one candidate's calls in a
    row (the tuner), or the candidates taking turns call by call."""
    names = list(order)
    calls = ([name for _ in range(reps) for name in names] if interleave
             else [name for name in names for _ in range(reps)])
    pairs = {name: [] for name in names}
    for name in calls:
        if events_first:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        torch.cuda._sleep(sleep_cycles)
        if not events_first:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        order[name]()
        e.record()
        pairs[name].append((s, e))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in p) for name, p in pairs.items()}


def _tuner_style(cands: dict, flush: torch.Tensor, sleep_cycles: int, **how) -> dict:
    samples = {name: [] for name in cands}
    for _ in range(autotune._ROUNDS):
        for name, t in _time(cands, autotune._REPS, flush, sleep_cycles, **how).items():
            samples[name].append(t)
    return {name: statistics.median(v) for name, v in samples.items()}


def _bench_with_flush(timer: Timer, cands: dict, flush: torch.Tensor) -> dict:
    own = timer._flush
    timer._flush = flush
    try:
        return timer.compare(cands, reps=20)
    finally:
        timer._flush = own


def probe(m: int, n: int, k: int, timer: Timer) -> dict:
    bf = torch.bfloat16
    a = torch.randn(m, k, device="cuda", dtype=bf)
    b = torch.randn(n, k, device="cuda", dtype=bf)
    names = dense._config_names(bf, bf, bf, True, 90)
    cands = {f"cutlass:{name}": (lambda i=i: ops.gemm(a, b, None, 1.0, 0.0, bf, None, None, False, i))
             for i, name in enumerate(names)}
    cands = {name: fn for name, fn in cands.items() if _runs(fn)}
    cands["cublas"] = lambda: torch.nn.functional.linear(a, b)
    cands["cublas_matmul"] = lambda: torch.matmul(a, b.t())
    for fn in cands.values():
        fn()
    flush = autotune.flush_buffer()
    methods = {
        "tuner": lambda: _tuner_style(cands, flush, 1_000_000),
        "tuner_sleep2ms": lambda: _tuner_style(cands, flush, 2_000_000),
        "tuner_interleaved": lambda: _tuner_style(cands, flush, 2_000_000, interleave=True),
        "tuner_timer_flush": lambda: _tuner_style(cands, timer._flush, 1_000_000),
        "tuner_events_first": lambda: _tuner_style(cands, flush, 1_000_000, events_first=True),
        "bench": lambda: timer.compare(cands, reps=20),
        "bench_tuner_flush": lambda: _bench_with_flush(timer, cands, flush),
    }
    runs = {name: [] for name in list(methods) + ["tuner_choice"]}
    for _ in range(REPEATS):
        for name, run in methods.items():
            runs[name].append(run())
        autotune.clear()
        distgemm.gemm(a, b)
        runs["tuner_choice"].append(autotune.last_backend())
    best = {method: [min(r, key=r.get) for r in results] for method, results in runs.items() if method != "tuner_choice"}
    return {"shape": [m, n, k], "runs": runs, "fastest": best}


def format_times(times: dict, limit: Optional[int] = None) -> str:
    """The fastest `limit` (all: None) candidates' times in us, each with cuBLAS time / its own."""
    fastest = sorted(times.items(), key=lambda kv: kv[1])[:limit]
    return "  ".join(f"{name.replace('cutlass:', '')}={t * 1e3:.1f}({times['cublas'] / t:.3f})" for name, t in fastest)


def shapes_from_argv(default: list) -> list:
    """The MxNxK shapes named on the command line, else `default` (both probes take them)."""
    return [tuple(int(x) for x in s.split("x")) for s in sys.argv[1:]] or default


def write_results(results: list) -> None:
    """The probe's results with the environment, into the JSON file PROBE_OUT names (if any)."""
    out = os.environ.get("PROBE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"env": env_info(), "results": results}, f, indent=1)


def _runs(fn) -> bool:
    try:
        fn()
        return True
    except (RuntimeError, ValueError, NotImplementedError):
        return False


def main() -> None:
    shapes = shapes_from_argv(SHAPES)
    os.environ.setdefault("DISTGEMM_AUTOTUNE_CACHE", "/tmp/tuner_probe_cache.json")
    timer = Timer()
    results = []
    for m, n, k in shapes:
        r = probe(m, n, k, timer)
        results.append(r)
        print(f"== {m}x{n}x{k}: tuner picks {r['runs']['tuner_choice']}")
        for method in (m for m in r["runs"] if m != "tuner_choice"):
            for i, times in enumerate(r["runs"][method]):
                print(f"  {method:<18} #{i}: {format_times(times, 4)}", flush=True)
    write_results(results)


if __name__ == "__main__":
    main()
