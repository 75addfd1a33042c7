"""FP8 grouped GEMMs for Mixture-of-Experts: e4m3 operands with FP32 scales applied in the
mainloop (partial sums scaled and promoted to FP32 once per 128 of K), every expert in one
launch, group sizes read on the GPU. Gradients may be e5m2 against e4m3 weights or
activations (the hybrid recipe): x = dy in a dgrad, dy in the wgrad.

Scale modes, chosen by ``scale_w``'s rank:

- row-wise (``torch._scaled_grouped_mm``): ``scale_x`` (T,) one per token, ``scale_w`` (G, N)
  one per output column of each expert; a scalar (or one per expert) broadcasts.
- block (DeepSeek-V3): ``scale_x`` (T, ceil(K/128)) one per 1 x 128 tile of x, any strides
  (PyTorch's BlockWise1x128 / DeepGEMM layout, T-major, is read in place); ``scale_w`` one
  per 128 x 128 block of w: (G, ceil(N/128), ceil(K/128)) for w (G, N, K), or
  (G, ceil(K/128), ceil(N/128)) for w (G, K, N) (``trans_w=False``, the dgrad).

FP8 tensor cores read both operands K-major, so ``trans_w=False`` with a w whose K is not
the contiguous dimension copies w once, transposed (``distgemm.nn.GroupedLinear`` caches it).
The wgrad takes dy and x quantized transposed and padded per expert (``quantize_fp8(...,
(1, 128), transpose=True, offs=offs)``), so that every expert's tokens start 16-byte aligned
and no 128-token scale block mixes two experts.
"""

from __future__ import annotations

import functools

import torch

from ._checks import check_no_overlap
from ._dispatch import Dispatcher, GroupedPass, configs
from ._library import aligned16, device_arch, has_kernels, ops
from ._routing import check_offs_tensor, check_offs_values, group_bounds

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_ROW, SCALE_BLOCK = 1, 2
BLOCK = 128


def _check_fp8_pair(op: str, a_name: str, a, b_name: str, b) -> None:
    """a and b both float8_e4m3fn, or a float8_e5m2 a (a gradient) against a float8_e4m3fn b."""
    if a.dtype not in FLOAT8 or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{op}: FP8 grouped GEMMs take float8_e4m3fn {a_name} and {b_name}, or a "
                         f"float8_e5m2 {a_name} (a gradient) with a float8_e4m3fn {b_name}; got {a.dtype} "
                         f"and {b.dtype}")


def _ceil(a: int, b: int) -> int:
    return (a + b - 1) // b


def _shape(t):
    return tuple(t.shape)


