"""torch.nn modules over distgemm's ops."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .grouped import grouped_mm, grouped_mm_wgrad
from .quantize import quantize_fp8


def _expert_of_rows(offs: torch.Tensor, tokens: int) -> torch.Tensor:
    """Index of the expert owning each row, on the device (no host sync)."""
    rows = torch.arange(tokens, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, rows, right=True).clamp_(max=offs.numel() - 1)


class _GroupedLinearMainGrad(torch.autograd.Function):
    """Forward as distgemm.grouped_mm; backward adds the weight gradient into
    weight.main_grad (FP32) in the wgrad kernel itself, as Megatron-LM / TransformerEngine
    expect with fused wgrad accumulation."""

    @staticmethod
    def forward(ctx, x, weight, offs):
        ctx.save_for_backward(x, weight, offs)
        return grouped_mm(x, weight, offs)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offs = ctx.saved_tensors
        grad = grad.contiguous()
        dx = grouped_mm(grad, weight, offs, trans_w=False) if ctx.needs_input_grad[0] else None
        grouped_mm_wgrad(grad, x, offs, out=weight.main_grad, accumulate=True)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            return dx, make(weight.shape, dtype=weight.dtype, device=weight.device), None
        return dx, None, None


FP8_RECIPES = ("block", "row")


class _FP8Weight:
    """A weight's FP8 copies, requantized when the weight changes (its version counter):
    (G, N, K) for the forward and, for the dgrad, the same values stored (G, K, N)."""

    def __init__(self, recipe: str):
        self.recipe, self.key, self.copies = recipe, None, None

    def get(self, weight: torch.Tensor):
        key = (weight.data_ptr(), weight._version, weight.shape)
        if key != self.key:
            w = weight.detach()
            if self.recipe == "block":
                # 128 x 128 blocks: the transposed copy holds the same blocks, the same scales.
                w8, sw = quantize_fp8(w, (128, 128))
                self.copies = (w8, sw, w8.transpose(1, 2).contiguous(), sw)
            else:
                g, n, k = w.shape
                w8, sw = quantize_fp8(w.reshape(g * n, k), "row")
                wt8, swt = quantize_fp8(w.transpose(1, 2).reshape(g * k, n), "row")
                self.copies = (w8.view(g, n, k), sw.view(g, n), wt8.view(g, k, n), swt.view(g, k))
            self.key = key
        return self.copies


def _quantize_rows(t: torch.Tensor, recipe: str, dtype: torch.dtype = torch.float8_e4m3fn):
    return quantize_fp8(t, (1, 128) if recipe == "block" else "row", dtype=dtype)


class _GroupedLinearFP8(torch.autograd.Function):
    """FP8 forward, dgrad and wgrad of GroupedLinear: inputs and output gradients quantized
    on the fly (1 x 128 tiles, or rows), weights from the cached FP8 copies, the wgrad from
    both quantized per 128 tokens of each expert into FP32 (weight.main_grad with fused
    accumulation). `grad_dtype`: what the output gradients are quantized to (e4m3, or e5m2 for
    its range)."""

    @staticmethod
    def forward(ctx, x, weight, offs, cache, fuse_wgrad, grad_dtype):
        w8, sw, _, _ = cache.get(weight)
        x8, sx = _quantize_rows(x, cache.recipe)
        ctx.save_for_backward(x, weight, offs)
        ctx.cache, ctx.fuse_wgrad, ctx.grad_dtype = cache, fuse_wgrad, grad_dtype
        return grouped_mm(x8, w8, offs, scale_x=sx, scale_w=sw)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offs = ctx.saved_tensors
        grad = grad.contiguous().to(x.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            _, _, wt8, swt = ctx.cache.get(weight)
            g8, sg = _quantize_rows(grad, ctx.cache.recipe, ctx.grad_dtype)
            # dx_g = dy_g @ w_g: the K-major operand is the transposed copy (G, K, N).
            dx = grouped_mm(g8, wt8.transpose(1, 2), offs, scale_x=sg, scale_w=swt, trans_w=False)
        if ctx.needs_input_grad[1]:
            dy_t, sdy = quantize_fp8(grad, (1, 128), dtype=ctx.grad_dtype, transpose=True, offs=offs)
            x_t, sx = quantize_fp8(x, (1, 128), transpose=True, offs=offs)
            if ctx.fuse_wgrad:
                grouped_mm_wgrad(dy_t, x_t, offs, scale_dy=sdy, scale_x=sx, out=weight.main_grad,
                                 accumulate=True)
                if hasattr(weight, "grad_added_to_main_grad"):
                    weight.grad_added_to_main_grad = True
                    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
                    dw = make(weight.shape, dtype=weight.dtype, device=weight.device)
            else:
                dw = grouped_mm_wgrad(dy_t, x_t, offs, scale_dy=sdy, scale_x=sx).to(weight.dtype)
        return dx, dw, None, None, None, None


class GroupedLinear(nn.Module):
    """``num_experts`` linear layers applied to their own rows of one input in one launch.

    forward(x, offs): x (T, in_features) grouped by expert, offs (num_experts,) int32
    cumulative row ends on x's device; returns (T, out_features). With
    ``fuse_wgrad_accumulation=True`` the backward adds the weight gradient into
    ``weight.main_grad`` (an FP32 tensor the training framework allocates) instead of
    producing ``weight.grad``.

    ``fp8="block"`` (DeepSeek-V3: activations and gradients per 1 x 128 tile, weights per
    128 x 128 block) or ``fp8="row"`` (rows and output channels) runs the three GEMMs in FP8
    (sm_90): inputs quantized on the fly, the weight's FP8 copies cached until it changes, the
    wgrad from both operands quantized per 128 tokens of each expert, in FP32. The master
    weight stays in ``dtype``. ``fp8_grad_dtype=torch.float8_e5m2`` quantizes the output
    gradients to e5m2 (wider range, 2 mantissa bits; TransformerEngine's hybrid recipe)
    against the e4m3 weights and activations.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device=None,
                 fuse_wgrad_accumulation: bool = False, fp8: Optional[str] = None,
                 fp8_grad_dtype: torch.dtype = torch.float8_e4m3fn):
        super().__init__()
        if num_experts < 1 or in_features < 1 or out_features < 1:
            raise ValueError("GroupedLinear: num_experts, in_features and out_features must be >= 1")
        if fp8 is not None and fp8 not in FP8_RECIPES:
            raise ValueError(f"GroupedLinear: fp8 must be None or one of {FP8_RECIPES}, got {fp8!r}")
        if fp8_grad_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError("GroupedLinear: fp8_grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
                             f"got {fp8_grad_dtype}")
        self.fp8, self.fp8_grad_dtype = fp8, fp8_grad_dtype
        self._fp8_weight = _FP8Weight(fp8) if fp8 else None
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype,
                                               device=device))
        self.bias = (nn.Parameter(torch.empty(num_experts, out_features, dtype=dtype, device=device))
                     if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        fuse = self.fuse_wgrad_accumulation and torch.is_grad_enabled() and self.weight.requires_grad
        if fuse and getattr(self.weight, "main_grad", None) is None:
            raise RuntimeError("GroupedLinear(fuse_wgrad_accumulation=True) needs weight.main_grad: "
                               "an FP32 tensor of the weight's shape")
        if self.fp8:
            y = _GroupedLinearFP8.apply(x, self.weight, offs, self._fp8_weight, fuse, self.fp8_grad_dtype)
        elif fuse:
            y = _GroupedLinearMainGrad.apply(x, self.weight, offs)
        else:
            y = grouped_mm(x, self.weight, offs)
        if self.bias is not None:  # in FP32: the bias gradient sums every row of its expert
            y = (y.float() + self.bias.float()[_expert_of_rows(offs, x.shape[0])]).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, fp8={self.fp8}"
                + (f", fp8_grad_dtype={self.fp8_grad_dtype}" if self.fp8 else ""))


