"""distgemm.quantize_fp8: fused FP8 quantization with FP32 scales in one CUDA kernel that reads
the input once (per-tensor scales: an amax kernel first; group offsets: a tiny scan first).

Every block of elements that share a scale gets::

    scale = amax / fp8_max    float32; amax = max |x| over the block, fp8_max = 448 (e4m3fn)
                              or 57344 (e5m2); 1.0 where that is 0 (an all-zero block, or an
                              amax so small that the division underflows)
    data  = x / scale         rounded to nearest even, saturated to +-fp8_max

in float32 from the input values. It is a true division, not ``x * (1 / scale)``, in the CUDA
kernel and in the plain-PyTorch reference here alike, so the two give the same bits. A NaN in a
block makes its scale and data NaN. Dequantize with ``data.float() * scale`` broadcast over each
block (``dequantize_fp8``).

Granularities and layouts:

- ``"tensor"``: scale 0-dim.
- ``"row"``: scale (R,).
- ``(1, 128)``: 128 consecutive elements of a row (activations): scale (R, ceil(C/128)) with
  strides (1, R), PyTorch's BlockWise1x128 / DeepGEMM layout.
- ``(128, 128)``: 128 x 128 blocks (weights); x may be 3-D (B, R, C), one set of blocks per
  matrix: scale (ceil(R/128), ceil(C/128)), or (B, ...) for 3-D, contiguous.
- ``(1, 128)`` with ``transpose=True``: x^T quantized without being formed; blocks are 128
  consecutive rows of x in one column. data (C, R), scale (C, ceil(R/128)) with strides (1, C).
  With ``offs`` (G int32 cumulative group ends on x's device, as in ``torch._grouped_mm``) the
  grouped, padded layout a variable-K grouped wgrad reads: Rp = 128 * (ceil(R/128) + G),
  data (C, Rp), group g's rows from column 128 * (g + start_g // 128), zeros in every other
  column, scale (C, Rp/128) with strides (1, C) (1.0 for blocks without rows); no scale block
  mixes two groups. Ends are clamped to [0, R] and taken as a running maximum, so a decreasing
  offset gives an empty group (for valid offsets, non-decreasing within [0, R], exactly
  ``torch._grouped_mm``'s groups). The kernel reads offs on the device: no host sync.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ._library import has_kernels, ops, warn_once

Granularity = Union[str, Tuple[int, int]]

BLOCK = 128
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The op's granularity codes (dg_quant_granularity).
TENSOR, ROW, BLOCK_1X128, BLOCK_128X128 = 0, 1, 2, 3
_GRANULARITIES = {"tensor": TENSOR, "row": ROW, (1, 128): BLOCK_1X128, (128, 128): BLOCK_128X128}


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _blocks(n):
    return (n + BLOCK - 1) // BLOCK


def granularity_code(op: str, granularity) -> int:
    """The op's code for a granularity: "tensor", "row", (1, 128) or (128, 128)."""
    if isinstance(granularity, str):
        key = granularity
    elif (isinstance(granularity, (tuple, list)) and len(granularity) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in granularity)):
        key = tuple(granularity)
    else:
        raise TypeError(f"{op}: granularity must be 'tensor', 'row', (1, 128) or (128, 128), got "
                        f"{granularity!r} ({type(granularity).__name__})")
    if key not in _GRANULARITIES:
        raise ValueError(f"{op}: granularity must be 'tensor', 'row', (1, 128) or (128, 128), got {granularity!r}")
    return _GRANULARITIES[key]


