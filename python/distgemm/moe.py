"""The MoE expert MLP: fc1 -> activation -> fc2 for every expert, forward and backward, in
bf16 or FP8, with the quantization folded into the passes the layer makes anyway.

- :func:`activation`: an activation (SwiGLU, GELU, or the identity) or its derivative applied
  in FP32 and rounded to bf16, then written in every form the next GEMMs read from one read of
  the input: bf16 rows, FP8 rows with one scale per 1 x 128 (the FP8 grouped GEMM's x), and
  the FP8 transpose padded per expert with one scale per 128 tokens (the FP8 wgrad's
  operands). Each FP8 copy is bit-identical to :func:`distgemm.quantize_fp8` of the bf16 values.
- :func:`quantize_weight`: an expert weight's FP8 copy and its transposed copy (the dgrad's
  K-major operand) from one read.
- :func:`grouped_mlp`: the layer, functional (parameters owned by the caller);
  :class:`distgemm.nn.GroupedMLP` is the module over it.

SwiGLU takes fc1's output as ``[gate | up]`` (the first ``ffn`` columns are the gate, as in
Megatron-LM's fused gate/up weight): ``silu(gate) * up``. GELU is the erf form
(``torch.nn.functional.gelu``'s default).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from . import _settings
from ._checks import check_flags, check_main_grad
from ._library import has_kernels, ops
from ._routing import _preview, check_offs_values
from .grouped import grouped_mm, grouped_mm_wgrad
from .quantize import FP8_MAX, quantize_fp8

ACTIVATIONS = ("swiglu", "gelu")
FP8_RECIPES = ("block", "row")
BLOCK = 128
# dg_moe_act's values.
IDENTITY, SWIGLU, GELU, SWIGLU_BACKWARD, GELU_BACKWARD = range(5)
_FORWARD = {"identity": IDENTITY, "swiglu": SWIGLU, "gelu": GELU}
_BACKWARD = {"swiglu": SWIGLU_BACKWARD, "gelu": GELU_BACKWARD}


class ActivationOut(NamedTuple):
    """What :func:`activation` wrote; a form not asked for is None."""
    y: Optional[torch.Tensor]          # bf16 (T, Y)
    y_fp8: Optional[torch.Tensor]      # FP8 (T, Y)
    y_scale: Optional[torch.Tensor]    # (T, ceil(Y/128)), strides (1, T)
    yt_fp8: Optional[torch.Tensor]     # FP8 (Y, Tp), transposed and padded per expert
    yt_scale: Optional[torch.Tensor]   # (Y, Tp/128), strides (1, Y)


def _act_code(op: str, kind, backward: bool) -> int:
    table = _BACKWARD if backward else _FORWARD
    if not isinstance(kind, str) or kind not in table:
        raise ValueError(f"{op}: activation must be one of {tuple(table)}{' (with dy)' if backward else ''}, "
                         f"got {kind!r}")
    return table[kind]


def _reference_values(x: torch.Tensor, code: int, dy: Optional[torch.Tensor], inner: int) -> torch.Tensor:
    """The activation rounded to bf16, computed in float64 (the kernel's FP32 formulas are
    accurate to a few FP32 ulps, well inside one of bf16)."""
    xf = x.double()
    if code == IDENTITY:  # a copy, as the kernel writes one
        return x.to(torch.bfloat16, copy=True)
    if code == GELU:  # x * Phi(x) through erfc: torch's gelu (1 + erf) cancels for negative x, in float64 too
        return (xf * 0.5 * torch.erfc(-xf * 0.7071067811865476)).to(torch.bfloat16)
    gate, up = (xf[:, :inner], xf[:, inner:]) if code in (SWIGLU, SWIGLU_BACKWARD) else (xf, None)
    if code == SWIGLU:
        return (gate * torch.sigmoid(gate) * up).to(torch.bfloat16)
    d = dy.double()
    if code == GELU_BACKWARD:
        cdf = 0.5 * torch.erfc(-gate * 0.7071067811865476)
        pdf = torch.exp(-0.5 * gate * gate) * 0.3989422804014327
        return (d * (cdf + gate * pdf)).to(torch.bfloat16)
    s = torch.sigmoid(gate)
    return torch.cat([d * up * s * (1.0 + gate * (1.0 - s)), d * gate * s], dim=1).to(torch.bfloat16)


def _check_activation_args(op, x, code, dy, offs, transposed, fp8_dtype) -> int:
    """The activation's width, once the arguments are checked."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"{op}: x must be a 2-D bfloat16 tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} of shape {tuple(getattr(x, 'shape', ()))}")
    if code in (SWIGLU, SWIGLU_BACKWARD) and x.shape[1] % 2:
        raise ValueError(f"{op}: SwiGLU takes x = [gate | up] with an even number of columns, got {x.shape[1]}")
    inner = x.shape[1] // 2 if code in (SWIGLU, SWIGLU_BACKWARD) else x.shape[1]
    if dy is not None and (not isinstance(dy, torch.Tensor) or dy.dtype != torch.bfloat16
                           or tuple(dy.shape) != (x.shape[0], inner) or dy.device != x.device):
        got = f"{dy.dtype} {tuple(dy.shape)} on {dy.device}" if isinstance(dy, torch.Tensor) else type(dy).__name__
        raise ValueError(f"{op}: dy must be a bfloat16 tensor of shape {(x.shape[0], inner)} on {x.device}, got {got}")
    if transposed:
        if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() < 1:
            got = (f"{offs.dtype} of shape {tuple(offs.shape)}" if isinstance(offs, torch.Tensor)
                   else type(offs).__name__)
            raise ValueError(f"{op}: fp8_transposed needs offs, a 1-D int32 tensor of cumulative expert ends, "
                             f"got {got}")
        if offs.device != x.device:
            raise ValueError(f"{op}: offs is on {offs.device} but x is on {x.device}")
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"{op}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    return inner