# ---------------------------------------------------------------- tensor parallelism


def _shard(total: int, group, what: str) -> int:
    world = group.size()
    if total % world:
        raise ValueError(f"{what}={total} must divide evenly by the tensor-parallel group size {world}")
    return total // world


def _init_parallel_linear(layer, in_features, out_features, bias, group, sequence_parallel, dtype,
                          device, split_out: bool) -> None:
    """This rank's shard of an nn.Linear(in_features, out_features): output features split
    (column-parallel, bias split too) or input features split (row-parallel, full bias)."""
    from .tp import _resolve

    layer.group = _resolve(group)
    layer.in_features, layer.out_features = in_features, out_features
    layer.sequence_parallel = sequence_parallel
    if split_out:
        rows = _shard(out_features, layer.group, "out_features")
        shape, bias_len = (rows, in_features), rows
    else:
        shape, bias_len = (out_features, _shard(in_features, layer.group, "in_features")), out_features
    layer.weight = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))
    layer.bias = nn.Parameter(torch.empty(bias_len, dtype=dtype, device=device)) if bias else None
    bound = 1.0 / math.sqrt(in_features)
    nn.init.uniform_(layer.weight, -bound, bound)
    if layer.bias is not None:
        nn.init.uniform_(layer.bias, -bound, bound)


