"""torch.nn modules over distgemm's ops."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .grouped import grouped_mm, grouped_mm_wgrad


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


class GroupedLinear(nn.Module):
    """``num_experts`` linear layers applied to their own rows of one input in one launch.

    forward(x, offs): x (T, in_features) grouped by expert, offs (num_experts,) int32
    cumulative row ends on x's device; returns (T, out_features). With
    ``fuse_wgrad_accumulation=True`` the backward adds the weight gradient into
    ``weight.main_grad`` (an FP32 tensor the training framework allocates) instead of
    producing ``weight.grad``.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device=None,
                 fuse_wgrad_accumulation: bool = False):
        super().__init__()
        if num_experts < 1 or in_features < 1 or out_features < 1:
            raise ValueError("GroupedLinear: num_experts, in_features and out_features must be >= 1")
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
        if self.fuse_wgrad_accumulation and torch.is_grad_enabled() and self.weight.requires_grad:
            if getattr(self.weight, "main_grad", None) is None:
                raise RuntimeError("GroupedLinear(fuse_wgrad_accumulation=True) needs weight.main_grad: "
                                   "an FP32 tensor of the weight's shape")
            y = _GroupedLinearMainGrad.apply(x, self.weight, offs)
        else:
            y = grouped_mm(x, self.weight, offs)
        if self.bias is not None:
            y = y + self.bias[_expert_of_rows(offs, x.shape[0])]
        return y

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}")
