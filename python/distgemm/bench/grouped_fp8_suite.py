"""FP8 grouped GEMM suite (MoE, DeepSeek-V3 shapes): distgemm's FP8 grouped GEMM against the
PyTorch peers on the same inputs, in the same process, with the same timer.

Ops (TFLOP/s = 2*T*N*K / time; ratio = peer time / ours, >1: ours faster):

- forward_block: x (T, K) 1x128 scales, w (G, N, K) 128x128 scales (DeepSeek-V3) against a
  per-expert loop of cuBLAS block-scaled GEMMs (``F.scaled_mm`` BlockWise1x128 x
  BlockWise128x128, host-known group sizes) and our bf16 grouped GEMM on the dequantized inputs.
- forward_row: row-wise scales against ``torch._scaled_grouped_mm`` (use_fast_accum off and on).
- dgrad_block: dx = dy @ W_g, ours reading the pre-transposed FP8 weight W^T (G, K, N) that a
  training framework caches (``trans_w=False`` on its transpose: the forward-form kernel) with
  W's own 128x128 scales, against the cuBLAS loop on the same W^T, and our bf16 dgrad.
- dgrad_block_e5m2: the same dgrad with dy in e5m2 (the hybrid recipe's gradients) against the
  e4m3 one and our bf16 dgrad on dy's e5m2 values.
- wgrad_block: FP32 ``main_grad`` (G, N, K) += dy_g^T x_g from dy and x quantized per 128 tokens
  of each expert, transposed and padded (``distgemm.quantize_fp8(t, (1, 128), transpose=True,
  offs=offs)``, or the plain-PyTorch quantizer below where that is missing), against our bf16
  wgrad into FP32 on the same (dequantized) values.

Every row also checks ours against each peer once (max |ours - peer| / max |peer|, the peer's
inputs being the same FP8 values, or their bf16 dequantization), so a fast but wrong kernel
shows. A small extra table times ``distgemm.quantize_fp8`` (bf16 -> FP8, 1x128 blocks, plain
and transposed + padded per expert) in GB/s against the same quantization in plain PyTorch,
eager and under ``torch.compile`` (DISTGEMM_BENCH_COMPILE=0 leaves the compiled peer out).

Results: bench/results/<gpu>_grouped_fp8.json (rows, the quantization table under "quantize",
env) and a PNG of the summary ratios per problem. Hopper (sm_90) only, like the kernels.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from distgemm import _settings
from .common import Timer, entry, geomean, gpu_slug, host_ms, plot_ratios, print_row, write_results
from .grouped_suite import counts_for
from .._torch_block_scaled import cublas_scale_a, cublas_scale_b
from .._torch_block_scaled import scaled_mm_block as _scaled_mm_block
from .._torch_block_scaled import scaled_mm_block_v1 as _scaled_mm_block_v1

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
AMAX_EPS = 1e-12
# max |ours - peer| / max |peer| above which a row is flagged: the peers see the same FP8
# values (or their bf16 dequantization), so only the order of the FP32 sums and the bf16
# rounding of the output (and of dequantized inputs) differ, ~1e-3.
TOLERANCE = 3e-2
QUANT_TOLERANCE = 7e-2  # e4m3 rounds to 1/16 of the block's amax at worst
# The e5m2 dgrad row is checked against the bf16 dgrad on the same e5m2 values (TOLERANCE) and
# against the e4m3 dgrad, whose inputs differ by e5m2's rounding (1/8 of a value at worst):
E5M2_VS_E4M3_TOLERANCE = 0.15

# Layer shapes (name, N, K): DeepSeek-V3's fused gate+up projection and its down projection.
LAYERS = (("up", 4096, 7168), ("down", 7168, 2048))
# (experts, mean tokens per expert): 32768 tokens in every case.
EXPERTS = ((4, 8192), (8, 4096), (32, 1024), (64, 512))
ROUTINGS = ("balanced", "zipf")
# The quantization table: the activations of the 8x4096 problems, K of both layers.
QUANT_EXPERTS, QUANT_K = (8, 4096), (7168, 2048)

# summary key -> (op, peer): geomean over the op's rows of peer time / our time.
SUMMARY_RATIOS = {
    "forward_block_vs_cublas_block_loop": ("forward_block", "cublas_block_loop"),
    "forward_row_vs_torch_scaled_grouped_mm": ("forward_row", "torch_scaled_grouped_mm"),
    "forward_row_vs_torch_scaled_grouped_mm_fast": ("forward_row", "torch_scaled_grouped_mm_fast"),
    "forward_block_vs_ours_bf16": ("forward_block", "ours_bf16"),
    "dgrad_block_vs_cublas_block_loop": ("dgrad_block", "cublas_block_loop"),
    "dgrad_block_e5m2_vs_ours_e4m3": ("dgrad_block_e5m2", "ours_e4m3"),
    "wgrad_block_vs_ours_bf16_wgrad": ("wgrad_block", "ours_bf16_wgrad"),
}
# summary key -> (op, groups, tokens per expert, N, K): our TFLOP/s on that balanced shape.
SUMMARY_TFLOPS = {
    "tflops_forward_block_8x4096_n4096_k7168": ("forward_block", 8, 4096, 4096, 7168),
    "tflops_forward_block_8x4096_n7168_k2048": ("forward_block", 8, 4096, 7168, 2048),
    "tflops_wgrad_block_8x4096_n4096_k7168": ("wgrad_block", 8, 4096, 4096, 7168),
}
SKEW_KEY = "skewed_vs_balanced_forward_block"
SUMMARY_KEYS = tuple(SUMMARY_RATIOS) + (SKEW_KEY,) + tuple(SUMMARY_TFLOPS)


# ---------------------------------------------------------------- shapes and layouts (pure)


def configs(quick: bool = False) -> List[dict]:
    """The suite's problems: one dict per layer shape and expert count, with the routings
    timed on it (they share weights and activations; only the group sizes differ)."""
    if quick:  # the two 8x4096 shapes of the summary's TFLOP/s figures, Zipf on the first
        return [dict(layer="up", n=4096, k=7168, groups=8, mean=4096, routings=ROUTINGS),
                dict(layer="down", n=7168, k=2048, groups=8, mean=4096, routings=("balanced",))]
    return [dict(layer=name, n=n, k=k, groups=g, mean=mean, routings=ROUTINGS)
            for name, n, k in LAYERS for g, mean in EXPERTS]


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def group_bounds(counts: Sequence[int]) -> List[Tuple[int, int]]:
    """(first row, end row) of each group for rows laid out group after group."""
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def padded_tokens(tokens: int, groups: int) -> int:
    """Columns of the wgrad's padded per-expert layout: 128 * (ceil(T/128) + G)."""
    return BLOCK * (ceil_div(tokens, BLOCK) + groups)


