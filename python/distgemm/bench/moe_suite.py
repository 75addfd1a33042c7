"""MoE expert-MLP suite: one training step of the expert MLP (fc1 -> activation -> fc2 per
expert; forward, backward, and the optimizer's in-place weight update, so that FP8 weight
copies are made anew every step) on 32,768 routed tokens, balanced and skewed (Pareto) routing.

Layers (ratio = peer step time / ours, > 1: ours faster):

- ``distgemm bf16``: :class:`distgemm.nn.GroupedMLP` in bf16; ``distgemm block`` / ``row``: the
  same module with ``fp8="block"`` (1 x 128 activations, 128 x 128 weights) / ``fp8="row"``.
  Weight gradients accumulate into FP32 ``main_grad`` (zeroed inside the timed step, as a
  framework does once per optimizer step).
- ``distgemm block, save_original_input``: the block layer keeping x for the backward instead
  of its FP8 transposed copy (time and memory; not in the geomean).
- ``distgemm bf16, overwrite`` / ``distgemm block, overwrite``: the weights flagged
  ``overwrite_main_grad`` (TransformerEngine's flag, Megatron-FSDP's mode): the wgrads write
  ``main_grad`` instead of adding to it, so it is neither zeroed nor read; the counterpart of
  torch's gradients set to None (not in the geomean).
- ``torch bf16``: the same layer written with ``torch._grouped_mm`` and autograd, its grads set
  to None every step (the issue's peer). ``loop bf16``: a per-expert loop of ``torch.matmul``
  (host-known group sizes), forward only figures and the step.

Each row prints the step time of each layer, the ratios, the FP8 layers' step against torch
bf16, peak memory of one step (allocated bytes above the parameters), and a per-kernel table of
where the FP8 step's GPU time goes (torch.profiler, one step), grouped into GEMMs,
quantization / activation passes, copies and casts, and the rest. Results:
bench/results/<gpu>_moe.json + .png.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from .common import bench_device, entry, geomean, gpu_slug, plot_ratios, print_row, round_robin_ms, write_results

TOKENS = 32768
# The block layer keeping x for its backward instead of x's FP8 transposed copy: time and memory.
SAVE_INPUT = "distgemm block, save_original_input"
# Layers beside the three of the geomean: (name, fp8, save_original_input, overwrite_main_grad).
VARIANTS = (("distgemm bf16", None, False, False), ("distgemm block", "block", False, False),
            ("distgemm row", "row", False, False), (SAVE_INPUT, "block", True, False),
            ("distgemm bf16, overwrite", None, False, True), ("distgemm block, overwrite", "block", False, True))
# (experts, hidden, ffn): DeepSeek-V3-like, Qwen3-like, fine-grained, Mixtral-like.
LAYERS = ((8, 7168, 2048), (32, 4096, 1536), (64, 2048, 768), (16, 5120, 1408))
QUICK_LAYERS = ((8, 7168, 2048), (64, 2048, 768))


def routing_counts(experts: int, tokens: int, skewed: bool, seed: int = 0) -> List[int]:
    """Tokens per expert: equal, or a Pareto spread (shape 1.5; a few experts get many)."""
    if not skewed:
        base = [tokens // experts] * experts
        base[0] += tokens - sum(base)
        return base
    gen = torch.Generator().manual_seed(seed)
    w = torch.empty(experts).exponential_(generator=gen).mul_(2.0 / 3.0).exp_()  # Pareto(1.5) = exp(Exp / 1.5)
    c = (w / w.sum() * tokens).floor().long()
    c[int(torch.argmax(w))] += tokens - int(c.sum())
    return c.tolist()


class _TorchLayer(torch.nn.Module):
    """The same expert MLP on torch._grouped_mm (bf16, autograd)."""

    def __init__(self, w1, w2, activation):
        super().__init__()
        self.w1 = torch.nn.Parameter(w1.detach().clone())
        self.w2 = torch.nn.Parameter(w2.detach().clone())
        self.activation, self.ffn = activation, w2.shape[2]

    def forward(self, x, offs):
        h = torch._grouped_mm(x, self.w1.transpose(1, 2), offs=offs)
        if self.activation == "swiglu":
            a = torch.nn.functional.silu(h[:, :self.ffn]) * h[:, self.ffn:]
        else:
            a = torch.nn.functional.gelu(h)
        return torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs)


class _LoopLayer(_TorchLayer):
    """A per-expert loop of torch.matmul (the group sizes known on the host)."""

    def __init__(self, w1, w2, activation, counts):
        super().__init__(w1, w2, activation)
        self.counts = counts

    def forward(self, x, offs):
        outs, start = [], 0
        for g, n in enumerate(self.counts):
            xg = x[start:start + n]
            h = xg @ self.w1[g].T
            a = (torch.nn.functional.silu(h[:, :self.ffn]) * h[:, self.ffn:] if self.activation == "swiglu"
                 else torch.nn.functional.gelu(h))
            outs.append(a @ self.w2[g].T)
            start += n
        return torch.cat(outs)


def give_main_grads(weights, overwrite: bool) -> List[torch.Tensor]:
    """An FP32 main_grad for each weight, flagged overwrite_main_grad or not; returns those the
    step zeroes (a framework zeroes accumulated ones every step, overwritten ones need not be)."""
    for w in weights:
        w.main_grad, w.overwrite_main_grad = torch.zeros(w.shape, device=w.device), overwrite
    return [] if overwrite else [w.main_grad for w in weights]


def _step(layer, x, offs, dy, params, main_grads) -> Callable[[], None]:
    def run():
        for g in main_grads:
            g.zero_()
        for p in params:
            p.grad = None
        layer(x, offs).backward(dy)
        with torch.no_grad():
            for p in params:
                p.mul_(1.0 - 1e-4)  # an optimizer's in-place update: FP8 copies must be made anew
    run.params = list(params) + ([x] if x.requires_grad else [])  # whose .grad the step makes anew
    return run


def _peak_mb(fn: Callable[[], None]) -> float:
    """The most memory one step of `fn` (a _step) holds above what was allocated before it. The
    previous step's gradients (`fn.params`' .grad, set to None inside the step) are freed first:
    left in the base, a layer that allocates its gradients in the step (torch's bf16 .grad) would
    be credited with freeing the last step's, and its peak read short by their size. Gradients
    accumulated into preallocated FP32 main_grad (ours) are outside the step, as a framework
    holds them either way."""
    for p in getattr(fn, "params", ()):
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1)


# The first class whose keys a kernel's name holds ("distgemm::moe::act_kernel" holds "gemm" too).
KERNEL_CLASSES = (("quantize / activation", ("act_kernel", "act_pipelined", "quantize", "weight_kernel", "weight_pipelined",
                                             "group_ends", "amax")),
                  ("permute / unpermute (gather, scatter-add, sort)", ("combine", "indexfunc", "index_select", "gather",
                                                                       "scatter", "sort", "radix", "bincount")),
                  ("gemm", ("gemm", "gmm", "cutlass", "nvjet", "sm90", "device_kernel", "xmma")),
                  ("copy / cast", ("copy", "cast", "transpose", "convert")),
                  ("memset / fill (main_grad zeroed)", ("fill", "memset", "zero")),
                  ("optimizer update (p *= 1 - 1e-4)", ("aunaryfunctor", "mul")))


def kernel_table(fn: Callable[[], None], steps: int = 3) -> Tuple[List[dict], Dict[str, float], Dict[str, float]]:
    """`steps` back-to-back steps under torch.profiler (as the timed rounds run them: no sync
    between): each kernel's GPU time per step (us), the time per class, and the steps' span on
    the GPU (first kernel's start to last kernel's end) with the part of it no kernel ran
    (waiting on the host, a sync, or launch gaps), per step."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels: Dict[str, List[float]] = {}
    intervals: List[Tuple[float, float]] = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            kernels.setdefault(ev.name, []).append(ev.device_time_total / steps)
            intervals.append((ev.time_range.start, ev.time_range.end))
    rows, classes = tabulate_kernels(kernels)
    for r in rows:  # calls per step (a kernel some steps skip: a fraction)
        r["calls"] = r["calls"] // steps if r["calls"] % steps == 0 else round(r["calls"] / steps, 2)
    span = gpu_span(intervals)
    return rows, classes, {k: round(v / steps, 1) for k, v in span.items()}


def gpu_span(intervals: List[Tuple[float, float]]) -> Dict[str, float]:
    """The span of a step's kernels (us, start of the first to end of the last) and the part of
    it covered by none (kernels on other streams may overlap: their union counts once)."""
    if not intervals:
        return {"span_us": 0.0, "idle_us": 0.0}
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            busy += e - max(s, end)
            end = e
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    return {"span_us": round(span, 1), "idle_us": round(span - busy, 1)}


def tabulate_kernels(kernels: Dict[str, List[float]]) -> Tuple[List[dict], Dict[str, float]]:
    """Kernel name -> the GPU times of its calls (us), as rows (longest total first) and the
    time per class of KERNEL_CLASSES ("other" for the rest)."""
    rows = sorted(({"kernel": k[:120], "calls": len(v), "us": round(sum(v), 1)} for k, v in kernels.items()),
                  key=lambda r: -r["us"])
    classes: Dict[str, float] = {}
    for r in rows:
        name = r["kernel"].lower()
        cls = next((c for c, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other")
        classes[cls] = round(classes.get(cls, 0.0) + r["us"], 1)
    return rows, classes


def record_kernels(entry: dict, name: str, fn: Callable[[], None]) -> None:
    """Profiles back-to-back steps of `fn`, keeps its longest kernels, its time per class and its
    GPU span and idle time (per step) in `entry`, and prints them."""
    table, classes, span = kernel_table(fn)
    entry["kernels"] = table[:25]
    entry["kernel_classes_us"] = classes
    entry["gpu_span"] = span
    total = sum(classes.values())
    print(f"    {name} GPU time by class ({total / 1e3:.2f} ms): " + ", ".join(
        f"{c} {us / 1e3:.2f} ms ({100 * us / total:.0f}%)" for c, us in classes.items()))
    print(f"      span {span['span_us'] / 1e3:.2f} ms, of it no kernel running {span['idle_us'] / 1e3:.2f} ms")
    for k in table[:8]:
        print(f"      {k['us'] / 1e3:8.3f} ms  {k['calls']!s:>4}x  {k['kernel'][:90]}")


def run(out_dir: str, quick: bool, activations=("swiglu", "gelu")) -> Dict[str, object]:
    from distgemm.nn import GroupedMLP

    dev = bench_device()
    rows = []
    print("\n== moe suite: expert MLP training step (fwd + bwd + in-place update), 32768 tokens")
    for activation in activations:
        for experts, hidden, ffn in (QUICK_LAYERS if quick else LAYERS):
            for skewed in (False, True):
                counts = routing_counts(experts, TOKENS, skewed)
                offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
                torch.manual_seed(0)
                x = torch.randn(TOKENS, hidden, device=dev).bfloat16()
                dy = torch.randn(TOKENS, hidden, device=dev).bfloat16()
                layers, steps = {}, {}
                for name, fp8, save, overwrite in VARIANTS:
                    m = GroupedMLP(experts, hidden, ffn, activation=activation, device=dev, fp8=fp8,
                                   fuse_wgrad_accumulation=True, save_original_input=save)
                    layers[name] = m
                    steps[name] = _step(m, x, offs, dy, list(m.parameters()),
                                        give_main_grads((m.fc1_weight, m.fc2_weight), overwrite))
                ref = layers["distgemm bf16"]
                tl = _TorchLayer(ref.fc1_weight, ref.fc2_weight, activation)
                steps["torch bf16"] = _step(tl, x, offs, dy, list(tl.parameters()), [])
                if not quick:
                    ll = _LoopLayer(ref.fc1_weight, ref.fc2_weight, activation, counts)
                    steps["loop bf16"] = _step(ll, x, offs, dy, list(ll.parameters()), [])
                flops = 2 * TOKENS * hidden * ffn * (3 if activation == "swiglu" else 2) * 3
                for fn in steps.values():  # warm-up (autotuning of the grouped GEMMs happens here)
                    fn()
                    fn()
                times = round_robin_ms(steps, reps=5 if quick else 10)
                label = f"{activation} {experts}x{TOKENS // experts} H{hidden} F{ffn} {'pareto' if skewed else 'balanced'}"
                row = {"activation": activation, "experts": experts, "hidden": hidden, "ffn": ffn,
                       "routing": "pareto" if skewed else "balanced", "counts_max": max(counts),
                       "counts_zero": sum(c == 0 for c in counts)}
                for name, ms in times.items():
                    row[name] = entry(ms, flops)
                for name in steps:
                    row[name]["peak_mb"] = _peak_mb(steps[name])
                for name in ("distgemm bf16", "distgemm block", "distgemm row"):
                    row[name]["vs_torch_bf16"] = round(times["torch bf16"] / times[name], 3)
                cols = {n.replace("distgemm ", ""): f"{t:.2f}ms" for n, t in times.items()}
                cols.update({f"{n.split()[-1]}/torch": f"{row[n]['vs_torch_bf16']:.2f}x"
                             for n in ("distgemm bf16", "distgemm block", "distgemm row")})
                cols["mem block/torch"] = f"{row['distgemm block']['peak_mb'] / max(row['torch bf16']['peak_mb'], 1):.2f}x"
                for name in (SAVE_INPUT, "distgemm bf16, overwrite", "distgemm block, overwrite"):
                    row[name]["vs_torch_bf16"] = round(times["torch bf16"] / times[name], 3)
                cols["save_input: time, mem /torch"] = (
                    f"{row[SAVE_INPUT]['vs_torch_bf16']:.2f}x, "
                    f"{row[SAVE_INPUT]['peak_mb'] / max(row['torch bf16']['peak_mb'], 1):.2f}x")
                cols["overwrite bf16, block /torch"] = (f"{row['distgemm bf16, overwrite']['vs_torch_bf16']:.2f}x, "
                                                        f"{row['distgemm block, overwrite']['vs_torch_bf16']:.2f}x")
                print_row(label, cols)
                if not skewed:
                    for name in ("distgemm block", "distgemm bf16", "distgemm row", "distgemm block, overwrite",
                                 "torch bf16"):
                        record_kernels(row[name], name, steps[name])
                rows.append(row)
                # each row as it lands: a run cut off by a time limit keeps what it measured
                write_results(out_dir, gpu_slug(1), "moe", rows, {}, extra={"complete": False})
                del layers, steps
                torch.cuda.empty_cache()
    geo = {name: round(geomean([r[name]["vs_torch_bf16"] for r in rows]), 4)
           for name in ("distgemm bf16", "distgemm block", "distgemm row")}
    slug = gpu_slug(1)
    path = write_results(out_dir, slug, "moe", rows, geo)
    labels = [f"{r['activation'][:2]} {r['experts']}e H{r['hidden']} {r['routing'][:3]}" for r in rows]
    plot_ratios(path.replace(".json", ".png"), "expert MLP step: torch bf16 time / ours", labels,
                {n: [r[n]["vs_torch_bf16"] for r in rows] for n in geo}, "speed-up vs torch bf16 layer")
    print(f"  geomean vs torch bf16: {geo}; {path}")
    return {f"moe {k}": v for k, v in geo.items()}
