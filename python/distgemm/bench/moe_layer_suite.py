"""MoE layer suite: the whole expert path of an MoE layer from the router's top-k (permute ->
every expert's SwiGLU MLP -> probability-weighted unpermute; forward, backward and the
optimizer's in-place weight update), on uniform and skewed routing.

Layers (ratio = peer time / ours, > 1: ours faster):

- ``distgemm bf16`` / ``distgemm block``: :class:`distgemm.nn.MoEExperts` in bf16 / with
  ``fp8="block"``, weight gradients into FP32 ``main_grad``.
- ``distgemm block, overwrite``: the block layer with its weights flagged
  ``overwrite_main_grad`` (wgrads written into ``main_grad``, not zeroed and added to).
- ``torch bf16``: the same layer from torch ops: a stable ``argsort`` of the expert ids,
  ``index_select`` of the rows, ``torch._grouped_mm`` for both GEMMs, ``index_add_`` of the
  weighted outputs in FP32 (autograd, grads set to None every step).

Each row prints the forward and the step time of each layer, forward and backward TFLOP/s (the
expert GEMMs' FLOPs: what SonicMoE and DeepGEMM report), the ratios and the peak memory, and for
the uniform routing where the GPU time of the FP8 and bf16 steps goes, kernel by kernel.
Results: bench/results/<gpu>_moe_layer.json + .png.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from .common import bench_device, geomean, gpu_slug, plot_ratios, print_row, round_robin_ms, write_results
from .moe_suite import _peak_mb, _step, give_main_grads, record_kernels

# (experts, top-k, hidden, ffn, tokens): SonicMoE's H100 layer; Qwen3-30B-A3B-like; Mixtral-like;
# fine-grained (256 small experts, top-8: the 1.5x row); top-1. The quick run keeps the
# two goal rows.
CASES = ((64, 4, 4096, 2048, 32768), (128, 8, 2048, 768, 16384), (8, 2, 4096, 14336, 16384),
         (256, 8, 4096, 512, 16384), (16, 1, 4096, 4096, 16384))
QUICK_CASES = (CASES[0], CASES[3])


def routing(tokens: int, experts: int, k: int, skewed: bool, device, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """A router's top-k: k distinct experts per token (uniform logits, or logits with a Pareto
    bias per expert so that a few experts get most tokens) and their softmax weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    if skewed:
        logits += 3.0 * torch.empty(experts).exponential_(generator=gen).mul_(2.0 / 3.0)
    top, ids = logits.topk(k, dim=1)
    return ids.to(torch.int32).to(device), torch.softmax(top, dim=1).to(device)


class _TorchMoE(torch.nn.Module):
    """The same layer from torch ops (bf16, autograd)."""

    def __init__(self, w1, w2):
        super().__init__()
        self.w1 = torch.nn.Parameter(w1.detach().clone())
        self.w2 = torch.nn.Parameter(w2.detach().clone())
        self.ffn = w2.shape[2]

    def forward(self, x, topk_ids, topk_weights):
        experts, k = self.w1.shape[0], topk_ids.shape[1]
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        offs = torch.bincount(flat, minlength=experts).cumsum(0).to(torch.int32)
        token = torch.div(order, k, rounding_mode="floor")
        h = torch._grouped_mm(x.index_select(0, token), self.w1.transpose(1, 2), offs=offs)
        a = torch.nn.functional.silu(h[:, :self.ffn]) * h[:, self.ffn:]
        y = torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs)
        weighted = y.float() * topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token, weighted)
        return out.to(x.dtype)


class _PermutedMoE(torch.nn.Module):
    """An MoEExperts layer run the unfused way: permute (the bf16 rows), the experts on them,
    unpermute; the same parameters. It measures what gathering in the quantization pass saves."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, topk_ids, topk_weights):
        from distgemm import moe

        p = moe.permute(x, topk_ids, self.layer.num_experts)
        y = self.layer.experts(p.rows, p.offs)
        return moe.unpermute(y, p.row_map, topk_weights, topk_ids, self.layer.num_experts)


def _adapt(layer, topk_ids, topk_weights):
    """The layer as moe_suite._step calls a layer: (x, offs) -> output; x's gradient starts anew
    every call, as the parameters' do."""
    def call(x, _offs):
        x.grad = None
        return layer(x, topk_ids, topk_weights)
    return call