def check_arguments(op: str, x, granularity, dtype, transpose, offs) -> int:
    """Validates quantize_fp8's arguments; returns the granularity code."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{op}: x must be bfloat16, float16 or float32, got {x.dtype}")
    code = granularity_code(op, granularity)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{op}: dtype must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in FP8_MAX:
        raise ValueError(f"{op}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if not isinstance(transpose, bool):
        raise TypeError(f"{op}: transpose must be a bool, got {type(transpose).__name__}")
    if code == BLOCK_128X128:
        if x.dim() not in (2, 3):
            raise ValueError(f"{op}: x must be 2-D (R, C) or 3-D (B, R, C) for (128, 128) blocks, got shape "
                             f"{_shape(x)}")
    elif x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (R, C) for granularity {granularity!r} (3-D only with "
                         f"(128, 128) blocks), got shape {_shape(x)}")
    if transpose and code != BLOCK_1X128:
        raise ValueError(f"{op}: transpose=True needs granularity (1, 128), got {granularity!r}")
    if offs is not None:
        if not transpose:
            raise ValueError(f"{op}: offs applies to transpose=True only (the grouped, padded layout)")
        if not isinstance(offs, torch.Tensor):
            raise TypeError(f"{op}: offs must be a torch.Tensor or None, got {type(offs).__name__}")
        if offs.dtype != torch.int32 or offs.dim() != 1:
            raise ValueError(f"{op}: offs must be a 1-D int32 tensor of cumulative group ends, got "
                             f"{offs.dtype} of shape {_shape(offs)}")
        if offs.numel() == 0:
            raise ValueError(f"{op}: offs must hold at least one group end")
        if offs.device != x.device:
            raise ValueError(f"{op}: offs is on {offs.device} but x is on {x.device}")
        if x.shape[0] >= 2**31:
            raise ValueError(f"{op}: x must have fewer than 2^31 rows with offs (int32 group ends), got "
                             f"{x.shape[0]}")
    return code


def quantize_fp8(x: torch.Tensor, granularity: Granularity, *,
                 dtype: torch.dtype = torch.float8_e4m3fn, transpose: bool = False,
                 offs: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantizes x (bfloat16, float16 or float32) to ``dtype`` (float8_e4m3fn or float8_e5m2)
    with float32 scales; returns ``(data, scale)``. See the module docstring for the
    granularities and layouts. Non-contiguous x is made contiguous; not differentiable.
    CUDA tensors on sm_90/sm_100 run the fused kernel (CUDA-graph safe, offs stay on the
    device); CPU tensors and other GPUs the plain-PyTorch reference, with the same results."""
    op = "distgemm.quantize_fp8"
    code = check_arguments(op, x, granularity, dtype, transpose, offs)
    x = x.detach().contiguous()
    if x.device.type == "cuda" and not has_kernels(x.device):
        warn_once(f"distgemm: no FP8 quantization kernels for {torch.cuda.get_device_name(x.device)}; "
                  "running the PyTorch reference")
        return reference_quantize_fp8(x, code, dtype, transpose, offs)
    return ops.quantize_fp8(x, code, dtype, transpose, offs)


# ---------------------------------------------------------------- the reference


def _scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """amax / fp8_max, or 1 where that is 0."""
    scale = amax / fp8_max
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _to_fp8(v: torch.Tensor, scale: torch.Tensor, fp8_max: float, dtype: torch.dtype) -> torch.Tensor:
    """v / scale (a true division; scale broadcast) rounded to nearest even and saturated
    (PyTorch's float8 conversion makes NaN of what lies beyond the largest finite value)."""
    return torch.div(v, scale).clamp(-fp8_max, fp8_max).to(dtype)


def _quantize_blocks(v: torch.Tensor, fp8_max: float, dtype: torch.dtype):
    """v (..., n, block) float32, one scale per last-dim row: (data (..., n, block), scale (..., n))."""
    scale = _scale(v.abs().amax(dim=-1), fp8_max)
    return _to_fp8(v, scale.unsqueeze(-1), fp8_max, dtype), scale


def _quantize_1x128(xf: torch.Tensor, fp8_max: float, dtype: torch.dtype):
    """xf (R, C) float32 in blocks of 128 along C: (data (R, C), scale (R, ceil(C/128)))."""
    rows, cols = xf.shape
    nb = _blocks(cols)
    v = F.pad(xf, (0, nb * BLOCK - cols)).reshape(rows, nb, BLOCK)
    data, scale = _quantize_blocks(v, fp8_max, dtype)
    return data.reshape(rows, nb * BLOCK)[:, :cols].contiguous(), scale