class _CopyToParallel(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient (the input of a column-parallel layer
    without sequence parallelism is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """All-reduce forward (the partial sums of a row-parallel layer), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with the output features split over the
    tensor-parallel ``group``: this rank holds ``weight`` (out_features / P, in_features).

    With ``sequence_parallel=True`` the input is this rank's (S / P, in_features) rows and the
    all-gather runs under the GEMM (:func:`distgemm.all_gather_matmul`); the output is
    (S, out_features / P). Otherwise the input is the full (S, in_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 sequence_parallel: bool = True, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        _init_parallel_linear(self, in_features, out_features, bias, group, sequence_parallel, dtype,
                              device, split_out=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .dense import gemm
        from .tp import all_gather_matmul

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.sequence_parallel:
            y = all_gather_matmul(x2, self.weight, group=self.group, c=self.bias,
                                  beta=1.0 if self.bias is not None else 0.0)
            return y.reshape(-1, *shape[1:-1], y.shape[-1])
        x2 = _CopyToParallel.apply(x2, self.group)
        y = gemm(x2, self.weight, self.bias, beta=1.0 if self.bias is not None else 0.0)
        return y.reshape(*shape[:-1], y.shape[-1])


class RowParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with the input features split over the
    tensor-parallel ``group``: this rank holds ``weight`` (out_features, in_features / P).

    The input is this rank's (S, in_features / P) slice. With ``sequence_parallel=True`` the
    output is this rank's (S / P, out_features) rows, reduce-scattered under the GEMM
    (:func:`distgemm.matmul_reduce_scatter`); otherwise the full all-reduced output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 sequence_parallel: bool = True, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        _init_parallel_linear(self, in_features, out_features, bias, group, sequence_parallel, dtype,
                              device, split_out=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .dense import gemm
        from .tp import matmul_reduce_scatter

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        beta = 1.0 if self.bias is not None else 0.0
        if self.sequence_parallel:
            # Every rank adds the replicated bias to its own rows: its gradient is the sum over
            # all ranks' rows (all-reduced in backward, so bias.grad is complete on each rank).
            bias = None if self.bias is None else _CopyToParallel.apply(self.bias, self.group)
            y = matmul_reduce_scatter(x2, self.weight, group=self.group, c=bias, beta=beta)
            return y.reshape(-1, *shape[1:-1], y.shape[-1])
        y = _ReduceFromParallel.apply(gemm(x2, self.weight), self.group)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], y.shape[-1])
