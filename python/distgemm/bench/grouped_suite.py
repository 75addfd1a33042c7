"""Grouped GEMM suite (MoE): distgemm's one-launch CUTLASS kernel against a per-expert
cuBLAS loop, multi-stream cuBLAS, torch._grouped_mm and (equal groups) torch.bmm, for the
forward, dgrad and wgrad GEMMs of each layer shape, same inputs, same timer."""

from __future__ import annotations


import torch
from tqdm import tqdm

import distgemm

from .common import Timer, entry, geomean, gpu_slug, host_ms, plot_ratios, print_row, with_settings, write_results

# (name, experts G, mean tokens per expert, N, K, routing)
SUITE = [
    ("seed-8x4096", 8, 4096, 768, 2048, "balanced"),
    ("seed-16x2048", 16, 2048, 768, 2048, "balanced"),
    ("8x512", 8, 512, 768, 2048, "balanced"),
    ("128x256", 128, 256, 768, 2048, "balanced"),
    ("8x4096-N2048-K768", 8, 4096, 2048, 768, "balanced"),
    ("32x1024-N4096-K7168", 32, 1024, 4096, 7168, "balanced"),
    ("dsv3-up", 32, 2048, 2048, 7168, "balanced"),
    ("dsv3-up-zipf", 32, 2048, 2048, 7168, "zipf"),
    ("dsv3-down", 32, 2048, 7168, 2048, "balanced"),
    ("dsv3-down-zipf", 32, 2048, 7168, 2048, "zipf"),
]
SMALL_M = ("8x512", "128x256")


def counts_for(groups: int, mean: int, routing: str) -> list:
    total = groups * mean
    if routing == "balanced":
        return [mean] * groups
    weights = [1.0 / (r + 1) ** 1.1 for r in range(groups)]  # Zipf over the experts
    counts = [int(total * w / sum(weights)) for w in weights]
    counts[0] += total - sum(counts)
    return counts


def _backend_call(name: str, fn):
    return with_settings({"grouped_backend": name}, fn)


