"""Does the grouped autotuner pick the configuration the benchmark times fastest? For rows of
the grouped suite (Zipf routing included), every compiled configuration and torch._grouped_mm
are timed as the benchmark times them (Timer.compare: interleaved, L2 flushed), and the
autotuner is asked to choose REPEATS times from scratch (memory and file cache cleared), as
the suite's first call of a problem does under DISTGEMM_GROUPED_BACKEND=cutlass; and every
configuration is timed sustained: all of them round-robin, the GPU never idle, no flush.
``python scripts/dev/grouped_tuner_probe.py``; ``PROBE_OUT`` names the JSON written."""

from __future__ import annotations

import json
import os
import tempfile

import torch

import distgemm
from distgemm import autotune
from distgemm._library import device_arch, ops
from distgemm.bench.common import Timer, env_info, sustained_ms, with_settings
from distgemm.bench.grouped_suite import counts_for

# (name, groups, mean tokens per group, N, K, routing, pass): the suite's rows whose figures
# moved most between two runs of the same kernels (75f19bc and 08520bb), and a small one.
ROWS = [
    ("dsv3-up-zipf", 32, 2048, 2048, 7168, "zipf", "forward"),
    ("dsv3-up", 32, 2048, 2048, 7168, "balanced", "forward"),
    ("32x1024-N4096-K7168", 32, 1024, 4096, 7168, "balanced", "forward"),
    ("32x1024-N4096-K7168", 32, 1024, 4096, 7168, "balanced", "dgrad"),
    ("dsv3-down-zipf", 32, 2048, 7168, 2048, "zipf", "dgrad"),
    ("dsv3-down-zipf", 32, 2048, 7168, 2048, "zipf", "wgrad"),
    ("8x512", 8, 512, 768, 2048, "balanced", "forward"),
]
REPEATS = 3
KIND = {"forward": 0, "dgrad": 1, "wgrad": 2}


def main() -> None:
    cache = os.path.join(tempfile.mkdtemp(), "autotune.json")
    with distgemm.settings(autotune_cache=cache):
        probe(cache)


def probe(cache: str) -> None:
    timer = Timer()
    arch = device_arch(torch.device("cuda"))
    bf = torch.bfloat16
    records = []
    for name, g, mean, n, k, routing, pass_name in ROWS:
        counts = counts_for(g, mean, routing)
        t = sum(counts)
        offs = torch.tensor(counts, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
        x = torch.randn(t, k, device="cuda").to(bf)
        w = (torch.randn(g, n, k, device="cuda") * 0.05).to(bf)
        dy = torch.randn(t, n, device="cuda").to(bf)
        kind = KIND[pass_name]
        out_dtype = torch.float32 if kind == 2 else bf
        if kind == 0:
            call = lambda c: ops.grouped_mm(x, w, offs, bf, True, 0, c)
            api = lambda: distgemm.grouped_mm(x, w, offs)
            peer = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        elif kind == 1:
            call = lambda c: ops.grouped_mm(dy, w, offs, bf, False, 0, c)
            api = lambda: distgemm.grouped_mm(dy, w, offs, trans_w=False)
            peer = lambda: torch._grouped_mm(dy, w, offs=offs)
        else:
            call = lambda c: ops.grouped_mm_wgrad(dy, x, offs, torch.float32, 0, c)
            api = lambda: distgemm.grouped_mm_wgrad(dy, x, offs)
            peer = None
        names = ops.grouped_configs(kind, bf, out_dtype, arch)
        fns = {cfg: (lambda i=i: call(i)) for i, cfg in enumerate(names)}
        if peer is not None:
            fns["torch_grouped_mm"] = peer
        times = timer.compare(fns, warmup=3, reps=15)
        choices = []
        for _ in range(REPEATS):
            autotune.clear()
            if os.path.exists(cache):
                os.remove(cache)
            with_settings({"grouped_backend": "cutlass"}, api)()
            choices.append(autotune.last_backend())
        tuned = with_settings({"grouped_backend": "cutlass"}, api)
        fastest = fns[min(names, key=times.get)]
        times.update(timer.compare({"api_after_tuning": tuned, "fastest_config": fastest}, warmup=3, reps=15))
        flops = 2.0 * t * n * k
        sustained = sustained_ms(fns, warmup=1, reps=12)
        rec = {"name": name, "groups": g, "tokens_per_group": mean, "n": n, "k": k, "routing": routing,
               "pass": pass_name, "counts": counts, "tuner_choices": choices,
               "tflops": {c: round(flops / v / 1e9, 1) for c, v in times.items()},
               "sustained_tflops": {c: round(flops / v / 1e9, 1) for c, v in sustained.items()}}
        records.append(rec)
        ranked = sorted(rec["tflops"].items(), key=lambda kv: -kv[1])
        print(f"{pass_name} {name}: tuner chose {choices}; " + ", ".join(f"{c}={v}" for c, v in ranked), flush=True)
        ranked = sorted(rec["sustained_tflops"].items(), key=lambda kv: -kv[1])
        print("   sustained (round-robin, GPU never idle): " + ", ".join(f"{c}={v}" for c, v in ranked), flush=True)
    out = os.environ.get("PROBE_OUT", "grouped_tuner_probe.json")
    with open(out, "w") as f:
        json.dump({"env": env_info(1), "rows": records}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