def _require_tensor(op, name, t, dtype=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{op}: {name} must be {dtype}, got {t.dtype}")


def _require_out(op, out):
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be a torch.Tensor or None, got {type(out).__name__}")


def _check_common(op, x, offs, pairs):
    for name, t in pairs:
        _require_tensor(op, name, t)
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {pairs[0][0]} is on {x.device}")
    check_offs_tensor(op, offs)
    if offs.device != x.device:
        raise ValueError(f"{op}: offs is on {offs.device} but the inputs are on {x.device}")


def _use_kernel(device) -> bool:
    return device.type == "cuda" and has_kernels(device) and device_arch(device) == 90


# ---------------------------------------------------------------- forward / dgrad


def _scales(op, x, w_nk, scale_x, scale_w, trans_w):
    """(mode, scale_x, scale_w) in the layouts the kernel reads; w_nk is w as (G, N, K)."""
    _require_tensor(op, "scale_x", scale_x, torch.float32)
    _require_tensor(op, "scale_w", scale_w, torch.float32)
    tokens, k = x.shape
    groups, n = w_nk.shape[0], w_nk.shape[1]
    kb, nb = _ceil(k, BLOCK), _ceil(n, BLOCK)
    if scale_w.dim() == 3:
        want_x, want_w = (tokens, kb), ((groups, nb, kb) if trans_w else (groups, kb, nb))
        if _shape(scale_x) != want_x:
            raise ValueError(f"{op}: block scales: scale_x must be (T, ceil(K/128)) = {want_x}, "
                             f"got {_shape(scale_x)}")
        if _shape(scale_w) != want_w:
            layout = "(G, ceil(N/128), ceil(K/128))" if trans_w else "(G, ceil(K/128), ceil(N/128))"
            raise ValueError(f"{op}: block scales: scale_w must be {layout} = {want_w} for w "
                             f"{'(G, N, K)' if trans_w else '(G, K, N)'}, got {_shape(scale_w)}")
        if tokens > 1 and scale_x.stride(0) != 1:
            scale_x = scale_x.t().contiguous().t()  # T-major, as PyTorch and DeepGEMM hold it
        # The kernel reads w's scales as (G, Kb, Nb), N blocks contiguous.
        scale_w = (scale_w.transpose(1, 2) if trans_w else scale_w).contiguous()
        return SCALE_BLOCK, scale_x, scale_w
    if scale_w.dim() in (0, 1, 2) and scale_x.dim() in (0, 1, 2):
        # scale_w first: a 2-D block scale_w missing its G reads as row-wise, and is named.
        sw = scale_w
        if sw.numel() == 1:
            sw = sw.reshape(1, 1).expand(groups, n)
        elif sw.dim() == 1 and sw.numel() == groups:
            sw = sw.reshape(groups, 1).expand(groups, n)
        if _shape(sw) != (groups, n):
            raise ValueError(f"{op}: row-wise scales: scale_w must be (G, N) = {(groups, n)} (or "
                             f"a scalar, or (G,); 128 x 128 block scales are 3-D), got {_shape(scale_w)}")
        sx = scale_x.reshape(-1)
        if sx.numel() == 1:
            sx = sx.expand(tokens)
        if sx.numel() != tokens:
            raise ValueError(f"{op}: row-wise scales: scale_x must be (T,) = ({tokens},) (or a "
                             f"scalar), got {_shape(scale_x)}")
        return SCALE_ROW, sx.contiguous(), sw.contiguous()
    raise ValueError(f"{op}: scale_w must be (G, N) (row-wise) or 3-D (128 x 128 blocks), got "
                     f"{_shape(scale_w)}")


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int):
    """data (..., R, C) times scale broadcast over block_rows x block_cols blocks, in float32."""
    r, c = data.shape[-2], data.shape[-1]
    s = scale.float()
    s = s.repeat_interleave(block_rows, dim=-2)[..., :r, :] if block_rows > 1 else s
    s = s.repeat_interleave(block_cols, dim=-1)[..., :c] if block_cols > 1 else s
    return data.float() * s


def reference_grouped_mm_fp8(x, w_nk, offs, mode, scale_x, scale_w_kn, out, accumulate):
    """Dequantize, then a per-group FP32 matmul: the tests' reference and the CPU path.
    scale_x/scale_w_kn as _scales returns them (w's block scales as (G, Kb, Nb))."""
    if mode == SCALE_BLOCK:
        xd = dequantize_blocks(x, scale_x, 1, BLOCK)
        wd = dequantize_blocks(w_nk, scale_w_kn.transpose(1, 2), BLOCK, BLOCK)
    else:
        xd = x.float() * scale_x.float().reshape(-1, 1)
        wd = w_nk.float() * scale_w_kn.float().unsqueeze(-1)
    for g, (s, e) in enumerate(group_bounds(offs, x.shape[0])):
        if e > s:
            y = xd[s:e] @ wd[g].T
            out[s:e] = (out[s:e].float() + y) if accumulate else y
    return out