def activation(x: torch.Tensor, kind: str = "identity", *, dy: Optional[torch.Tensor] = None,
               offs: Optional[torch.Tensor] = None, bf16: bool = True, fp8_rows: bool = False,
               fp8_transposed: bool = False, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
               rows: Optional[torch.Tensor] = None) -> ActivationOut:
    """``kind`` ("identity", "swiglu", "gelu") of x (T, C; (T, 2C) for SwiGLU), or with ``dy``
    (T, C) its derivative's product with dy ((T, 2C) for SwiGLU: the gate's and up's
    gradients), in the forms asked for (see the module docstring). ``offs`` (int32 cumulative
    expert ends on x's device) is needed by ``fp8_transposed``. ``rows`` (the identity only;
    int64 (R,) on x's device) gathers as it reads: row r of every output is x[rows[r]], zeros
    where rows[r] < 0, NaN where rows[r] >= T (bad input, seen on the device only). Not
    differentiable."""
    op = "distgemm.moe.activation"
    check_flags(op, bf16=bf16, fp8_rows=fp8_rows, fp8_transposed=fp8_transposed)
    code = _act_code(op, kind, dy is not None)
    inner = _check_activation_args(op, x, code, dy, offs, fp8_transposed, fp8_dtype)
    if not (bf16 or fp8_rows or fp8_transposed):
        raise ValueError(f"{op}: ask for at least one of bf16, fp8_rows and fp8_transposed")
    if rows is not None:
        if code != IDENTITY:
            raise ValueError(f"{op}: rows (a gather) applies to the identity only, got kind {kind!r}")
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype != torch.int64 or rows.device != x.device:
            raise ValueError(f"{op}: rows must be a 1-D int64 tensor on {x.device}, got "
                             f"{getattr(rows, 'dtype', type(rows).__name__)} of shape {tuple(getattr(rows, 'shape', ()))}")
    if fp8_transposed:
        check_offs_values(op, offs, x.shape[0] if rows is None else rows.numel(), "rows")
    if rows is not None:
        if x.is_cuda and has_kernels(x.device):
            y, y8, sy, yt8, syt = ops.moe_act(x, None, code, inner, offs if fp8_transposed else None, bf16, fp8_rows,
                                              fp8_transposed, fp8_dtype, rows)
            return ActivationOut(y if bf16 else None, y8 if fp8_rows else None, sy if fp8_rows else None,
                                 yt8 if fp8_transposed else None, syt if fp8_transposed else None)
        x = _gathered(x, rows)
    # A 1 x 128 block must not span the gate and up halves of the SwiGLU backward's rows.
    split_rows = code == SWIGLU_BACKWARD and fp8_rows and inner % BLOCK != 0
    if x.is_cuda and has_kernels(x.device):
        y, y8, sy, yt8, syt = ops.moe_act(x, dy, code, inner, offs if fp8_transposed else None,
                                          bf16 or split_rows, fp8_rows and not split_rows, fp8_transposed, fp8_dtype)
        out = [y if bf16 or split_rows else None, y8 if fp8_rows else None, sy if fp8_rows else None,
               yt8 if fp8_transposed else None, syt if fp8_transposed else None]
        if split_rows:
            out[1], out[2] = quantize_fp8(y, (1, BLOCK), dtype=fp8_dtype)
            out[0] = y if bf16 else None
        return ActivationOut(*out)
    y = _reference_values(x.detach(), code, None if dy is None else dy.detach(), inner)
    y8 = sy = yt8 = syt = None
    if fp8_rows:
        y8, sy = quantize_fp8(y, (1, BLOCK), dtype=fp8_dtype)
    if fp8_transposed:
        yt8, syt = quantize_fp8(y, (1, BLOCK), dtype=fp8_dtype, transpose=True, offs=offs)
    return ActivationOut(y if bf16 else None, y8, sy, yt8, syt)