def _transposed_scale(scale: torch.Tensor) -> torch.Tensor:
    """scale (n, blocks) as the op returns it: stored (blocks, n), strides (1, n)."""
    n, blocks = scale.shape
    return torch.empty_strided((n, blocks), (1, n), dtype=torch.float32, device=scale.device).copy_(scale)


def group_spans(offs: torch.Tensor, rows: int) -> List[Tuple[int, int, int]]:
    """Per group (start, end, first padded block) of the grouped transposed layout: ends
    clamped to [0, rows] and non-decreasing, first block g + start // 128. Reads offs on the host."""
    spans, end = [], 0
    for g, o in enumerate(offs.tolist()):
        start = end
        end = max(end, min(max(o, 0), rows))
        spans.append((start, end, g + start // BLOCK))
    return spans


def reference_quantize_fp8(x: torch.Tensor, granularity: Union[int, Granularity],
                           dtype: torch.dtype = torch.float8_e4m3fn, transpose: bool = False,
                           offs: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8 in plain PyTorch (any device), for arguments it accepted: the same values
    and layouts (and strides). ``granularity`` as quantize_fp8 takes it, or its code."""
    code = granularity if isinstance(granularity, int) else granularity_code("reference_quantize_fp8", granularity)
    fp8_max = FP8_MAX[dtype]
    xf = x.float()
    if code == TENSOR:
        scale = _scale(xf.abs().amax() if xf.numel() else xf.new_zeros(()), fp8_max)
        return _to_fp8(xf, scale, fp8_max, dtype), scale
    if code == ROW:
        rows, cols = xf.shape
        scale = _scale(xf.abs().amax(dim=1) if cols else xf.new_zeros(rows), fp8_max)
        return _to_fp8(xf, scale.unsqueeze(1), fp8_max, dtype), scale
    if code == BLOCK_128X128:
        squeeze = xf.dim() == 2
        xb = xf.unsqueeze(0) if squeeze else xf
        b, rows, cols = xb.shape
        rb, cb = _blocks(rows), _blocks(cols)
        v = F.pad(xb, (0, cb * BLOCK - cols, 0, rb * BLOCK - rows))
        v = v.reshape(b, rb, BLOCK, cb, BLOCK).permute(0, 1, 3, 2, 4).reshape(b, rb, cb, BLOCK * BLOCK)
        data, scale = _quantize_blocks(v, fp8_max, dtype)
        data = data.reshape(b, rb, cb, BLOCK, BLOCK).permute(0, 1, 3, 2, 4).reshape(b, rb * BLOCK, cb * BLOCK)
        data = data[:, :rows, :cols].contiguous()
        return (data[0], scale[0]) if squeeze else (data, scale)
    if not transpose:
        data, scale = _quantize_1x128(xf, fp8_max, dtype)
        return data, _transposed_scale(scale)
    if offs is None:
        data, scale = _quantize_1x128(xf.t(), fp8_max, dtype)
        return data, _transposed_scale(scale)
    rows, cols = xf.shape
    padded_blocks = _blocks(rows) + offs.numel()
    data = torch.zeros((cols, padded_blocks * BLOCK), dtype=dtype, device=x.device)
    scale = torch.ones((padded_blocks, cols), dtype=torch.float32, device=x.device)
    for start, end, first in group_spans(offs, rows):
        if end > start:
            d, s = _quantize_1x128(xf[start:end].t(), fp8_max, dtype)
            data[:, first * BLOCK:first * BLOCK + end - start] = d
            scale[first:first + s.shape[1]] = s.t()
    return data, _transposed_scale(scale.t())


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, granularity: Granularity, *,
                   transpose: bool = False) -> torch.Tensor:
    """``data.float() * scale`` broadcast over the blocks of ``granularity``, float32, in data's
    shape (for transpose=True, data is x^T or the padded grouped layout: blocks of 128 along
    its columns)."""
    op = "distgemm.dequantize_fp8"
    code = granularity_code(op, granularity)
    for name, t in (("data", data), ("scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    # The scale's shape for data's (broadcasting a scale of another granularity would be silently wrong).
    if code == TENSOR:
        want, ok = "one value", scale.numel() == 1
    elif data.dim() < 2:
        raise ValueError(f"{op}: data must be 2-D for granularity {granularity!r}, got shape {_shape(data)}")
    elif code == ROW:
        want, ok = f"({data.shape[0]},)", scale.numel() == data.shape[0] and data.dim() == 2
    elif code == BLOCK_1X128:
        shape = (*data.shape[:-1], _blocks(data.shape[-1]))
        want, ok = str(shape), _shape(scale) == shape
    else:
        shape = (*data.shape[:-2], _blocks(data.shape[-2]), _blocks(data.shape[-1]))
        want, ok = str(shape), _shape(scale) == shape
    if not ok:
        raise ValueError(f"{op}: scale must have shape {want} for data of shape {_shape(data)} and granularity "
                         f"{granularity!r}, got {_shape(scale)}")
    d = data.float()
    s = scale.float()
    if code == TENSOR:
        return d * s
    if code == ROW:
        return d * s.reshape(-1, 1)
    if code == BLOCK_1X128:  # x (R, C): scale (R, C/128); x^T (C, R[p]): scale (C, R[p]/128)
        return d * s.repeat_interleave(BLOCK, dim=-1)[..., :d.shape[-1]]
    expanded = s.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return d * expanded[..., :d.shape[-2], :d.shape[-1]]


# ---------------------------------------------------------------- op registration


def empty_outputs(x, code: int, dtype, transpose: bool, groups: Optional[int]):
    """Uninitialized (data, scale) with the op's shapes and strides."""
    f32 = dict(dtype=torch.float32, device=x.device)
    if code == BLOCK_128X128:
        scale_shape = (*x.shape[:-2], _blocks(x.shape[-2]), _blocks(x.shape[-1]))
        return x.new_empty(x.shape, dtype=dtype), torch.empty(scale_shape, **f32)
    rows, cols = x.shape
    if code == TENSOR:
        return x.new_empty((rows, cols), dtype=dtype), torch.empty((), **f32)
    if code == ROW:
        return x.new_empty((rows, cols), dtype=dtype), torch.empty((rows,), **f32)
    if not transpose:
        nb = _blocks(cols)
        return x.new_empty((rows, cols), dtype=dtype), torch.empty_strided((rows, nb), (1, rows), **f32)
    nb = _blocks(rows) + (groups or 0)
    width = nb * BLOCK if groups else rows
    return x.new_empty((cols, width), dtype=dtype), torch.empty_strided((cols, nb), (1, cols), **f32)


_SPECS = {code: spec for spec, code in _GRANULARITIES.items()}


def _check_op_arguments(x, granularity, dtype, transpose, offs) -> None:
    """The op called directly (torch.ops.distgemm.quantize_fp8): the API's checks."""
    op = "distgemm.quantize_fp8"
    if granularity not in _SPECS:
        raise ValueError(f"{op}: granularity must be 0 (tensor), 1 (row), 2 (1 x 128) or 3 (128 x 128), "
                         f"got {granularity}")
    check_arguments(op, x, _SPECS[granularity], dtype, transpose, offs)


@torch.library.register_fake("distgemm::quantize_fp8")
def _quantize_fp8_fake(x, granularity, dtype, transpose=False, offs=None):
    _check_op_arguments(x, granularity, dtype, transpose, offs)
    return empty_outputs(x, granularity, dtype, transpose, None if offs is None else offs.shape[0])


@torch.library.register_kernel("distgemm::quantize_fp8", "cpu")
def _quantize_fp8_cpu(x, granularity, dtype, transpose=False, offs=None):
    _check_op_arguments(x, granularity, dtype, transpose, offs)
    return reference_quantize_fp8(x.contiguous(), granularity, dtype, transpose, offs)