def grouped_mm_fp8(x, w, offs, *, scale_x, scale_w, out=None, accumulate=False,
                   out_dtype=None, trans_w=True, use_fast_accum=False):
    """The FP8 case of ``distgemm.grouped_mm`` (see the module docstring)."""
    op = "distgemm.grouped_mm"
    _check_common(op, x, offs, [("x", x), ("w", w)])
    _check_fp8_pair(op, "x", x, "w", w)
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{op}: x must be 2-D (T, K) and w 3-D, got {_shape(x)} and {_shape(w)}")
    # w as (G, N, K), the kernel's K-major operand.
    w_nk = w if trans_w else w.transpose(1, 2)
    groups, n, k = w_nk.shape
    if k != x.shape[1]:
        layout = "(G, N, K)" if trans_w else "(G, K, N)"
        raise ValueError(f"{op}: w must have shape {layout} with K = x.shape[1] = {x.shape[1]} "
                         f"(trans_w={trans_w}), got {_shape(w)}")
    if offs is None or offs.numel() != groups:
        raise ValueError(f"{op}: offs must hold one end per group ({groups}), got "
                         f"{None if offs is None else offs.numel()}")
    _require_out(op, out)
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else torch.bfloat16
    if out_dtype != torch.bfloat16:
        raise ValueError(f"{op}: FP8 grouped GEMMs write bfloat16, got out_dtype {out_dtype}")
    if accumulate and out is None:
        raise ValueError(f"{op}: accumulate=True needs out")
    if out is not None and (_shape(out) != (x.shape[0], n) or out.dtype != out_dtype
                            or out.device != x.device or not out.is_contiguous()):
        raise ValueError(f"{op}: out must be a contiguous {out_dtype} tensor of shape "
                         f"{(x.shape[0], n)} on {x.device}, got {out.dtype} {_shape(out)}")
    check_no_overlap(op, out, (("x", x), ("w", w), ("scale_x", scale_x), ("scale_w", scale_w)))
    mode, sx, sw = _scales(op, x, w_nk, scale_x, scale_w, trans_w)
    check_offs_values(op, offs, x.shape[0])
    del use_fast_accum  # partial sums are always promoted once per 128 of K (no slower)
    if not _use_kernel(x.device):
        if out is None:
            out = torch.zeros((x.shape[0], n), dtype=out_dtype, device=x.device)
        return reference_grouped_mm_fp8(x, w_nk, offs, mode, sx, sw, out, accumulate)
    x, w_nk = aligned16(x.contiguous()), aligned16(w_nk.contiguous())  # a transposed copy for a (G, K, N) w
    if out is None:
        return ops.grouped_mm_fp8(x, w_nk, offs, sx, sw, mode, out_dtype)
    ops.grouped_mm_fp8_out(x, w_nk, offs, sx, sw, mode, out, accumulate)
    return out


# ---------------------------------------------------------------- wgrad