def quantize_weight(w: torch.Tensor, recipe: str = "block", *, copies: str = "both",
                    dtype: torch.dtype = torch.float8_e4m3fn):
    """An expert weight w (G, N, K) in FP8 for the forward and, stored (G, K, N), for the dgrad:
    ``(w_fp8, scale, wt_fp8, scale_t)``. ``"block"``: one scale per 128 x 128 block, shared by
    both copies ((G, ceil(N/128), ceil(K/128))), both from one read of w; ``"row"``: one per
    output channel, (G, N) and (G, K). ``copies="forward"`` or ``"dgrad"`` makes only that
    copy (the other two entries are None)."""
    op = "distgemm.moe.quantize_weight"
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"{op}: w must be a 3-D (G, N, K) tensor, got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"{op}: recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    if copies not in ("both", "forward", "dgrad"):
        raise ValueError(f"{op}: copies must be 'both', 'forward' or 'dgrad', got {copies!r}")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{op}: w must be bfloat16, float16 or float32, got {w.dtype}")
    if dtype not in FP8_MAX:
        raise ValueError(f"{op}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    fwd, dgrad = copies in ("both", "forward"), copies in ("both", "dgrad")
    w = w.detach()
    g, n, k = w.shape
    if recipe == "block":
        if w.is_cuda and has_kernels(w.device):
            w8, wt8, sw = ops.quantize_fp8_weight(w, dtype, fwd, dgrad)
        else:
            w8, sw = quantize_fp8(w, (BLOCK, BLOCK), dtype=dtype)
            wt8 = w8.transpose(1, 2).contiguous() if dgrad else None
        # Both copies share the scales.
        return (w8 if fwd else None, sw if fwd else None, wt8 if dgrad else None, sw if dgrad else None)
    if w.is_cuda and has_kernels(w.device):  # the transpose's scales from w's columns: w^T never formed
        w8, sw, wt8, swt = ops.quantize_fp8_weight_rows(w, dtype, fwd, dgrad)
        return (w8 if fwd else None, sw if fwd else None, wt8 if dgrad else None, swt if dgrad else None)
    out = [None] * 4
    if fwd:
        w8, sw = quantize_fp8(w.reshape(g * n, k), "row", dtype=dtype)
        out[0], out[1] = w8.view(g, n, k), sw.view(g, n)
    if dgrad:  # per output channel of the transpose: a (K, N) row-major copy of each expert first
        out[2], out[3] = _row_quantized_transpose(w, dtype)
    return tuple(out)


# Experts whose transposed bf16 copies the row recipe's dgrad copy makes at once: 1/8 of the
# weight at most (one expert at least), so that the copy's transient is not a second weight.
_TRANSPOSE_CHUNKS = 8


def _row_quantized_transpose(w: torch.Tensor, dtype: torch.dtype):
    g, n, k = w.shape
    step = max(1, -(-g // _TRANSPOSE_CHUNKS))
    if step >= g:
        wt8, swt = quantize_fp8(w.transpose(1, 2).reshape(g * k, n), "row", dtype=dtype)
        return wt8.view(g, k, n), swt.view(g, k)
    wt8 = torch.empty((g, k, n), dtype=dtype, device=w.device)
    swt = torch.empty((g, k), dtype=torch.float32, device=w.device)
    for s in range(0, g, step):
        e = min(g, s + step)
        q, sq = quantize_fp8(w[s:e].transpose(1, 2).reshape((e - s) * k, n), "row", dtype=dtype)
        wt8[s:e].copy_(q.view(e - s, k, n))
        swt[s:e].copy_(sq.view(e - s, k))
    return wt8, swt


# ---------------------------------------------------------------- the layer


def _expert_of_rows(offs: torch.Tensor, tokens: int) -> torch.Tensor:
    """Index of the expert owning each row, on the device (no host sync); G for the rows past
    offs[-1], which belong to no expert."""
    rows = torch.arange(tokens, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, rows, right=True)


def _bias_of_rows(bias: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Each row's expert bias (G, n) in FP32, zeros for the rows past offs[-1] (experts from
    _expert_of_rows): no expert's bias or its gradient touches them."""
    padded = torch.cat([bias.float(), bias.new_zeros((1, bias.shape[1]), dtype=torch.float32)])
    return padded[experts]


def _add_bias(y: torch.Tensor, bias: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return (y.float() + _bias_of_rows(bias, experts)).to(y.dtype)


def _bias_grad(grad: torch.Tensor, experts: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each expert's rows of grad summed in FP32 (the rows past offs[-1], which hold whatever the
    GEMMs left there, into a bucket dropped)."""
    out = torch.zeros((bias.shape[0] + 1, bias.shape[1]), dtype=torch.float32, device=grad.device)
    return out.index_add_(0, experts, grad.float())[:-1].to(bias.dtype)


def _weight_grad(weight, fuse_wgrad, dy, x, offs, **fp8_scales):
    """dy^T x per expert: into weight.main_grad with fused accumulation (Megatron-LM's
    convention for what is returned then), else as the weight's gradient. A weight with
    ``overwrite_main_grad = True`` (TransformerEngine's flag, which Megatron-FSDP sets) has
    main_grad written rather than added to: the kernel does not read it (half the FP32 traffic
    of the wgrad's epilogue) and the framework need not zero it first; experts without tokens
    get zeros."""
    if fuse_wgrad:
        accumulate = not getattr(weight, "overwrite_main_grad", False)
        grouped_mm_wgrad(dy, x, offs, out=weight.main_grad, accumulate=accumulate, **fp8_scales)
        return _fused_grad(weight)
    return grouped_mm_wgrad(dy, x, offs, **fp8_scales).to(weight.dtype)


def _fused_grad(weight):
    """What the backward returns for a weight whose gradient went into main_grad: Megatron-LM's
    placeholder where the weight asks for one (grad_added_to_main_grad), else None."""
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        return make(weight.shape, dtype=weight.dtype, device=weight.device)
    return None


class _NoRows(torch.autograd.Function):
    """The layer on no rows: an empty output whose backward gives x and every parameter a zero
    gradient (a fused weight adds nothing into main_grad), as the layer's GEMMs would."""

    @staticmethod
    def forward(ctx, x, w1, w2, b1, b2, fuse_wgrad):
        ctx.fuse_wgrad, ctx.x_shape = fuse_wgrad, x.shape
        ctx.save_for_backward(w1, w2, b1, b2)  # for their shapes and main_grad flags
        return x.new_zeros((0, w2.shape[1]))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        w1, w2, b1, b2 = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads = [grad.new_zeros(ctx.x_shape) if need[0] else None]
        for i, w in ((1, w1), (2, w2)):
            if need[i] and ctx.fuse_wgrad and getattr(w, "overwrite_main_grad", False):
                w.main_grad.zero_()  # written with this step's gradient, which is zero
            grads.append(None if not need[i] else _fused_grad(w) if ctx.fuse_wgrad else torch.zeros_like(w))
        grads += [torch.zeros_like(b) if need[i] else None for i, b in ((3, b1), (4, b2))]
        return tuple(grads) + (None,)


def _forms(x, kind, recipe, offs, *, rows, transposed, dtype, dy=None, bf16=False, source=None):
    """What the layer's GEMMs read of an operand (or of the activation of one), in one pass
    where the recipe allows: (bf16 values or None, FP8 rows, their scales, FP8 padded
    transpose, its scales); the row recipe's full-row scales take a second read. `source`
    (the block recipe's identity only): the operand's rows are x[source], gathered as read."""
    block = recipe == "block"
    identity = kind == "identity"
    want_bf16 = bf16 or (rows and not block and not identity)
    out = ActivationOut(None, None, None, None, None)
    if want_bf16 or (rows and block) or transposed:
        out = activation(x, kind, dy=dy, offs=offs, bf16=want_bf16, fp8_rows=rows and block,
                         fp8_transposed=transposed, fp8_dtype=dtype, rows=source)
    values = x if identity else out.y
    r8, rs = out.y_fp8, out.y_scale
    if rows and not block:
        r8, rs = quantize_fp8(values, "row", dtype=dtype)
    return (values if bf16 else None), r8, rs, out.yt_fp8, out.yt_scale


def _release(*tensors) -> None:
    """Frees the memory of saved activations the backward has read for the last time (their
    SavedVariables keep the tensor objects, not the storage: TransformerEngine's way). Not when
    the graph is kept for another backward (retain_graph=True: they are read again), nor while
    torch.compile traces (its backward frees what it no longer needs itself)."""
    if torch.compiler.is_compiling() or _graph_kept():
        return
    for t in tensors:
        if t is not None:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def _graph_kept() -> bool:
    """Whether the running backward keeps the graph (retain_graph=True): its saved tensors will be
    read again. True where torch does not say (a private call), so that nothing is freed then."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else bool(keep_graph())


class _GroupedMLP(torch.autograd.Function):
    """fc1 -> activation -> fc2 per expert. FP8: the weights' copies come in quantized; x, the
    activation, the output gradient and the activation's gradient are each quantized in the
    pass that reads them anyway (rows for the next GEMM, the padded transpose for the wgrad),
    and the backward keeps FP8 copies, not bf16 ones, of what the wgrads read. The backward
    frees each saved activation after its last use (unless the graph is kept). `save_input`
    (FP8): x itself is saved and its transposed copy made in the backward, for callers that keep
    x anyway (not for a non-contiguous x: its contiguous copy would cost more than the FP8 one)."""

    @staticmethod
    def forward(ctx, x, offs, w1, w2, b1, b2, w1_fp8, w1_scale, w1t_fp8, w1t_scale, w2_fp8, w2_scale,
                w2t_fp8, w2t_scale, kind, recipe, grad_dtype, fuse_wgrad, source, token_rows, k, save_input):
        # source / token_rows / k: route()'s gather, when x holds the tokens (see grouped_mlp).
        gather = source is not None
        # x kept only where it is the caller's: not a contiguous copy, nor rows gathered here.
        save_input = save_input and x.is_contiguous() and not (gather and recipe != "block")
        x = x.contiguous()
        if gather and recipe != "block":  # the gather as its own pass
            x = _gathered_rows(x, source)
        tokens = source.numel() if gather else x.shape[0]
        need_dx, need_w1, need_w2 = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        need_b1 = b1 is not None and ctx.needs_input_grad[4]
        need_da = need_dx or need_w1 or need_b1  # the gradients below the activation, which read h
        experts = _expert_of_rows(offs, tokens) if (b1 is not None or b2 is not None) else None
        if recipe is None:
            h = grouped_mm(x, w1, offs)
            if b1 is not None:
                h = _add_bias(h, b1, experts)
            a = activation(h, kind).y
            y = grouped_mm(a, w2, offs)
            # Each kept only for the gradients that read it: x fc1's weight's, a fc2's, h those below the activation.
            saved = (x if need_w1 else None, h if need_da else None, a if need_w2 else None)
        else:
            e4m3 = torch.float8_e4m3fn
            # Copies made per call are made just before their GEMM and dropped after it (the
            # dgrad's in the backward), so that at most one weight's copy is alive at a time.
            _, x8, sx, xt8, sxt = _forms(x, "identity", recipe, offs, rows=True, transposed=need_w1 and not save_input,
                                         dtype=e4m3, source=source if recipe == "block" else None)
            if save_input and need_w1:
                xt8 = x  # the tokens where the block recipe gathers them as read (source saved too)
            if w1_fp8 is None:
                w1_fp8, w1_scale, _, _ = quantize_weight(w1, recipe, copies="forward")
            h = grouped_mm(x8, w1_fp8, offs, scale_x=sx, scale_w=w1_scale)
            del x8, sx, w1_fp8, w1_scale
            if b1 is not None:
                h = _add_bias(h, b1, experts)
            _, a8, sa, at8, sat = _forms(h, kind, recipe, offs, rows=True, transposed=need_w2, dtype=e4m3)
            if w2_fp8 is None:
                w2_fp8, w2_scale, _, _ = quantize_weight(w2, recipe, copies="forward")
            y = grouped_mm(a8, w2_fp8, offs, scale_x=sa, scale_w=w2_scale)
            del a8, sa, w2_fp8, w2_scale
            saved = (xt8, sxt, h if need_da else None, at8, sat, w1t_fp8, w1t_scale, w2t_fp8, w2t_scale)
        if b2 is not None:
            y = _add_bias(y, b2, experts)
        regather = source if gather and save_input and recipe == "block" else None
        ctx.save_for_backward(offs, w1, w2, b1, b2, experts, token_rows if gather else None, regather, *saved)
        ctx.k = k
        ctx.kind, ctx.recipe, ctx.grad_dtype, ctx.fuse_wgrad = kind, recipe, grad_dtype, fuse_wgrad
        ctx.need, ctx.save_input = (need_dx, need_w1, need_w2, need_b1), save_input
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        offs, w1, w2, b1, b2, experts, token_rows, regather, *saved = ctx.saved_tensors
        need_dx, need_w1, need_w2, need_b1 = ctx.need
        need_da = need_dx or need_w1 or need_b1
        need_db2 = b2 is not None and ctx.needs_input_grad[5]
        dy = grad.contiguous().to(torch.bfloat16)
        dx = dw1 = dw2 = db1 = db2 = dh = None
        if need_db2:
            db2 = _bias_grad(dy, experts, b2)
        if ctx.recipe is None:
            x, h, a = saved
            if need_w2:
                dw2 = _weight_grad(w2, ctx.fuse_wgrad, dy, a, offs)
            _release(a)
            if need_da:
                da = grouped_mm(dy, w2, offs, trans_w=False)
                dh = activation(h, ctx.kind, dy=da).y
            _release(h)
            if need_dx:
                dx = grouped_mm(dh, w1, offs, trans_w=False)
            if need_w1:
                dw1 = _weight_grad(w1, ctx.fuse_wgrad, dh, x, offs)
        else:
            xt8, sxt, h, at8, sat, w1t8, sw1t, w2t8, sw2t = saved
            recipe, gd = ctx.recipe, ctx.grad_dtype
            _, dy8, sdy, dyt8, sdyt = _forms(dy, "identity", recipe, offs, rows=need_da, transposed=need_w2, dtype=gd)
            del dy
            if need_w2:
                dw2 = _weight_grad(w2, ctx.fuse_wgrad, dyt8, at8, offs, scale_dy=sdyt, scale_x=sat)
            del dyt8, sdyt
            _release(at8, sat)
            if need_da:
                if w2t8 is None:
                    _, _, w2t8, sw2t = quantize_weight(w2, recipe, copies="dgrad")
                # da_g = dy_g @ w2_g: the K-major operand is the transposed copy (G, ffn, hidden).
                da = grouped_mm(dy8, w2t8.transpose(1, 2), offs, scale_x=sdy, scale_w=sw2t, trans_w=False)
                del dy8, sdy, w2t8, sw2t
                dh, dh8, sdh, dht8, sdht = _forms(h, ctx.kind, recipe, offs, rows=need_dx, transposed=need_w1,
                                                  dtype=gd, dy=da, bf16=need_b1)
                del da
            _release(h)
            if need_dx:
                if w1t8 is None:
                    _, _, w1t8, sw1t = quantize_weight(w1, recipe, copies="dgrad")
                dx = grouped_mm(dh8, w1t8.transpose(1, 2), offs, scale_x=sdh, scale_w=sw1t, trans_w=False)
                del dh8, sdh, w1t8, sw1t
            if need_w1:
                if ctx.save_input:  # xt8 holds x: its transposed copy now, after dx freed the dgrad's operands
                    _, _, _, xt8, sxt = _forms(xt8, "identity", recipe, offs, rows=False, transposed=True,
                                               dtype=torch.float8_e4m3fn, source=regather)
                dw1 = _weight_grad(w1, ctx.fuse_wgrad, dht8, xt8, offs, scale_dy=sdht, scale_x=sxt)
        if need_b1:
            db1 = _bias_grad(dh, experts, b1)
        if dx is not None and token_rows is not None:  # the gather's backward: each token's rows summed
            dx = _summed_rows(dx, token_rows, ctx.k)
        return (dx, None, dw1, dw2, db1, db2) + (None,) * 16


def _check_layer(op, x, offs, w1, w2, b1, b2, kind, fp8, grad_dtype):
    if kind not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {kind!r}")
    if fp8 is not None and fp8 not in FP8_RECIPES:
        raise ValueError(f"{op}: fp8 must be None or one of {FP8_RECIPES}, got {fp8!r}")
    if grad_dtype not in FP8_MAX:
        raise ValueError(f"{op}: fp8_grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {grad_dtype}")
    for name, t in (("x", x), ("offs", offs), ("fc1_weight", w1), ("fc2_weight", w2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"{op}: x must be a 2-D bfloat16 (T, hidden) tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if w1.dim() != 3 or w2.dim() != 3 or w1.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        raise ValueError(f"{op}: fc1_weight and fc2_weight must be 3-D bfloat16, got {w1.dtype} "
                         f"{tuple(w1.shape)} and {w2.dtype} {tuple(w2.shape)}")
    g, hidden = w2.shape[0], w2.shape[1]
    ffn = w2.shape[2]
    width = 2 * ffn if kind == "swiglu" else ffn
    if tuple(w1.shape) != (g, width, hidden):
        raise ValueError(f"{op}: fc1_weight must be (G, {'2 * ffn' if kind == 'swiglu' else 'ffn'}, hidden) = "
                         f"{(g, width, hidden)} for fc2_weight {tuple(w2.shape)} ({kind}), got {tuple(w1.shape)}")
    if x.shape[1] != hidden:
        raise ValueError(f"{op}: x must have hidden = {hidden} columns (fc2_weight {tuple(w2.shape)}), got {x.shape[1]}")
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() != g:
        raise ValueError(f"{op}: offs must be a 1-D int32 tensor of {g} cumulative expert ends, got {offs.dtype} "
                         f"of shape {tuple(offs.shape)}")
    for name, t in (("offs", offs), ("fc1_weight", w1), ("fc2_weight", w2)):
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    for name, b, n in (("fc1_bias", b1, width), ("fc2_bias", b2, hidden)):
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (g, n) or b.device != x.device
                              or not b.dtype.is_floating_point):
            got = f"{b.dtype} {tuple(b.shape)} on {b.device}" if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"{op}: {name} must be a floating-point ({g}, {n}) tensor on {x.device}, got {got}")


def _check_fp8_weights(op, fp8_weights, fp8, w1, w2) -> tuple:
    """fp8_weights as _GroupedMLP takes them (eight entries), once each is seen to be the
    quantize_weight result of its weight in the layer's recipe (e4m3 copies, their scales)."""
    if fp8 is None:
        raise ValueError(f"{op}: fp8_weights needs fp8='block' or 'row' (the layer runs in bf16 without it)")
    if not isinstance(fp8_weights, (tuple, list)) or len(fp8_weights) != 2:
        raise ValueError(f"{op}: fp8_weights must be (fc1's, fc2's) quantize_weight results, got "
                         f"{type(fp8_weights).__name__}")
    out = []
    for i, (copies, w) in enumerate(zip(fp8_weights, (w1, w2))):
        name = f"fp8_weights[{i}]"
        if not isinstance(copies, (tuple, list)) or len(copies) != 4:
            raise ValueError(f"{op}: {name} must be quantize_weight's (w_fp8, scale, wt_fp8, scale_t), got "
                             f"{type(copies).__name__}")
        g, n, k = w.shape
        blocks = (g, -(-n // BLOCK), -(-k // BLOCK))
        scales = (blocks, blocks) if fp8 == "block" else ((g, n), (g, k))
        for j, want in ((0, (g, n, k)), (2, (g, k, n))):
            t, scale = copies[j], copies[j + 1]
            if t is None:
                continue
            if (not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn or tuple(t.shape) != want
                    or t.device != w.device):
                raise ValueError(f"{op}: {name}[{j}] must be a float8_e4m3fn tensor of shape {want} on {w.device} "
                                 f"(its weight's {'copy' if j == 0 else 'transposed copy'}), got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
                                 f"{f' on {t.device}' if isinstance(t, torch.Tensor) else ''}")
            want = scales[j // 2]
            if (not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32
                    or tuple(scale.shape) != want or scale.device != t.device):
                raise ValueError(f"{op}: {name}[{j + 1}] must be the float32 scales {want} of quantize_weight(w, "
                                 f"{fp8!r}) on {t.device}, got {getattr(scale, 'dtype', type(scale).__name__)} "
                                 f"{tuple(getattr(scale, 'shape', ()))}")
        if copies[0] is None:
            raise ValueError(f"{op}: {name} has no forward copy (quantize_weight(..., copies='both'))")
        out.extend(copies)
    return tuple(out)


def grouped_mlp(x: torch.Tensor, offs: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, *,
                activation: str = "swiglu", fc1_bias: Optional[torch.Tensor] = None,
                fc2_bias: Optional[torch.Tensor] = None, fp8: Optional[str] = None,
                fp8_grad_dtype: torch.dtype = torch.float8_e4m3fn, fuse_wgrad_accumulation: bool = False,
                fp8_weights: Optional[Tuple[tuple, tuple]] = None, routing: Optional["Routing"] = None,
                save_original_input: bool = False) -> torch.Tensor:
    """Every expert's MLP on its rows of x (T, hidden), grouped by expert with ``offs`` (int32
    cumulative expert ends on x's device, read on the GPU only):
    ``y_g = act(x_g @ fc1_weight[g].T + fc1_bias[g]) @ fc2_weight[g].T + fc2_bias[g]``.
    Rows past ``offs[-1]`` belong to no expert: as in :func:`distgemm.grouped_mm`, their rows of
    y and of x's gradient are not written (nor do they reach any gradient of the parameters).

    fc1_weight (G, 2 * ffn, hidden) for SwiGLU (gate rows first, then up), (G, ffn, hidden) for
    GELU; fc2_weight (G, hidden, ffn). ``fp8="block"`` (1 x 128 activations and gradients,
    128 x 128 weights, DeepSeek-V3) or ``"row"`` runs the six GEMMs in FP8 (sm_90);
    ``fp8_weights`` (each of fc1's and fc2's :func:`quantize_weight` result, in the recipe ``fp8``
    and the default float8_e4m3fn) reuses copies the caller made; otherwise the forward's copies
    are made in the forward and the dgrad's in the backward (so that they are never alive
    together). With
    ``fuse_wgrad_accumulation`` the weight gradients are added into ``weight.main_grad`` (FP32).
    ``save_original_input`` (FP8): the backward keeps x rather than its FP8 transposed copy
    (half x's bytes) and makes that copy when fc1's weight gradient needs it (one more read of
    x): less memory where the caller keeps x anyway, more where x could have been freed. The
    backward frees the saved activations as it goes (unless ``retain_graph=True`` keeps them).

    ``routing`` (:func:`route`'s; ``offs`` then routing.offs): x holds the tokens (T, hidden) and
    the layer's rows are x's in routing's order, gathered as they are read: with ``fp8="block"``
    by the pass that quantizes them (no permuted copy is made), otherwise by a gather of its own.
    Returns the (T * k, hidden) rows in expert order, as with permuted x; the gradient of x sums
    each token's rows."""
    op = "distgemm.moe.grouped_mlp"
    check_flags(op, fuse_wgrad_accumulation=fuse_wgrad_accumulation, save_original_input=save_original_input)
    _check_layer(op, x, offs, fc1_weight, fc2_weight, fc1_bias, fc2_bias, activation, fp8, fp8_grad_dtype)
    rows = x.shape[0]
    if routing is not None:
        rows = _check_layer_routing(op, x, offs, routing)
    check_offs_values(op, offs, rows, "rows of the layer")
    if fuse_wgrad_accumulation and torch.is_grad_enabled():
        for name, w in (("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
            if w.requires_grad:
                check_main_grad(op, name, w)
    if rows == 0:  # no rows: nothing to compute; zero gradients
        return _NoRows.apply(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, fuse_wgrad_accumulation)
    copies = (None,) * 8
    if fp8_weights is not None:
        copies = _check_fp8_weights(op, fp8_weights, fp8, fc1_weight, fc2_weight)
    gather = (None, None, 1) if routing is None else (routing.source, routing.token_rows, routing.k)
    if not torch.is_grad_enabled():  # needs_input_grad says True under no_grad too: nothing to make for a backward
        x, fc1_weight, fc2_weight, fc1_bias, fc2_bias = _detached(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias)
    return _GroupedMLP.apply(x, offs, fc1_weight, fc2_weight, fc1_bias, fc2_bias, *copies, activation, fp8,
                             fp8_grad_dtype, fuse_wgrad_accumulation, *gather, save_original_input and fp8 is not None)


def _detached(*tensors):
    """The tensors (or None) without autograd history: what a Function takes outside grad mode."""
    return tuple(t if t is None else t.detach() for t in tensors)


def _check_layer_routing(op, x, offs, routing) -> int:
    """The layer's row count, once routing is seen to be route()'s for x's tokens."""
    if not isinstance(routing, Routing):
        raise TypeError(f"{op}: routing must be distgemm.moe.route's Routing, got {type(routing).__name__}")
    rows = routing.source.numel()
    if routing.k < 1:
        raise ValueError(f"{op}: routing must route each token to k >= 1 experts, got k={routing.k}")
    if rows != x.shape[0] * routing.k or routing.token_rows.numel() != rows:
        raise ValueError(f"{op}: routing is for {rows // max(routing.k, 1)} tokens x k={routing.k}, but x has "
                         f"{x.shape[0]} tokens")
    if offs is not routing.offs:
        if offs.shape != routing.offs.shape or offs.device != routing.offs.device:
            raise ValueError(f"{op}: with routing, offs must be routing.offs")
        # Its values, where the host reads them for free (as check_offs_values does).
        host = offs.device.type == "cpu" or (offs.device.type != "meta" and _settings.current().debug)
        if host and not torch.compiler.is_compiling() and not torch.equal(offs, routing.offs):
            raise ValueError(f"{op}: with routing, offs must be routing.offs (its values "
                             f"{_preview(routing.offs.tolist())}), got {_preview(offs.tolist())}")
    if routing.source.device != x.device:
        raise ValueError(f"{op}: routing is on {routing.source.device} but x is on {x.device}")
    return rows


# ---------------------------------------------------------------- op registration


@torch.library.register_fake("distgemm::moe_act")
def _moe_act_fake(x, dy, act, inner, offs, want_y, want_fp8, want_t, fp8_dtype, rows=None):
    tokens = x.shape[0] if rows is None else rows.shape[0]
    y_cols = 2 * inner if act == SWIGLU_BACKWARD else inner
    f32 = dict(dtype=torch.float32, device=x.device)
    blocks = (y_cols + BLOCK - 1) // BLOCK
    y = x.new_empty((tokens, y_cols) if want_y else (0,))
    y8 = x.new_empty((tokens, y_cols) if want_fp8 else (0,), dtype=fp8_dtype)
    sy = torch.empty_strided((tokens, blocks), (1, tokens), **f32) if want_fp8 else torch.empty((0,), **f32)
    if want_t:
        row_blocks = (tokens + BLOCK - 1) // BLOCK + offs.shape[0]
        yt8 = x.new_empty((y_cols, BLOCK * row_blocks), dtype=fp8_dtype)
        syt = torch.empty_strided((y_cols, row_blocks), (1, y_cols), **f32)
    else:
        yt8, syt = x.new_empty((0,), dtype=fp8_dtype), torch.empty((0,), **f32)
    return y, y8, sy, yt8, syt


@torch.library.register_fake("distgemm::quantize_fp8_weight")
def _quantize_fp8_weight_fake(w, dtype, want_out, want_t):
    g, r, c = w.shape
    scale = torch.empty((g, (r + BLOCK - 1) // BLOCK, (c + BLOCK - 1) // BLOCK), dtype=torch.float32, device=w.device)
    return (w.new_empty((g, r, c) if want_out else (0,), dtype=dtype),
            w.new_empty((g, c, r) if want_t else (0,), dtype=dtype), scale)


@torch.library.register_fake("distgemm::quantize_fp8_weight_rows")
def _quantize_fp8_weight_rows_fake(w, dtype, want_out, want_t):
    g, r, c = w.shape
    f32 = dict(dtype=torch.float32, device=w.device)
    return (w.new_empty((g, r, c) if want_out else (0,), dtype=dtype), torch.empty((g, r) if want_out else (0,), **f32),
            w.new_empty((g, c, r) if want_t else (0,), dtype=dtype), torch.empty((g, c) if want_t else (0,), **f32))


@torch.library.register_fake("distgemm::moe_combine")
def _moe_combine_fake(y, rows, weights, tokens, k):
    return y.new_empty((tokens, y.shape[1]))


@torch.library.register_fake("distgemm::moe_combine_backward")
def _moe_combine_backward_fake(dy, y, rows, weights, num_rows, tokens, k, want_dweights):
    return dy.new_empty((num_rows, dy.shape[1])), dy.new_empty((tokens * k if want_dweights else 0,),
                                                               dtype=torch.float32)


# ---------------------------------------------------------------- routing: permute, unpermute


class Permuted(NamedTuple):
    """What :func:`permute` returns. bf16/fp16/fp32 ``rows``; with ``fp8`` the FP8 rows and their
    scales instead (``rows`` None)."""
    rows: Optional[torch.Tensor]   # (T * k, hidden): the routed copies of the tokens, grouped by expert
    offs: torch.Tensor             # (num_experts,) int32 cumulative expert ends, on the device
    row_map: torch.Tensor          # (T * k,) int64: row p of ``rows`` is slot row_map[p] of topk_ids.reshape(-1)
    rows_fp8: Optional[torch.Tensor] = None  # (T * k, hidden) float8_e4m3fn
    scale: Optional[torch.Tensor] = None     # 1 x 128: (T * k, ceil(hidden/128)), strides (1, T * k); row: (T * k,)


class Routing(NamedTuple):
    """Where each routed copy goes (:func:`route`): what permute, unpermute and the layer with
    its gather (``grouped_mlp(..., routing=)``) read."""
    offs: torch.Tensor        # (num_experts,) int32 cumulative expert ends, on the device
    row_map: torch.Tensor     # (T * k,) int64: row p holds slot row_map[p] of topk_ids.reshape(-1)
    source: torch.Tensor      # (T * k,) int64: the token row p reads; -1 for a copy the router dropped
    token_rows: torch.Tensor  # (T * k,) int64: the row of each slot (t, j); -1 - p where it was dropped
    k: int


def _check_routing(op, topk_ids, tokens, num_experts):
    """topk_ids a (tokens, k) int tensor (tokens None: any) of ids in [-1, num_experts), the
    values checked on CPU only."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        got = (f"{topk_ids.dtype} of shape {tuple(topk_ids.shape)}" if isinstance(topk_ids, torch.Tensor)
               else type(topk_ids).__name__)
        raise ValueError(f"{op}: topk_ids must be a 2-D (T, k) int32 or int64 tensor, got {got}")
    if tokens is not None and topk_ids.shape[0] != tokens:
        raise ValueError(f"{op}: topk_ids must have one row per token ({tokens}), got {topk_ids.shape[0]}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or not 1 <= num_experts < 2 ** 31:
        raise ValueError(f"{op}: num_experts must be an int in [1, 2^31) (int32 offs), got {num_experts!r}")
    if topk_ids.numel() >= 2 ** 31:
        raise ValueError(f"{op}: T * k = {topk_ids.numel()} routed copies must be fewer than 2^31 (int32 offs)")
    # not CUDA (a host sync), nor meta (no values), nor under torch.compile (data-dependent)
    host = topk_ids.device.type == "cpu" and not torch.compiler.is_compiling()
    if host and topk_ids.numel() and (int(topk_ids.min()) < -1 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"{op}: topk_ids must be expert indices in [0, {num_experts}) or -1 (dropped), got "
                         f"values in [{int(topk_ids.min())}, {int(topk_ids.max())}]")


def route(topk_ids: torch.Tensor, num_experts: int) -> Routing:
    """Where each token's copies go (``topk_ids`` (T, k); -1: dropped by the router): expert g's
    rows at ``[offs[g-1], offs[g])``, in token order within an expert, the dropped copies after
    ``offs[-1]``. No host synchronisation. On CUDA, ids outside [-1, num_experts) are not checked
    (they would need a host sync): they count as dropped."""
    op = "distgemm.moe.route"
    _check_routing(op, topk_ids, None, num_experts)
    return _route(topk_ids, num_experts)


def _route(topk_ids: torch.Tensor, num_experts: int) -> Routing:
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    valid = (ids >= 0) & (ids < num_experts)
    key = torch.where(valid, ids, torch.full_like(ids, num_experts))
    row_map = torch.sort(key.int(), stable=True).indices  # int32 keys: half the radix passes of int64
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key, torch.ones_like(key))
    offs = counts[:num_experts].cumsum(0).to(torch.int32)
    kept = valid.index_select(0, row_map)
    source = torch.where(kept, torch.div(row_map, k, rounding_mode="floor"), -1)
    return Routing(offs, row_map, source, _kept_slot_rows(row_map, valid), k)


def permute(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *, fp8: Optional[str] = None) -> Permuted:
    """Each token's copies for its k experts (``topk_ids`` (T, k); -1: dropped by the router),
    gathered into expert order (see :func:`route`): ``rows`` (T * k, hidden), the dropped copies
    zero rows after ``offs[-1]``, which the grouped GEMMs leave alone. No host synchronisation
    (CUDA-graph safe with new routing on every replay); differentiable in x (the gather's
    backward adds each copy's gradient into its token). A token routed twice to one expert gets
    two rows.

    ``fp8="block"`` (bfloat16 x): the rows as float8_e4m3fn with one scale per 1 x 128, written
    by the gather itself (on sm_90, one read of x, no bf16 copy), the layout
    :func:`distgemm.grouped_mm` reads; ``"row"``: one scale per row (the bf16 rows are gathered,
    then quantized). Not differentiable."""
    op = "distgemm.moe.permute"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{op}: x must be a 2-D (T, hidden) tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if fp8 is not None and fp8 not in FP8_RECIPES:
        raise ValueError(f"{op}: fp8 must be None or one of {FP8_RECIPES}, got {fp8!r}")
    if fp8 is not None and x.dtype != torch.bfloat16:
        raise ValueError(f"{op}: fp8 permutes bfloat16 x, got {x.dtype}")
    _check_routing(op, topk_ids, x.shape[0], num_experts)
    if topk_ids.device != x.device:
        raise ValueError(f"{op}: topk_ids is on {topk_ids.device} but x is on {x.device}")
    routing = _route(topk_ids, num_experts)
    if fp8 == "block":
        out = activation(x.detach(), "identity", rows=routing.source, bf16=False, fp8_rows=True)
        return Permuted(None, routing.offs, routing.row_map, out.y_fp8, out.y_scale)
    if fp8 == "row":
        rows8, scale = quantize_fp8(_gathered(x.detach(), routing.source), "row")
        return Permuted(None, routing.offs, routing.row_map, rows8, scale)
    return Permuted(gather(x, routing), routing.offs, routing.row_map)


def gather(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """x's rows in the order ``routing`` gives (zeros for dropped copies); differentiable in x,
    whose gradient sums each token's kept rows in FP32."""
    op = "distgemm.moe.gather"
    if not isinstance(routing, Routing):
        raise TypeError(f"{op}: routing must be distgemm.moe.route's Routing, got {type(routing).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{op}: x must be a 2-D (T, hidden) tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if routing.k >= 1 and x.shape[0] * routing.k != routing.token_rows.numel():
        raise ValueError(f"{op}: x must have routing's {routing.token_rows.numel() // routing.k} token rows "
                         f"(k={routing.k}), got {x.shape[0]}")
    if routing.source.device != x.device:
        raise ValueError(f"{op}: routing is on {routing.source.device} but x is on {x.device}")
    if _routing_kernels(x):
        return _Gather.apply(x, routing.source, routing.token_rows, routing.k)
    return _GatherReference.apply(x, routing.source, routing.token_rows, routing.k)


def _gathered_rows(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """x[source] outside autograd: the routing kernel, else plain PyTorch."""
    if _routing_kernels(x):
        return ops.moe_combine(x, source, None, source.numel(), 1)
    return _gathered(x, source)


def _summed_rows(rows: torch.Tensor, token_rows: torch.Tensor, k: int) -> torch.Tensor:
    """The gather's backward outside autograd: each token's kept rows summed in FP32."""
    if _routing_kernels(rows):
        return ops.moe_combine(rows.contiguous(), token_rows, None, token_rows.numel() // k, k)
    return _summed(rows, token_rows, k)


def _gathered(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """x[source] in plain PyTorch: zeros where source < 0, NaN where source >= T (the kernels'
    rule for bad input)."""
    n = x.shape[0]
    safe = source.clamp(0, max(n - 1, 0))
    rows = x.index_select(0, safe) if n else x.new_zeros((source.numel(), x.shape[1]))
    rows = torch.where((source < 0).unsqueeze(1), rows.new_zeros(()), rows)
    if x.dtype.is_floating_point:
        rows = torch.where((source >= n).unsqueeze(1), rows.new_full((), float("nan")), rows)
    return rows


def _summed(rows: torch.Tensor, token_rows: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's kept rows summed in FP32 and rounded once (the gather's backward), in plain
    PyTorch: slot rows < 0 add nothing."""
    tokens = token_rows.numel() // k
    take = token_rows.clamp(min=0, max=max(rows.shape[0] - 1, 0))
    per_slot = rows.index_select(0, take).view(tokens, k, rows.shape[1]).float() if rows.shape[0] else \
        rows.new_zeros((tokens, k, rows.shape[1]), dtype=torch.float32)
    per_slot = torch.where((token_rows >= 0).view(tokens, k, 1), per_slot, per_slot.new_zeros(()))
    return per_slot.sum(1).to(rows.dtype)


class _GatherReference(torch.autograd.Function):
    """_Gather in plain PyTorch (CPU tensors, GPUs without the kernels)."""

    @staticmethod
    def forward(ctx, x, source, token_rows, k):
        ctx.save_for_backward(token_rows)
        ctx.k, ctx.tokens = k, x.shape[0]
        return _gathered(x, source)

    @staticmethod
    def backward(ctx, grad):
        (token_rows,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if ctx.k == 0:  # no copies: no token reaches a row
            return grad.new_zeros((ctx.tokens, grad.shape[1])), None, None, None
        return _summed(grad, token_rows, ctx.k), None, None, None


def _check_row_map(op: str, row_map: torch.Tensor) -> None:
    """row_map a permutation of [0, T * k) (permute's), checked on the host where that is free:
    CPU tensors always, GPU ones with the debug setting (a device sync). Elsewhere a malformed
    one gives unspecified rows, read and written in bounds."""
    if torch.compiler.is_compiling() or row_map.device.type == "meta":
        return
    if row_map.device.type != "cpu" and not _settings.current().debug:
        return
    n = row_map.numel()
    if n and not torch.equal(torch.sort(row_map.long()).values.cpu(), torch.arange(n)):
        raise ValueError(f"{op}: row_map must be a permutation of [0, {n}) (permute's row map), got values in "
                         f"[{int(row_map.min())}, {int(row_map.max())}]"
                         + (" with repeats" if int(row_map.min()) >= 0 and int(row_map.max()) < n else ""))


def _slot_rows(row_map: torch.Tensor) -> torch.Tensor:
    """The row of each (token, slot): row_map's inverse (int64). A slot no row names (a row_map
    that is not a permutation; entries out of range are ignored) gets -1 - n, n = T * k."""
    n = row_map.numel()
    rows = row_map.long()
    target = torch.where((rows >= 0) & (rows < n), rows, n)
    slot_row = torch.full((n + 1,), -1 - n, dtype=torch.int64, device=row_map.device)
    return slot_row.scatter_(0, target, torch.arange(n, device=row_map.device))[:n]


def _routing_kernels(t: torch.Tensor) -> bool:
    """Whether the routing kernels take tensors on t's device (else the torch ops below)."""
    return t.is_cuda and has_kernels(t.device) and t.dtype in (torch.bfloat16, torch.float16, torch.float32)


def _kept_slot_rows(row_map: torch.Tensor, kept: Optional[torch.Tensor]) -> torch.Tensor:
    """The routing kernels' rows of each slot: its row p (_slot_rows), -1 - p for a slot not
    kept (a dropped copy: the backward zeros row p), and -1 - n for a slot no row names (nothing
    is read or written for it)."""
    slot_row = _slot_rows(row_map)
    if kept is None:
        return slot_row
    return torch.where(kept & (slot_row >= 0), slot_row, torch.where(slot_row >= 0, -1 - slot_row, slot_row))


class _Gather(torch.autograd.Function):
    """rows[p] = x[source[p]] (zeros where source < 0); backward: each token's kept rows summed
    in FP32 (the combine without weights), rounded once."""

    @staticmethod
    def forward(ctx, x, source, slot_rows, k):
        ctx.save_for_backward(slot_rows)
        ctx.k, ctx.tokens = k, x.shape[0]
        return ops.moe_combine(x, source, None, source.numel(), 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (slot_rows,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        k = ctx.k
        if k == 0:  # no copies: no token reaches a row
            return grad.new_zeros((ctx.tokens, grad.shape[1])), None, None, None
        return ops.moe_combine(grad.contiguous(), slot_rows, None, slot_rows.numel() // k, k), None, None, None


class _Combine(torch.autograd.Function):
    """out[t] = sum_j weights[t, j] * y[slot_rows[t, j]] in FP32 (slot rows < 0 skipped)."""

    @staticmethod
    def forward(ctx, y, slot_rows, weights, tokens, k):
        w32 = weights.reshape(-1).float().contiguous()
        # y is read by the weights' gradient only: not kept alive without it (T * k rows).
        ctx.save_for_backward(y if ctx.needs_input_grad[2] else None, slot_rows, w32)
        ctx.num_rows = y.shape[0]
        ctx.shape, ctx.w_dtype = (tokens, k), weights.dtype
        return ops.moe_combine(y, slot_rows, w32, tokens, k)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        y, slot_rows, w32 = ctx.saved_tensors
        tokens, k = ctx.shape
        need_y, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        if not (need_y or need_w):
            return None, None, None, None, None
        dy_rows, dw = ops.moe_combine_backward(grad.contiguous(), y if need_w else None, slot_rows, w32, ctx.num_rows,
                                               tokens, k, need_w)
        return (dy_rows if need_y else None, None, dw.view(tokens, k).to(ctx.w_dtype) if need_w else None,
                None, None)


def unpermute(y: torch.Tensor, row_map: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: Optional[torch.Tensor] = None, num_experts: Optional[int] = None) -> torch.Tensor:
    """The inverse of :func:`permute` with the router's combine: out[t] = sum_j topk_weights[t, j]
    * y[row of (t, j)], in FP32, returned in y's dtype. Copies dropped by the router (topk_ids
    -1, when ``topk_ids`` and ``num_experts`` are given) contribute nothing, whatever their rows
    hold. Differentiable in y and topk_weights. ``row_map`` must be permute's (a permutation of
    [0, T * k)): checked on CPU tensors, and on GPU ones with ``distgemm.settings(debug=True)``
    (a device sync); otherwise a malformed one gives unspecified rows, read in bounds."""
    op = "distgemm.moe.unpermute"
    if (not isinstance(topk_weights, torch.Tensor) or topk_weights.dim() != 2
            or not topk_weights.dtype.is_floating_point):
        raise ValueError(f"{op}: topk_weights must be a 2-D (T, k) floating-point tensor, got "
                         f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)} of shape "
                         f"{tuple(getattr(topk_weights, 'shape', ()))}")
    tokens, k = topk_weights.shape
    if isinstance(topk_ids, torch.Tensor) and tuple(topk_ids.shape) != (tokens, k):
        raise ValueError(f"{op}: topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got {(tokens, k)}")
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[0] != tokens * k:
        raise ValueError(f"{op}: y must be (T * k, hidden) = ({tokens * k}, ...) for topk_weights {(tokens, k)}, got "
                         f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
    if not y.dtype.is_floating_point:
        raise ValueError(f"{op}: y must be a floating-point tensor (the weighted sum is returned in its dtype), "
                         f"got {y.dtype}")
    if (not isinstance(row_map, torch.Tensor) or tuple(row_map.shape) != (tokens * k,)
            or row_map.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{op}: row_map must be permute's (T * k,) = ({tokens * k},) int64 row map, got "
                         f"{getattr(row_map, 'dtype', type(row_map).__name__)} of shape "
                         f"{tuple(getattr(row_map, 'shape', ()))}")
    for name, t in (("row_map", row_map), ("topk_weights", topk_weights)):
        if t.device != y.device:
            raise ValueError(f"{op}: {name} is on {t.device} but y is on {y.device}")
    _check_row_map(op, row_map)
    kept = None
    if topk_ids is None and num_experts is not None:
        raise ValueError(f"{op}: num_experts (got {num_experts!r}) masks the dropped copies with topk_ids; "
                         "topk_ids is None")
    if topk_ids is not None:
        _check_routing(op, topk_ids, tokens, num_experts)
        if topk_ids.device != y.device:
            raise ValueError(f"{op}: topk_ids is on {topk_ids.device} but y is on {y.device}")
        kept = (topk_ids >= 0) & (topk_ids < num_experts)
    if _routing_kernels(y) and k >= 1:  # k = 0 (nothing to sum) takes the torch ops: the kernel needs k >= 1
        return _Combine.apply(y, _kept_slot_rows(row_map, None if kept is None else kept.reshape(-1)),
                              topk_weights, tokens, k)
    # Row of each (token, slot): the inverse of row_map (clamped in bounds for a malformed one).
    slot_row = _slot_rows(row_map).clamp(min=0)
    per_slot = y.index_select(0, slot_row).view(tokens, k, y.shape[1]).float()
    weights = topk_weights.float()
    if kept is not None:
        per_slot = torch.where(kept.unsqueeze(-1), per_slot, per_slot.new_zeros(()))
        weights = torch.where(kept, weights, weights.new_zeros(()))
    return (per_slot * weights.unsqueeze(-1)).sum(1).to(y.dtype)