def _rel(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()


def run(out_dir: str, quick: bool = False) -> dict:
    timer = Timer()
    suite = SUITE[:3] if quick else SUITE
    rows = []
    print("\n== grouped GEMM bf16 (TFLOP/s; ratio = peer time / ours)")
    for name, g, mean, n, k, routing in tqdm(suite, desc="grouped", leave=False):
        counts = counts_for(g, mean, routing)
        t = sum(counts)
        offs = torch.tensor(counts, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
        host_bounds = [0] + torch.tensor(counts).cumsum(0).tolist()
        x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
        w = (torch.randn(g, n, k, device="cuda") * 0.05).to(torch.bfloat16)
        dy = torch.randn(t, n, device="cuda").to(torch.bfloat16)
        flops = 2.0 * t * n * k
        equal = routing == "balanced"

        def loop(fn):
            return lambda: [fn(e, host_bounds[e], host_bounds[e + 1]) for e in range(g)]

        passes = {
            "forward": {
                "distgemm": _backend_call("cutlass", lambda: distgemm.grouped_mm(x, w, offs)),
                "multistream_cublas": _backend_call("cublas", lambda: distgemm.grouped_mm(x, w, offs)),
                "torch_grouped_mm": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
                "loop": loop(lambda e, s, f: torch.matmul(x[s:f], w[e].T)),
                "bmm": (lambda: torch.bmm(x.view(g, mean, k), w.transpose(1, 2))) if equal else None,
            },
            "dgrad": {
                "distgemm": _backend_call("cutlass", lambda: distgemm.grouped_mm(dy, w, offs, trans_w=False)),
                "multistream_cublas": _backend_call("cublas", lambda: distgemm.grouped_mm(dy, w, offs, trans_w=False)),
                "torch_grouped_mm": lambda: torch._grouped_mm(dy, w, offs=offs),
                "loop": loop(lambda e, s, f: torch.matmul(dy[s:f], w[e])),
                "bmm": (lambda: torch.bmm(dy.view(g, mean, n), w)) if equal else None,
            },
            # FP32 weight gradients (main_grad) against the loop, cuBLAS and bmm ...
            "wgrad": {
                "distgemm": _backend_call("cutlass", lambda: distgemm.grouped_mm_wgrad(dy, x, offs)),
                "multistream_cublas": _backend_call("cublas", lambda: distgemm.grouped_mm_wgrad(dy, x, offs)),
                "loop": loop(lambda e, s, f: torch.mm(dy[s:f].T, x[s:f], out_dtype=torch.float32)),
                "bmm": (lambda: torch.bmm(dy.view(g, mean, n).transpose(1, 2), x.view(g, mean, k),
                                          out_dtype=torch.float32)) if equal else None,
            },
            # ... and bfloat16 ones against torch._grouped_mm, which gives bfloat16 only.
            "wgrad_bf16": {
                "distgemm": _backend_call("cutlass", lambda: distgemm.grouped_mm_wgrad(
                    dy, x, offs, out_dtype=torch.bfloat16)),
                "torch_grouped_mm": lambda: torch._grouped_mm(dy.T, x, offs=offs),
                "loop": loop(lambda e, s, f: torch.mm(dy[s:f].T, x[s:f])),
            },
        }
        for pass_name, impls in passes.items():
            ours = impls["distgemm"]()
            reference = impls["loop"]()
            if isinstance(reference, list):
                reference = torch.stack(reference) if pass_name.startswith("wgrad") else torch.cat(reference)
            err = _rel(ours, reference)
            row = {"shape": {"name": name, "groups": g, "tokens_per_group": mean, "n": n, "k": k,
                             "routing": routing, "pass": pass_name, "counts": counts}, "rel_err_vs_loop": err}
            times = timer.compare({impl: fn for impl, fn in impls.items() if fn is not None})
            for impl, ms in times.items():
                row[impl] = entry(ms, flops)
            row["ratios"] = {impl: round(row[impl]["ms"] / row["distgemm"]["ms"], 4)
                             for impl in impls if impl != "distgemm" and impl in row}
            if pass_name == "forward":  # CPU time per call: what bounds the smallest layers
                row["host_ms"] = {impl: round(host_ms(impls[impl]), 4)
                                  for impl in ("distgemm", "torch_grouped_mm")}
            rows.append(row)
            print_row(f"{pass_name:7s} {name}", {"ours": row["distgemm"]["tflops"],
                      **{p: f"{r:.2f}x" for p, r in row["ratios"].items()},
                      **({"host_us": "/".join(f"{v * 1e3:.0f}" for v in row["host_ms"].values())}
                         if "host_ms" in row else {})})

    def geo(pass_name, peer, subset=None):
        vals = [r["ratios"][peer] for r in rows if r["shape"]["pass"] == pass_name and peer in r["ratios"]
                and (subset is None or r["shape"]["name"] in subset)]
        return round(geomean(vals), 4) if vals else None

    summary = {}
    for pass_name in ("forward", "dgrad", "wgrad", "wgrad_bf16"):
        for peer in ("torch_grouped_mm", "multistream_cublas", "loop", "bmm"):
            summary[f"{pass_name}_vs_{peer}"] = geo(pass_name, peer)
    summary["forward_vs_torch_grouped_mm_min"] = min(r["ratios"]["torch_grouped_mm"] for r in rows
                                                     if r["shape"]["pass"] == "forward")
    summary["forward_small_m_vs_torch_grouped_mm"] = geo("forward", "torch_grouped_mm", SMALL_M)
    print("geomeans (peer time / ours):", {k: v for k, v in summary.items() if v is not None})
    slug = gpu_slug(1)
    path = write_results(out_dir, slug, "grouped", rows, summary)
    labels = [f"{r['shape']['pass'][:3]} {r['shape']['name']}" for r in rows]
    plot_ratios(path.replace(".json", ".png"), f"distgemm grouped GEMM vs peers on {slug} (bf16)", labels,
                {peer: [r["ratios"].get(peer, 0) for r in rows]
                 for peer in ("torch_grouped_mm", "multistream_cublas", "loop")}, "peer time / distgemm time")
    return {"grouped_forward_vs_torch": summary["forward_vs_torch_grouped_mm"],
            "grouped_wgrad_vs_loop": summary["wgrad_vs_loop"],
            "grouped_wgrad_bf16_vs_torch": summary["wgrad_bf16_vs_torch_grouped_mm"]}


def tune(out_dir: str, quick: bool = False) -> None:
    """Times every compiled grouped configuration on the suite's shapes and the sweep's
    model shapes (forward and dgrad bf16, FP32 wgrad) next to the cost model's pick (config
    -1); the cost model is read off this file."""
    from .._library import device_arch, ops
    from .sweep_suite import grouped_rows

    timer = Timer()
    arch = device_arch(torch.device("cuda"))
    records = []
    shapes = list(SUITE[:3] if quick else SUITE)
    if not quick:
        shapes += [(f"{r['name']} {r['groups']}x{r['tokens_per_group']}", r["groups"], r["tokens_per_group"],
                    r["n"], r["k"], r["routing"]) for r in grouped_rows()]
    for name, g, mean, n, k, routing in shapes:
        counts = counts_for(g, mean, routing)
        t = sum(counts)
        offs = torch.tensor(counts, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
        x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
        w = (torch.randn(g, n, k, device="cuda") * 0.05).to(torch.bfloat16)
        dy = torch.randn(t, n, device="cuda").to(torch.bfloat16)
        flops = 2.0 * t * n * k
        for kind, out_dtype, call in (
                (0, torch.bfloat16, lambda c: ops.grouped_mm(x, w, offs, torch.bfloat16, True, 0, c)),
                (1, torch.bfloat16, lambda c: ops.grouped_mm(dy, w, offs, torch.bfloat16, False, 0, c)),
                (2, torch.float32, lambda c: ops.grouped_mm_wgrad(dy, x, offs, torch.float32, 0, c))):
            names = ops.grouped_configs(kind, torch.bfloat16, out_dtype, arch)
            fns = {cfg: (lambda i=i: call(i)) for i, cfg in enumerate(names)}
            times = timer.compare({**fns, "heuristic": lambda: call(-1)}, warmup=2, reps=10)
            auto = times.pop("heuristic")
            best = min(times, key=times.get)
            records.append({"shape": name, "groups": g, "tokens_per_group": mean, "n": n, "k": k,
                            "routing": routing, "pass": ("forward", "dgrad", "wgrad")[kind],
                            "heuristic_ms": auto, "best": best, "best_ms": times[best],
                            "tflops": {cfg: round(flops / ms / 1e9, 1) for cfg, ms in times.items()},
                            "heuristic_tflops": round(flops / auto / 1e9, 1)})
            print(f"tune grouped {records[-1]['pass']} {name}: best {best} {flops / times[best] / 1e9:.0f} "
                  f"TF/s, heuristic {flops / auto / 1e9:.0f} TF/s; "
                  + " ".join(f"{c}={v}" for c, v in records[-1]["tflops"].items()), flush=True)
    geo = {"heuristic_vs_best": round(geomean([r["best_ms"] / r["heuristic_ms"] for r in records]), 4)}
    print(f"wrote {write_results(out_dir, gpu_slug(1), 'grouped_configs', records, geo)}")