def run(out_dir: str, quick: bool) -> Dict[str, object]:
    from distgemm.nn import MoEExperts

    dev = bench_device()
    rows = []
    names = ("distgemm bf16", "distgemm block", "torch bf16")
    print("\n== moe_layer suite: permute -> SwiGLU experts -> unpermute, training step (fwd + bwd + update)")
    for experts, k, hidden, ffn, tokens in (QUICK_CASES if quick else CASES):
        for skewed in (False, True):
            topk_ids, topk_weights = routing(tokens, experts, k, skewed, dev)
            torch.manual_seed(0)
            x = torch.randn(tokens, hidden, device=dev).bfloat16().requires_grad_()
            dy = torch.randn(tokens, hidden, device=dev).bfloat16()
            steps, forwards, layers = {}, {}, {}
            # The block layer with overwrite_main_grad too (Megatron-FSDP's mode): main_grad written,
            # not zeroed and added to, as torch's gradients are set to None and written.
            for name, fp8, overwrite in (("distgemm bf16", None, False), ("distgemm block", "block", False),
                                         ("distgemm block, overwrite", "block", True)):
                m = MoEExperts(experts, hidden, ffn, activation="swiglu", device=dev, fp8=fp8,
                               fuse_wgrad_accumulation=True)
                grads = give_main_grads((m.experts.fc1_weight, m.experts.fc2_weight), overwrite)
                layers[name] = m
                call = _adapt(m, topk_ids, topk_weights)
                steps[name] = _step(call, x, None, dy, list(m.parameters()), grads)
                if not overwrite:  # its forward is the block layer's
                    forwards[name] = (lambda c: lambda: c(x, None))(call)
            unfused = _PermutedMoE(layers["distgemm block"])
            block = layers["distgemm block"].experts
            steps["distgemm block, permuted"] = _step(_adapt(unfused, topk_ids, topk_weights), x, None, dy,
                                                      list(unfused.parameters()),
                                                      [block.fc1_weight.main_grad, block.fc2_weight.main_grad])
            ref = layers["distgemm bf16"].experts
            tl = _TorchMoE(ref.fc1_weight, ref.fc2_weight)
            call = _adapt(tl, topk_ids, topk_weights)
            steps["torch bf16"] = _step(call, x, None, dy, list(tl.parameters()), [])
            forwards["torch bf16"] = lambda: call(x, None)
            for fn in steps.values():  # warm-up (autotuning of the grouped GEMMs happens here)
                fn()
                fn()
            with torch.no_grad():  # the peer computes the same layer (same weights, bf16 rounding apart)
                ours, theirs = forwards["distgemm bf16"]().float(), forwards["torch bf16"]().float()
                rel_err = float((ours - theirs).norm() / theirs.norm().clamp_min(1e-30))
            step_ms = round_robin_ms(steps, reps=5 if quick else 8)
            fwd_ms = round_robin_ms(forwards, reps=5 if quick else 8)
            flops_fwd = 2 * tokens * k * hidden * 3 * ffn
            routed = "skewed" if skewed else "uniform"
            row = {"experts": experts, "topk": k, "hidden": hidden, "ffn": ffn, "tokens": tokens, "routing": routed,
                   "max_expert_rows": int(torch.bincount(topk_ids.reshape(-1).long(), minlength=experts).max()),
                   "bf16_vs_torch_rel_err": round(rel_err, 5)}
            for name in names:
                bwd = max(step_ms[name] - fwd_ms[name], 1e-6)
                row[name] = {"step_ms": round(step_ms[name], 4), "fwd_ms": round(fwd_ms[name], 4),
                             "fwd_tflops": round(flops_fwd / fwd_ms[name] / 1e9, 1),
                             "bwd_tflops": round(2 * flops_fwd / bwd / 1e9, 1), "peak_mb": _peak_mb(steps[name])}
            for name in names[:2]:
                row[name]["vs_torch_bf16"] = round(step_ms["torch bf16"] / step_ms[name], 3)
            # The gather in the FP8 quantization pass against permute-then-quantize, same layer.
            row["distgemm block"]["permuted_step_ms"] = round(step_ms["distgemm block, permuted"], 4)
            row["distgemm block"]["vs_permuted"] = round(step_ms["distgemm block, permuted"] / step_ms["distgemm block"], 3)
            row["distgemm block"]["overwrite_step_ms"] = round(step_ms["distgemm block, overwrite"], 4)
            row["distgemm block"]["overwrite_vs_torch_bf16"] = round(step_ms["torch bf16"] /
                                                                     step_ms["distgemm block, overwrite"], 3)
            label = f"{experts}e top{k} H{hidden} F{ffn} T{tokens} {routed}"
            cols = {}
            for name in names:
                r = row[name]
                cols[name.replace("distgemm ", "")] = (f"{r['step_ms']:.2f}ms (fwd {r['fwd_tflops']:.0f} / "
                                                       f"bwd {r['bwd_tflops']:.0f} TF/s)")
            cols.update({f"{n.split()[-1]}/torch": f"{row[n]['vs_torch_bf16']:.2f}x" for n in names[:2]})
            cols["block/permuted"] = f"{row['distgemm block']['vs_permuted']:.2f}x"
            cols["block overwrite/torch"] = f"{row['distgemm block']['overwrite_vs_torch_bf16']:.2f}x"
            cols["mem block/torch"] = f"{row['distgemm block']['peak_mb'] / max(row['torch bf16']['peak_mb'], 1):.2f}x"
            print_row(label, cols)
            if not skewed:
                for name in ("distgemm block", "distgemm bf16", "torch bf16"):
                    record_kernels(row[name], name, steps[name])
            rows.append(row)
            # each row as it lands: a run cut off by a time limit keeps what it measured
            write_results(out_dir, gpu_slug(1), "moe_layer", rows, {}, extra={"complete": False})
            del layers, steps, forwards, tl
            torch.cuda.empty_cache()
    geo = {name: round(geomean([r[name]["vs_torch_bf16"] for r in rows]), 4) for name in names[:2]}
    path = write_results(out_dir, gpu_slug(1), "moe_layer", rows, geo)
    labels = [f"{r['experts']}e k{r['topk']} H{r['hidden']} {r['routing'][:4]}" for r in rows]
    plot_ratios(path.replace(".json", ".png"), "MoE layer step: torch bf16 time / ours", labels,
                {n: [r[n]["vs_torch_bf16"] for r in rows] for n in geo}, "speed-up vs torch bf16 layer")
    print(f"  geomean vs torch bf16: {geo}; {path}")
    return {f"moe_layer {k}": v for k, v in geo.items()}