def padded_columns(offs: torch.Tensor, tokens: int):
    """Each group's (first padded column, token count) in quantize_fp8's padded layout."""
    return [(BLOCK * (g + s // BLOCK), e - s) for g, (s, e) in enumerate(group_bounds(offs, tokens))]


def reference_grouped_mm_wgrad_fp8(dy_t, x_t, offs, scale_dy, scale_x, out, accumulate):
    groups = offs.numel()
    tokens = dy_t.shape[1] - BLOCK * groups
    dyd = dequantize_blocks(dy_t, scale_dy, 1, BLOCK)
    xd = dequantize_blocks(x_t, scale_x, 1, BLOCK)
    for g, (col, count) in enumerate(padded_columns(offs, tokens)):
        if count == 0:
            if not accumulate:
                out[g] = 0
            continue
        y = dyd[:, col:col + count] @ xd[:, col:col + count].T
        out[g] = (out[g].float() + y) if accumulate else y
    return out


def grouped_mm_wgrad_fp8(dy_t, x_t, offs, *, scale_dy, scale_x, out=None, accumulate=False,
                         out_dtype=torch.float32):
    """The FP8 case of ``distgemm.grouped_mm_wgrad``: ``out[g] = dy_g^T @ x_g`` from dy and x
    quantized per 128 tokens of each expert, transposed and padded
    (``quantize_fp8(t, (1, 128), transpose=True, offs=offs)``): dy_t (N, Tp), x_t (K, Tp),
    scales (N, Tp/128) and (K, Tp/128). Returns (G, N, K) float32."""
    op = "distgemm.grouped_mm_wgrad"
    _check_common(op, dy_t, offs, [("dy", dy_t), ("x", x_t)])
    _check_fp8_pair(op, "dy", dy_t, "x", x_t)
    _require_tensor(op, "scale_dy", scale_dy, torch.float32)
    _require_tensor(op, "scale_x", scale_x, torch.float32)
    groups = offs.numel()
    if groups == 0:
        raise ValueError(f"{op}: offs must hold at least one group")
    if dy_t.dim() != 2 or x_t.dim() != 2 or dy_t.shape[1] != x_t.shape[1]:
        raise ValueError(f"{op}: FP8 dy and x must be (N, Tp) and (K, Tp), transposed and padded "
                         f"per expert by quantize_fp8(..., transpose=True, offs=offs); got "
                         f"{_shape(dy_t)} and {_shape(x_t)}")
    n, tp = dy_t.shape
    k = x_t.shape[0]
    if tp % BLOCK or tp < BLOCK * groups:
        raise ValueError(f"{op}: FP8 dy must be (N, Tp) with Tp = 128 * (ceil(T/128) + G) (the "
                         f"padded layout of quantize_fp8 with offs), got {_shape(dy_t)} for G={groups}")
    for name, s, rows in (("scale_dy", scale_dy, n), ("scale_x", scale_x, k)):
        if _shape(s) != (rows, tp // BLOCK):
            raise ValueError(f"{op}: {name} must be ({rows}, Tp/128) = {(rows, tp // BLOCK)}, got {_shape(s)}")
    if out_dtype != torch.float32:
        raise ValueError(f"{op}: FP8 wgrad writes float32, got out_dtype {out_dtype}")
    # Operands quantized without offs (a (K, T) layout) fit here whenever T >= 128 G; their
    # tokens then run past what the padded layout holds. On the GPU the kernel says so (NaN).
    check_offs_values(op, offs, tp - BLOCK * groups,
                      f"tokens the padded layout of dy and x holds (Tp - 128 G = {tp} - {BLOCK * groups}; "
                      "quantize them with quantize_fp8(..., transpose=True, offs=offs))")
    _require_out(op, out)
    if accumulate and out is None:
        raise ValueError(f"{op}: accumulate=True needs out")
    if out is not None and (_shape(out) != (groups, n, k) or out.dtype != torch.float32
                            or out.device != dy_t.device or not out.is_contiguous()):
        raise ValueError(f"{op}: out must be a contiguous float32 tensor of shape {(groups, n, k)} "
                         f"on {dy_t.device}, got {out.dtype} {_shape(out)}")
    check_no_overlap(op, out, (("dy", dy_t), ("x", x_t), ("scale_dy", scale_dy), ("scale_x", scale_x)))
    if not _use_kernel(dy_t.device):
        if out is None:
            out = torch.empty((groups, n, k), dtype=torch.float32, device=dy_t.device)
        return reference_grouped_mm_wgrad_fp8(dy_t, x_t, offs, scale_dy, scale_x, out, accumulate)
    # The kernel reads the scales as (Tp/128, N) and (Tp/128, K) contiguous.
    sdy, sx = scale_dy.t().contiguous(), scale_x.t().contiguous()
    dy_t, x_t = aligned16(dy_t.contiguous()), aligned16(x_t.contiguous())
    if out is None:
        out = torch.empty((groups, n, k), dtype=torch.float32, device=dy_t.device)

    # The tile is timed on the first eager call of each problem: the 256 x 128 tile spills
    # registers (per-row times per-column scales in its promotion) and the 128 x 128 one does
    # not; the smaller ran 10-18% faster with 512-1024 tokens per expert, 5% slower with 8192
    # (bench/NOTES.md, grouped tile choice).
    call = GroupedPass(dy_t, x_t, offs, out, accumulate, (groups, n, k), torch.float32, extra=(sdy, sx))
    chosen = None
    if _WGRAD.active():
        chosen = _WGRAD.choose(call.key("wgrad", tp, SCALE_BLOCK), call, _wgrad_candidates(dy_t.dtype), dy_t.device,
                               call.scratch)
    _WGRAD.record(chosen.name if chosen is not None else "cutlass")
    _run_wgrad_config(call, chosen.config if chosen is not None else -1)
    return out


_WGRAD = Dispatcher("distgemm.grouped_mm_wgrad (float8)")


def _run_wgrad_config(call: GroupedPass, config: int):
    scale_dy, scale_x = call.extra
    ops.grouped_mm_wgrad_fp8_out(call.a, call.b, call.offs, scale_dy, scale_x, call.out, call.accumulate, config)
    return call.out


@functools.lru_cache(maxsize=None)
def _wgrad_candidates(dy_dtype) -> tuple:
    """The FP8 wgrad's tile configurations in this build (no vendor peer takes its layout)."""
    return configs(ops.grouped_configs(2, dy_dtype, torch.float32, 90, SCALE_BLOCK), _run_wgrad_config)


# ---------------------------------------------------------------- op registration


@torch.library.register_fake("distgemm::grouped_mm_fp8")
def _grouped_mm_fp8_fake(x, w, offs, scale_x, scale_w, scale_mode, out_dtype, config=-1):
    return x.new_empty((x.shape[0], w.shape[1]), dtype=out_dtype)


@torch.library.register_fake("distgemm::grouped_mm_fp8_out")
def _grouped_mm_fp8_out_fake(x, w, offs, scale_x, scale_w, scale_mode, out, accumulate, config=-1):
    return None


@torch.library.register_fake("distgemm::grouped_mm_wgrad_fp8_out")
def _grouped_mm_wgrad_fp8_out_fake(dy_t, x_t, offs, scale_dy, scale_x, out, accumulate, config=-1):
    return None