def padded_starts(counts: Sequence[int]) -> List[int]:
    """First padded column of each expert: 128 * (g + start_g // 128), so every expert starts
    128-aligned and no block of 128 columns holds two experts' tokens."""
    return [BLOCK * (g + s // BLOCK) for g, (s, _) in enumerate(group_bounds(counts))]


def padded_token_index(counts: Sequence[int]) -> List[int]:
    """The padded column of each token (token i of expert g at padded_starts[g] + i)."""
    index = []
    for col, c in zip(padded_starts(counts), counts):
        index.extend(range(col, col + c))
    return index


def offsets(counts: Sequence[int], device) -> torch.Tensor:
    """int32 cumulative group ends, as distgemm and torch._scaled_grouped_mm take them."""
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 26) -> float:
    """max |ours - ref| / max |ref|, in FP32 chunks along the first dimension (the FP32
    main_grads reach 7.5 GB); nan/inf where ours holds a nan/inf."""
    if ours.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(ours.shape)} vs {tuple(ref.shape)}")
    if ours.numel() == 0:
        return 0.0
    a_all = ours.reshape(ours.shape[0] if ours.dim() else 1, -1)
    b_all = ref.reshape(a_all.shape[0], -1)
    rows = max(1, chunk // a_all.shape[1])
    diff = peak = 0.0
    for a, b in zip(a_all.split(rows), b_all.split(rows)):
        a, b = a.float(), b.float()
        d = (a - b).abs().max().item()
        if not math.isfinite(d):
            return d
        diff, peak = max(diff, d), max(peak, b.abs().max().item())
    return diff / peak if peak > 0 else (0.0 if diff == 0 else math.inf)


# ---------------------------------------------------------------- plain-PyTorch quantization


def _cast(blocks: torch.Tensor, scale: torch.Tensor, dtype=FP8) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    return (blocks / scale).clamp(-fmax, fmax).to(dtype)


def quant_1x128(x: torch.Tensor, dtype=FP8):
    """x (T, K) -> (data (T, K) e4m3 (or `dtype`), scale (T, K/128) FP32 with strides (1, T)):
    one scale per 1 x 128 tile (amax / the dtype's max, 448 for e4m3), in the T-major layout
    cuBLAS, DeepGEMM and distgemm read."""
    t, k = x.shape
    if k % BLOCK:
        raise ValueError(f"quant_1x128: K = {k} must be a multiple of {BLOCK}")
    xb = x.view(t, k // BLOCK, BLOCK).float()
    scale = xb.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_EPS) / torch.finfo(dtype).max
    data = _cast(xb, scale, dtype).view(t, k)
    return data, scale.view(t, k // BLOCK).t().contiguous().t()


def quant_1x128_t_padded(x: torch.Tensor, token_index: torch.Tensor, tp: int):
    """x (T, K) -> (data (K, Tp) e4m3, scale (K, Tp/128) FP32 with strides (1, K)): x
    transposed into the padded per-expert layout (token_index: each token's column, zeros
    elsewhere), one scale per 128 tokens of one expert: the wgrad's operand layout."""
    t, k = x.shape
    xp = x.new_zeros(tp, k)
    xp.index_copy_(0, token_index, x)
    xb = xp.view(tp // BLOCK, BLOCK, k).float()
    scale = xb.abs().amax(dim=1, keepdim=True).clamp_min(AMAX_EPS) / FP8_MAX
    data = _cast(xb, scale).view(tp, k).t().contiguous()
    return data, scale.view(tp // BLOCK, k).t()


def quant_128x128(w: torch.Tensor):
    """w (G, N, K) -> (data (G, N, K) e4m3, scale (G, N/128, K/128) FP32 contiguous), one
    expert at a time (the FP32 copy of all experts would be 4x the bf16 weights)."""
    g, n, k = w.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"quant_128x128: N = {n} and K = {k} must be multiples of {BLOCK}")
    data = torch.empty((g, n, k), dtype=FP8, device=w.device)
    scale = torch.empty((g, n // BLOCK, k // BLOCK), dtype=torch.float32, device=w.device)
    for e in range(g):
        wb = w[e].view(n // BLOCK, BLOCK, k // BLOCK, BLOCK).float()
        s = wb.abs().amax(dim=(1, 3), keepdim=True).clamp_min(AMAX_EPS) / FP8_MAX
        data[e] = _cast(wb, s).view(n, k)
        scale[e] = s.view(n // BLOCK, k // BLOCK)
    return data, scale


def quant_rows(t: torch.Tensor):
    """t (T, K) or (G, N, K) -> (data e4m3, scale (T,) or (G, N) FP32): one scale per row
    (row-wise scaling); 3-D one expert at a time."""
    data = torch.empty(t.shape, dtype=FP8, device=t.device)
    scale = torch.empty(t.shape[:-1], dtype=torch.float32, device=t.device)
    for i in (range(t.shape[0]) if t.dim() == 3 else (slice(None),)):
        f = t[i].float()
        s = f.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_EPS) / FP8_MAX
        data[i] = _cast(f, s)
        scale[i] = s.squeeze(-1)
    return data, scale


def dequant_1x128(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """data (R, C) times scale (R, ceil(C/128)) broadcast over 1 x 128 tiles, FP32."""
    c = data.shape[1]
    return data.float() * scale.float().repeat_interleave(BLOCK, dim=1)[:, :c]


def dequant_128x128(data: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    g, n, k = data.shape
    out = torch.empty((g, n, k), dtype=dtype, device=data.device)
    for e in range(g):
        blocks = data[e].float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        out[e] = (blocks * scale[e].view(n // BLOCK, 1, k // BLOCK, 1)).view(n, k).to(dtype)
    return out


def unpad_dequant(data_t: torch.Tensor, scale_t: torch.Tensor, token_index: torch.Tensor,
                  dtype=torch.bfloat16) -> torch.Tensor:
    """The wgrad's padded transposed operand (R, Tp) and its scales back to (T, R) values."""
    return dequant_1x128(data_t, scale_t).index_select(1, token_index).t().contiguous().to(dtype)


# ---------------------------------------------------------------- cuBLAS block-scaled peer


def cublas_block_loop(a: torch.Tensor, b_kn: Callable[[int], torch.Tensor], scale_a: torch.Tensor,
                      scale_b_nk: Callable[[int], torch.Tensor], counts: Sequence[int]):
    """Per-expert operands of the cuBLAS loop, built once (as a framework would cache them):
    a (T, K) row-major, b_kn(g) expert g's (K, N) column-major operand, scale_a (T, K/128),
    scale_b_nk(g) its 128x128 scales as (N/128, K/128) blocks. Returns
    call(api) -> list of (M_g, N) outputs, experts without tokens skipped."""
    parts = []
    for e, (s, f) in enumerate(group_bounds(counts)):
        if f > s:
            parts.append((a[s:f], b_kn(e), cublas_scale_a(scale_a[s:f]), cublas_scale_b(scale_b_nk(e))))

    def call(api):
        return [api(pa, pb, sa, sb) for pa, pb, sa, sb in parts]
    return call


# ---------------------------------------------------------------- one row


def _short(routing: str) -> str:
    return "bal" if routing == "balanced" else routing


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def _finite(v: float):
    return v if math.isfinite(v) else str(v)


def _measure(timer, label: str, op: str, shape: dict, flops: float, ours: Callable,
             peers: Dict[str, Callable], compare: Callable[[object, object], float],
             tol: float = TOLERANCE, host: Sequence[str] = ()) -> dict:
    """Runs ours and every peer once (errors recorded, failures left out of the timing),
    checks ours against each peer, times the rest interleaved and prints the row."""
    row = {"shape": {**shape, "op": op}, "errors": {}, "max_rel_err": {}, "tolerance": tol}
    impls = {"distgemm": ours, **peers}
    outputs = {}
    for name, fn in impls.items():
        try:
            outputs[name] = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a peer's failure is a result
            row["errors"][name] = _error(exc)
    if "distgemm" in outputs:
        for name in peers:
            if name in outputs:
                try:
                    row["max_rel_err"][name] = _finite(compare(outputs["distgemm"], outputs[name]))
                except Exception as exc:  # noqa: BLE001
                    row["errors"][f"{name}_check"] = _error(exc)
    del outputs
    row["ok"] = "distgemm" not in row["errors"] and all(
        isinstance(v, float) and v <= tol for v in row["max_rel_err"].values())
    runnable = {name: fn for name, fn in impls.items() if name not in row["errors"]}
    if runnable:
        for name, ms in timer.compare(runnable).items():
            row[name] = entry(ms, flops)
    row["ratios"] = {name: round(row[name]["ms"] / row["distgemm"]["ms"], 4)
                     for name in peers if name in row and "distgemm" in row}
    host = [h for h in host if h in runnable]
    if host:  # CPU time per call: where it reaches the device time, the op is host-bound
        row["host_ms"] = {name: round(host_ms(runnable[name]), 4) for name in host}
    cols = {"ours": row["distgemm"]["tflops"] if "distgemm" in row else "FAILED"}
    cols.update({p: f"{r:.2f}x" for p, r in row["ratios"].items()})
    if row["max_rel_err"]:
        cols["err"] = "/".join(f"{v:.1e}" if isinstance(v, float) else v for v in row["max_rel_err"].values())
    if not row["ok"]:
        cols["CHECK"] = "FAILED"
    if "host_ms" in row:
        cols["host_us"] = "/".join(f"{v * 1e3:.0f}" for v in row["host_ms"].values())
    for name in row["errors"]:
        cols[name] = "error"
    print_row(f"{op:13s} {label} ", cols)
    for name, msg in row["errors"].items():
        print(f"    {name}: {msg[:200]}", flush=True)
    return row


def _cat_rows(parts):
    return torch.cat(parts) if isinstance(parts, list) else parts


def _wgrad_inputs(dy: torch.Tensor, x: torch.Tensor, offs, token_index, tp):
    """(dy_t, scale_dy, x_t, scale_x, producer) for the FP8 wgrad: distgemm.quantize_fp8 where
    it exists and returns the documented layout, else the plain-PyTorch quantizer."""
    import distgemm

    quantize = getattr(distgemm, "quantize_fp8", None)
    note = "distgemm.quantize_fp8 not available"
    if quantize is not None:
        try:
            dy_t, sdy = quantize(dy, (1, BLOCK), transpose=True, offs=offs)
            x_t, sx = quantize(x, (1, BLOCK), transpose=True, offs=offs)
            want = {"dy": (dy.shape[1], tp), "x": (x.shape[1], tp)}
            got = {"dy": (tuple(dy_t.shape), tuple(sdy.shape)), "x": (tuple(x_t.shape), tuple(sx.shape))}
            if all(got[n] == (want[n], (want[n][0], tp // BLOCK)) for n in want):
                return dy_t, sdy, x_t, sx, "distgemm.quantize_fp8"
            note = f"distgemm.quantize_fp8 returned {got}, expected data/scale {want} / (.., Tp/128)"
        except Exception as exc:  # noqa: BLE001
            note = f"distgemm.quantize_fp8 failed: {_error(exc)}"
    dy_t, sdy = quant_1x128_t_padded(dy, token_index, tp)
    x_t, sx = quant_1x128_t_padded(x, token_index, tp)
    return dy_t, sdy, x_t, sx, f"plain PyTorch ({note})"


# ---------------------------------------------------------------- the suite


# The cuBLAS API the loop uses: F.scaled_mm (v2) unless it fails on the first call, then
# torch._scaled_mm (v1); decided once per process.
_CUBLAS_API_NAME = ["F.scaled_mm"]


def _cublas_api():
    return _scaled_mm_block if _CUBLAS_API_NAME[0] == "F.scaled_mm" else _scaled_mm_block_v1


def _pick_cublas_api(device) -> Optional[str]:
    """Tries F.scaled_mm's BlockWise1x128 x BlockWise128x128 on a small problem; falls back
    to torch._scaled_mm. Returns the v2 error where it fell back."""
    a = torch.randn(256, 512, device=device).to(FP8)
    b = torch.randn(256, 512, device=device).to(FP8).t()
    sa = cublas_scale_a(torch.rand(256, 4, device=device) + 0.5)
    sb = cublas_scale_b(torch.rand(2, 4, device=device) + 0.5)
    try:
        _scaled_mm_block(a, b, sa, sb)
        torch.cuda.synchronize()
        _CUBLAS_API_NAME[0] = "F.scaled_mm"
        return None
    except Exception as exc:  # noqa: BLE001
        _CUBLAS_API_NAME[0] = "torch._scaled_mm"
        return _error(exc)


def _layer_data(cfg: dict, device) -> dict:
    """One problem's FP8 operands (block and row-wise scales) and their bf16 dequantization:
    random bf16 quantized once, so that every implementation multiplies the same numbers (the
    bf16 peers up to the bf16 rounding of the dequantized values)."""
    n, k, g, mean = cfg["n"], cfg["k"], cfg["groups"], cfg["mean"]
    t = g * mean
    x_src = torch.randn(t, k, device=device, dtype=torch.bfloat16)
    w_src = torch.randn(g, n, k, device=device, dtype=torch.bfloat16)
    dy_src = torch.randn(t, n, device=device, dtype=torch.bfloat16)
    d = {"cfg": cfg, "t": t, "flops": 2.0 * t * n * k}
    d["x8"], d["sx"] = quant_1x128(x_src)        # sx (T, K/128), strides (1, T)
    d["w8"], d["sw"] = quant_128x128(w_src)      # sw (G, N/128, K/128)
    d["xr8"], d["sxr"] = quant_rows(x_src)       # (T,)
    d["wr8"], d["swr"] = quant_rows(w_src)       # (G, N)
    d["dy8"], d["sdy"] = quant_1x128(dy_src)     # sdy (T, N/128), strides (1, T)
    d["dy_src"] = dy_src
    d["x_bf"] = dequant_1x128(d["x8"], d["sx"]).to(torch.bfloat16)
    d["dy_bf"] = dequant_1x128(d["dy8"], d["sdy"]).to(torch.bfloat16)
    d["w_bf"] = dequant_128x128(d["w8"], d["sw"])
    # dgrad reads W^T K-major: the pre-transposed FP8 copy (G, K, N) a training framework caches.
    d["wt8"] = d["w8"].transpose(1, 2).contiguous()
    return d


def _gemm_rows(timer, d: dict, routing: str, device) -> List[dict]:
    """The forward (block, row-wise) and dgrad rows of one problem and routing."""
    import distgemm

    cfg, t, flops = d["cfg"], d["t"], d["flops"]
    n, k, g, mean = cfg["n"], cfg["k"], cfg["groups"], cfg["mean"]
    x8, sx, w8, sw, wt8 = d["x8"], d["sx"], d["w8"], d["sw"], d["wt8"]
    xr8, sxr, wr8, swr, dy8, sdy = d["xr8"], d["sxr"], d["wr8"], d["swr"], d["dy8"], d["sdy"]
    x_bf, dy_bf, w_bf = d["x_bf"], d["dy_bf"], d["w_bf"]
    counts = counts_for(g, mean, routing)
    offs = offsets(counts, device)
    label = f"{g}x{mean} n{n} k{k} {_short(routing)}"
    shape = {"name": f"{cfg['layer']}-{g}x{mean}", "layer": cfg["layer"], "groups": g,
             "tokens_per_group": mean, "tokens": t, "n": n, "k": k, "routing": routing, "counts": counts}
    rows = []

    loop = cublas_block_loop(x8, lambda e: w8[e].t(), sx, lambda e: sw[e], counts)
    rows.append(_measure(
        timer, label, "forward_block", shape, flops,
        lambda: distgemm.grouped_mm(x8, w8, offs, scale_x=sx, scale_w=sw, out_dtype=torch.bfloat16),
        {"cublas_block_loop": lambda: loop(_cublas_api()),
         "ours_bf16": lambda: distgemm.grouped_mm(x_bf, w_bf, offs)},
        lambda a, b: max_rel_err(a, _cat_rows(b)), host=("distgemm", "cublas_block_loop")))
    rows[-1]["cublas_api"] = _CUBLAS_API_NAME[0]

    rows.append(_measure(
        timer, label, "forward_row", shape, flops,
        lambda: distgemm.grouped_mm(xr8, wr8, offs, scale_x=sxr, scale_w=swr, out_dtype=torch.bfloat16),
        {"torch_scaled_grouped_mm": lambda: torch._scaled_grouped_mm(
            xr8, wr8.transpose(-2, -1), scale_a=sxr, scale_b=swr, offs=offs,
            out_dtype=torch.bfloat16, use_fast_accum=False),
         "torch_scaled_grouped_mm_fast": lambda: torch._scaled_grouped_mm(
            xr8, wr8.transpose(-2, -1), scale_a=sxr, scale_b=swr, offs=offs,
            out_dtype=torch.bfloat16, use_fast_accum=True)},
        max_rel_err))

    # dgrad, the GEMM (T, N) x (N, K): ours takes w (G, K_gemm=N, N_gemm=K) as the transpose of
    # the contiguous W^T with W's own block scales (G, N/128, K/128), read in place; cuBLAS
    # takes W^T[g].t() (N, K) column-major with the same scales as (K/128, N/128) blocks.
    dloop = cublas_block_loop(dy8, lambda e: wt8[e].t(), sdy, lambda e: sw[e].t(), counts)
    rows.append(_measure(
        timer, label, "dgrad_block", {**shape, "gemm_n": k, "gemm_k": n}, flops,
        lambda: distgemm.grouped_mm(dy8, wt8.transpose(1, 2), offs, scale_x=sdy, scale_w=sw,
                                    out_dtype=torch.bfloat16, trans_w=False),
        {"cublas_block_loop": lambda: dloop(_cublas_api()),
         "ours_bf16": lambda: distgemm.grouped_mm(dy_bf, w_bf, offs, trans_w=False)},
        lambda a, b: max_rel_err(a, _cat_rows(b))))
    rows[-1]["cublas_api"] = _CUBLAS_API_NAME[0]

    # The hybrid recipe's dgrad: dy in e5m2 (range for gradients) against the e4m3 weights;
    # checked against our bf16 dgrad on dy's e5m2 values, timed beside the e4m3 one.
    dy5, sdy5 = quant_1x128(d["dy_src"], torch.float8_e5m2)
    dy5_bf = dequant_1x128(dy5, sdy5).to(torch.bfloat16)
    rows.append(_measure(
        timer, label, "dgrad_block_e5m2", {**shape, "gemm_n": k, "gemm_k": n}, flops,
        lambda: distgemm.grouped_mm(dy5, wt8.transpose(1, 2), offs, scale_x=sdy5, scale_w=sw,
                                    out_dtype=torch.bfloat16, trans_w=False),
        {"ours_bf16": lambda: distgemm.grouped_mm(dy5_bf, w_bf, offs, trans_w=False),
         "ours_e4m3": lambda: distgemm.grouped_mm(dy8, wt8.transpose(1, 2), offs, scale_x=sdy, scale_w=sw,
                                                  out_dtype=torch.bfloat16, trans_w=False)},
        max_rel_err, tol=E5M2_VS_E4M3_TOLERANCE))
    return rows


def _wgrad_row(timer, d: dict, routing: str, device) -> dict:
    """FP32 main_grad (G, N, K) += dy_g^T x_g: ours from the FP8 padded transposed operands,
    the peer (our bf16 wgrad) from their dequantized values, each into its own main_grad."""
    import distgemm

    cfg, t = d["cfg"], d["t"]
    n, k, g, mean = cfg["n"], cfg["k"], cfg["groups"], cfg["mean"]
    counts = counts_for(g, mean, routing)
    offs = offsets(counts, device)
    tp = padded_tokens(t, g)
    token_index = torch.tensor(padded_token_index(counts), dtype=torch.int64, device=device)
    dy_t, sdy_t, x_t, sx_t, producer = _wgrad_inputs(d["dy_bf"], d["x_bf"], offs, token_index, tp)
    dy_w = unpad_dequant(dy_t, sdy_t, token_index)
    x_w = unpad_dequant(x_t, sx_t, token_index)
    main_grad = torch.zeros((g, n, k), dtype=torch.float32, device=device)
    peer_grad = torch.zeros((g, n, k), dtype=torch.float32, device=device)
    shape = {"name": f"{cfg['layer']}-{g}x{mean}", "layer": cfg["layer"], "groups": g,
             "tokens_per_group": mean, "tokens": t, "n": n, "k": k, "routing": routing,
             "counts": counts, "padded_tokens": tp}
    row = _measure(
        timer, f"{g}x{mean} n{n} k{k} {_short(routing)}", "wgrad_block", shape, d["flops"],
        lambda: distgemm.grouped_mm_wgrad(dy_t, x_t, offs, scale_dy=sdy_t, scale_x=sx_t,
                                          out=main_grad, accumulate=True),
        {"ours_bf16_wgrad": lambda: distgemm.grouped_mm_wgrad(dy_w, x_w, offs, out=peer_grad,
                                                              accumulate=True)},
        max_rel_err)
    row["wgrad_inputs"] = producer
    return row


def _quant_row(timer, x: torch.Tensor, counts: List[int], routing: str, transposed: bool,
               use_compile: bool, device) -> dict:
    """One quantization row: bf16 (T, K) -> FP8 1 x 128 tiles, plain or transposed and padded
    per expert; distgemm.quantize_fp8 against plain PyTorch (eager and compiled), GB/s of the
    bytes read and written, each implementation's round trip checked against x."""
    import distgemm

    quantize = getattr(distgemm, "quantize_fp8", None)
    t, k = x.shape
    g = len(counts)
    op = "quant_1x128_t_offs" if transposed else "quant_1x128"
    if transposed:
        offs = offsets(counts, device)
        tp = padded_tokens(t, g)
        token_index = torch.tensor(padded_token_index(counts), dtype=torch.int64, device=device)
        nbytes = 2 * t * k + k * tp + 4 * k * (tp // BLOCK)
        args = (x, token_index, tp)
        fns = {"distgemm": (lambda: quantize(x, (1, BLOCK), transpose=True, offs=offs)) if quantize else None,
               "torch_plain": lambda: quant_1x128_t_padded(*args)}
        reference = x.t()

        def roundtrip(out):
            return dequant_1x128(*out).index_select(1, token_index)
    else:
        tp = None
        nbytes = 2 * t * k + t * k + 4 * t * (k // BLOCK)
        args = (x,)
        fns = {"distgemm": (lambda: quantize(x, (1, BLOCK))) if quantize else None,
               "torch_plain": lambda: quant_1x128(x)}
        reference = x

        def roundtrip(out):
            return dequant_1x128(*out)
    if use_compile:
        fns["torch_compile"] = _compiled(quant_1x128_t_padded if transposed else quant_1x128, args)
    row = {"shape": {"op": op, "tokens": t, "k": k, "groups": g, "routing": routing, "padded_tokens": tp},
           "bytes": nbytes, "errors": {}, "roundtrip_err": {}, "tolerance": QUANT_TOLERANCE}
    if quantize is None:
        row["errors"]["distgemm"] = "distgemm.quantize_fp8 is not available"
    for name, fn in fns.items():
        if fn is None:
            continue
        try:
            out = fn()
            torch.cuda.synchronize()
            row["roundtrip_err"][name] = _finite(max_rel_err(roundtrip(out), reference))
        except Exception as exc:  # noqa: BLE001 - a failure is a result
            row["errors"][name] = _error(exc)
    row["ok"] = all(isinstance(v, float) and v <= QUANT_TOLERANCE for v in row["roundtrip_err"].values())
    runnable = {name: fn for name, fn in fns.items() if fn is not None and name not in row["errors"]}
    if runnable:
        for name, ms in timer.compare(runnable).items():
            row[name] = {"ms": round(ms, 5), "gbps": round(nbytes / ms / 1e6, 1)}
    row["ratios"] = {p: round(row[p]["ms"] / row["distgemm"]["ms"], 4)
                     for p in ("torch_plain", "torch_compile") if p in row and "distgemm" in row}
    cols = {name: row[name]["gbps"] for name in fns if name in row}
    cols.update({f"vs_{p}": f"{r:.2f}x" for p, r in row["ratios"].items()})
    if row["roundtrip_err"]:
        cols["err"] = "/".join(f"{v:.1e}" if isinstance(v, float) else v for v in row["roundtrip_err"].values())
    if not row["ok"]:
        cols["CHECK"] = "FAILED"
    print_row(f"{op:18s} {t}x{k} {_short(routing)} ", {"GB/s": "", **cols})
    for name, msg in row["errors"].items():
        print(f"    {name}: {msg[:200]}", flush=True)
    return row


def _quant_rows(timer, quick: bool, device) -> List[dict]:
    """The quantization table: the activations of the 8x4096 problems (T = 32768), K = 7168
    (and 2048), plain, and transposed + padded per expert (balanced, and Zipf)."""
    use_compile = _settings.current().bench_compile
    g, mean = QUANT_EXPERTS
    rows = []
    for k in (QUANT_K[:1] if quick else QUANT_K):
        x = torch.randn(g * mean, k, device=device, dtype=torch.bfloat16)
        rows.append(_quant_row(timer, x, counts_for(g, mean, "balanced"), "balanced", False, use_compile, device))
        for routing in (("balanced",) if quick else ROUTINGS):
            rows.append(_quant_row(timer, x, counts_for(g, mean, routing), routing, True, use_compile, device))
    return rows


def _compiled(fn, args):
    """fn compiled for these arguments (static shapes): the fused-kernel PyTorch peer."""
    try:
        compiled = torch.compile(fn, dynamic=False)
    except Exception as exc:  # noqa: BLE001
        message = _error(exc)

        def failed():
            raise RuntimeError(message)
        return failed
    return lambda: compiled(*args)


def summarize(rows: List[dict]) -> Dict[str, Optional[float]]:
    """The suite's summary from its rows: every key of SUMMARY_KEYS, None where no row has it."""
    summary: Dict[str, Optional[float]] = {}
    for key, (op, peer) in SUMMARY_RATIOS.items():
        vals = [r["ratios"][peer] for r in rows if r["shape"]["op"] == op and peer in r.get("ratios", {})]
        summary[key] = round(geomean(vals), 4) if vals else None
    skew = []
    for r in rows:
        s = r["shape"]
        if s["op"] != "forward_block" or s["routing"] == "balanced" or "distgemm" not in r:
            continue
        for b in rows:
            sb = b["shape"]
            if (sb["op"] == "forward_block" and sb["routing"] == "balanced" and "distgemm" in b
                    and all(sb[f] == s[f] for f in ("groups", "tokens_per_group", "n", "k"))):
                skew.append(r["distgemm"]["ms"] / b["distgemm"]["ms"])
    summary[SKEW_KEY] = round(geomean(skew), 4) if skew else None
    for key, (op, g, mean, n, k) in SUMMARY_TFLOPS.items():
        hits = [r["distgemm"]["tflops"] for r in rows
                if "distgemm" in r and r["shape"]["op"] == op and r["shape"]["routing"] == "balanced"
                and (r["shape"]["groups"], r["shape"]["tokens_per_group"], r["shape"]["n"], r["shape"]["k"])
                == (g, mean, n, k)]
        summary[key] = hits[0] if hits else None
    return summary


def _unsupported() -> Optional[str]:
    """Why this machine cannot run the suite, or None."""
    import distgemm

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability(0) != (9, 0):
        return (f"{torch.cuda.get_device_name(0)} is not sm_90: distgemm's FP8 grouped kernels are "
                "Hopper-only (elsewhere it runs the plain-PyTorch reference)")
    if "scale_x" not in inspect.signature(distgemm.grouped_mm).parameters:
        return "this distgemm build has no FP8 grouped GEMM (grouped_mm takes no scale_x)"
    return None


def run(out_dir: str, quick: bool = False) -> dict:
    """Runs the suite (quick: the two 8x4096 layer shapes, Zipf routing on the first only),
    prints a line per row, writes <out_dir>/<gpu>_grouped_fp8.json + .png and returns the
    summary (SUMMARY_KEYS: geomeans of peer time / our time, our Zipf / balanced time, and
    our TFLOP/s on three 8x4096 shapes); {} where the machine cannot run it."""
    why = _unsupported()
    if why:
        print(f"\n== FP8 grouped GEMM suite skipped: {why}")
        return {}
    device = torch.device("cuda", torch.cuda.current_device())
    return _run(out_dir, quick, device, Timer())


def _run(out_dir: str, quick: bool, device, timer) -> dict:
    from tqdm import tqdm

    torch.manual_seed(0)
    v2_error = _pick_cublas_api(device)
    print("\n== FP8 grouped GEMM (TFLOP/s; ratio = peer time / ours; err = max|ours-peer|/max|peer|)")
    if v2_error:
        print(f"   F.scaled_mm block-scaled failed ({v2_error[:160]}); the cuBLAS loop uses torch._scaled_mm")
    rows: List[dict] = []
    for cfg in tqdm(configs(quick), desc="grouped_fp8", leave=False):
        data = _layer_data(cfg, device)
        for routing in cfg["routings"]:
            rows += _gemm_rows(timer, data, routing, device)
            rows.append(_wgrad_row(timer, data, routing, device))
            torch.cuda.empty_cache()
        del data
        torch.cuda.empty_cache()
    print("\n== FP8 quantization, bf16 -> e4m3 in 1 x 128 tiles (GB/s read + written; ratio = peer time / ours)")
    quant = _quant_rows(timer, quick, device)
    torch.cuda.empty_cache()

    summary = summarize(rows)
    failed = [f"{r['shape']['op']} {r['shape']['name']} {r['shape']['routing']}" for r in rows if not r["ok"]]
    print("geomeans (peer time / ours) and figures:", {k: v for k, v in summary.items() if v is not None})
    if failed:
        print(f"CHECK FAILED (max_rel_err above {TOLERANCE}) on: {', '.join(failed)}")
    slug = gpu_slug(1)
    extra = {"quantize": quant, "tolerance": TOLERANCE,
             "cublas_block_api": _CUBLAS_API_NAME[0], "cublas_block_v2_error": v2_error,
             "wgrad_inputs": sorted({r["wgrad_inputs"] for r in rows if "wgrad_inputs" in r}),
             "check_failures": failed}
    path = write_results(out_dir, slug, "grouped_fp8", rows, summary, extra=extra)
    print(f"wrote {path}")
    labels, series = _plot_series(rows)
    plot_ratios(path.replace(".json", ".png"), f"distgemm FP8 grouped GEMM vs peers on {slug}",
                labels, series, "peer time / distgemm time")
    return summary


def _plot_series(rows: List[dict]):
    """One group of bars per problem (layer shape, experts, routing), one bar per summary ratio."""
    labels: List[str] = []
    index: Dict[tuple, int] = {}
    for r in rows:
        s = r["shape"]
        key = (s["n"], s["k"], s["groups"], s["tokens_per_group"], s["routing"])
        if key not in index:
            index[key] = len(labels)
            labels.append(f"{s['groups']}x{s['tokens_per_group']} n{s['n']} k{s['k']} {_short(s['routing'])}")
    series = {}
    for name, (op, peer) in SUMMARY_RATIOS.items():
        values = [0.0] * len(labels)
        for r in rows:
            s = r["shape"]
            if s["op"] == op and peer in r["ratios"]:
                values[index[(s["n"], s["k"], s["groups"], s["tokens_per_group"], s["routing"])]] = r["ratios"][peer]
        series[name.replace("_vs_", " vs ")] = values
    return labels, series
