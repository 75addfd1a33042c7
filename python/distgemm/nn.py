"""torch.nn modules over distgemm's ops."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ._checks import check_flags, check_main_grad
from ._routing import check_offs_tensor, check_offs_values
from .grouped import grouped_mm
from .moe import (ACTIVATIONS, FP8_RECIPES, _check_routing, _detached, _expert_of_rows, _bias_of_rows, _forms, _route,
                  _weight_grad, grouped_mlp, quantize_weight, unpermute)


class _GroupedLinearMainGrad(torch.autograd.Function):
    """Forward as distgemm.grouped_mm; backward adds the weight gradient into
    weight.main_grad (FP32) in the wgrad kernel itself, as Megatron-LM / TransformerEngine
    expect with fused wgrad accumulation."""

    @staticmethod
    def forward(ctx, x, weight, offs):
        ctx.save_for_backward(x, weight, offs)
        return grouped_mm(x, weight, offs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, offs = ctx.saved_tensors
        grad = grad.contiguous()
        dx = grouped_mm(grad, weight, offs, trans_w=False) if ctx.needs_input_grad[0] else None
        return dx, _weight_grad(weight, True, grad, x, offs), None


def _check_sizes(op: str, **sizes) -> None:
    """Each size an int >= 1, or a ValueError naming it."""
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{op}: {name} must be an int >= 1, got {v!r}")


def _check_microbatch(op: str, is_first_microbatch) -> None:
    """is_first_microbatch None, True or False (checked whether or not the layer runs in FP8)."""
    if not (is_first_microbatch is None or isinstance(is_first_microbatch, bool)):
        raise ValueError(f"{op}: is_first_microbatch must be None, True or False, got {is_first_microbatch!r}")


class _FP8WeightCopies:
    """A weight's FP8 copies (forward, and stored transposed for the dgrad) kept across
    micro-batches on the caller's word (TransformerEngine's ``is_first_microbatch``): True
    makes them, False reuses them (the caller promises the weight has not changed), None keeps
    none. Never kept under CUDA-graph capture, so that a replay quantizes the weight as it is
    then. A version counter cannot tell: an update through ``weight.data`` leaves it as it was."""

    def __init__(self, recipe: str):
        self.recipe, self.key, self.copies = recipe, None, None

    def get(self, weight: torch.Tensor, is_first_microbatch: Optional[bool]):
        """Both copies, or None: the layer then makes each where it needs it (the forward's in
        the forward, the dgrad's in the backward), so that they are never alive together."""
        if not (is_first_microbatch is None or isinstance(is_first_microbatch, bool)):
            raise ValueError(f"is_first_microbatch must be None, True or False, got {is_first_microbatch!r}")
        capturing = weight.is_cuda and torch.cuda.is_current_stream_capturing()
        if is_first_microbatch is None or capturing:
            self.key = self.copies = None
            return None
        # Copies made in inference mode are inference tensors, which autograd cannot save: not reused outside it.
        key = (weight.data_ptr(), tuple(weight.shape), weight.dtype, torch.is_inference_mode_enabled())
        if is_first_microbatch or self.copies is None or self.key != key:
            self.key, self.copies = key, quantize_weight(weight, self.recipe)
        return self.copies


class _GroupedLinearFP8(torch.autograd.Function):
    """FP8 forward, dgrad and wgrad of GroupedLinear: x and the output gradient each quantized
    in one pass into the rows the next GEMM reads and the padded transpose the wgrad reads (the
    block recipe; the row recipe's full-row scales take a second read), the weight's copies
    from _FP8WeightCopies; the backward keeps x's FP8 transpose, not x (or, `save_input`, x,
    transposed when the wgrad needs it)."""

    @staticmethod
    def forward(ctx, x, weight, offs, w8, sw, wt8, swt, recipe, fuse_wgrad, grad_dtype, save_input):
        need_w = ctx.needs_input_grad[1]
        if w8 is None:
            w8, sw, _, _ = quantize_weight(weight, recipe, copies="forward")
        save_input = save_input and need_w and x.is_contiguous()  # a copy of x would cost more than its FP8 one
        x = x.contiguous()
        _, x8, sx, xt8, sxt = _forms(x, "identity", recipe, offs, rows=True, transposed=need_w and not save_input,
                                     dtype=torch.float8_e4m3fn)
        ctx.save_for_backward(weight, offs, x if save_input else xt8, sxt, wt8, swt)
        ctx.recipe, ctx.fuse_wgrad, ctx.grad_dtype, ctx.save_input = recipe, fuse_wgrad, grad_dtype, save_input
        return grouped_mm(x8, w8, offs, scale_x=sx, scale_w=sw)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        weight, offs, xt8, sxt, wt8, swt = ctx.saved_tensors
        need_dx, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        _, g8, sg, gt8, sgt = _forms(grad.contiguous().to(torch.bfloat16), "identity", ctx.recipe, offs,
                                     rows=need_dx, transposed=need_w, dtype=ctx.grad_dtype)
        dx = dw = None
        if need_dx:
            if wt8 is None:
                _, _, wt8, swt = quantize_weight(weight, ctx.recipe, copies="dgrad")
            # dx_g = dy_g @ w_g: the K-major operand is the transposed copy (G, K, N).
            dx = grouped_mm(g8, wt8.transpose(1, 2), offs, scale_x=sg, scale_w=swt, trans_w=False)
        del g8, sg, wt8, swt
        if need_w and ctx.save_input:  # xt8 holds x: its transposed copy now, the dgrad's operands freed
            _, _, _, xt8, sxt = _forms(xt8, "identity", ctx.recipe, offs, rows=False, transposed=True,
                                       dtype=torch.float8_e4m3fn)
        if need_w:
            dw = _weight_grad(weight, ctx.fuse_wgrad, gt8, xt8, offs, scale_dy=sgt, scale_x=sxt)
        return (dx, dw) + (None,) * 9


class GroupedLinear(nn.Module):
    """``num_experts`` linear layers applied to their own rows of one input in one launch.

    forward(x, offs): x (T, in_features) grouped by expert, offs (num_experts,) int32
    cumulative row ends on x's device; returns (T, out_features). With
    ``fuse_wgrad_accumulation=True`` the backward adds the weight gradient into
    ``weight.main_grad`` (an FP32 tensor the training framework allocates) instead of
    producing ``weight.grad``.

    ``fp8="block"`` (DeepSeek-V3: activations and gradients per 1 x 128 tile, weights per
    128 x 128 block) or ``fp8="row"`` (rows and output channels) runs the three GEMMs in FP8
    (sm_90): inputs quantized on the fly, the weight's FP8 copies made per call or kept across
    micro-batches with ``is_first_microbatch`` (see forward), the wgrad from both operands
    quantized per 128 tokens of each expert, in FP32. The master
    weight stays in ``dtype``. ``fp8_grad_dtype=torch.float8_e5m2`` quantizes the output
    gradients to e5m2 (wider range, 2 mantissa bits; TransformerEngine's hybrid recipe)
    against the e4m3 weights and activations. ``save_original_input=True`` (FP8) keeps x for the
    backward instead of its FP8 transposed copy (less memory where x is kept anyway; one more
    read of x in the backward).
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device=None,
                 fuse_wgrad_accumulation: bool = False, fp8: Optional[str] = None,
                 fp8_grad_dtype: torch.dtype = torch.float8_e4m3fn, save_original_input: bool = False):
        super().__init__()
        _check_sizes("GroupedLinear", num_experts=num_experts, in_features=in_features, out_features=out_features)
        check_flags("GroupedLinear", bias=bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                    save_original_input=save_original_input)
        self.save_original_input = save_original_input
        if fp8 is not None and fp8 not in FP8_RECIPES:
            raise ValueError(f"GroupedLinear: fp8 must be None or one of {FP8_RECIPES}, got {fp8!r}")
        if dtype not in ((torch.bfloat16,) if fp8 else (torch.bfloat16, torch.float16)):
            raise ValueError(f"GroupedLinear{f'(fp8={fp8!r})' if fp8 else ''}: dtype must be torch.bfloat16"
                             f"{'' if fp8 else ' or torch.float16'}, got {dtype}")
        if fp8_grad_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError("GroupedLinear: fp8_grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
                             f"got {fp8_grad_dtype}")
        self.fp8, self.fp8_grad_dtype = fp8, fp8_grad_dtype
        self._fp8_weight = _FP8WeightCopies(fp8) if fp8 else None
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

    def forward(self, x: torch.Tensor, offs: torch.Tensor,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``is_first_microbatch`` (FP8 only; TransformerEngine's contract): None re-quantizes
        the weight on every call; True re-quantizes and keeps the copies; False reuses them (the
        caller promises the weight has not changed since the last True)."""
        op = "GroupedLinear"
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"{op}: x must be a 2-D (T, in_features={self.in_features}) tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not self.fp8 and x.dtype != self.weight.dtype:
            raise ValueError(f"{op}: x must have the weight's dtype {self.weight.dtype}, got {x.dtype}")
        if x.device != self.weight.device:
            raise ValueError(f"{op}: x is on {x.device} but the weight is on {self.weight.device}")
        check_offs_tensor(op, offs)
        if offs.numel() != self.num_experts or offs.device != x.device:
            raise ValueError(f"{op}: offs must hold num_experts = {self.num_experts} cumulative ends on {x.device}, "
                             f"got shape {tuple(offs.shape)} on {offs.device}")
        check_offs_values(op, offs, x.shape[0])
        _check_microbatch(op, is_first_microbatch)
        fuse = self.fuse_wgrad_accumulation and torch.is_grad_enabled() and self.weight.requires_grad
        if fuse:
            check_main_grad("GroupedLinear", "weight", self.weight)
        if self.fp8:
            if x.dtype != torch.bfloat16 or self.weight.dtype != torch.bfloat16:
                raise ValueError(f"GroupedLinear(fp8={self.fp8!r}): x and weight must be bfloat16 (quantized on the "
                                 f"fly), got {x.dtype} and {self.weight.dtype}")
            w8, sw, wt8, swt = self._fp8_weight.get(self.weight, is_first_microbatch) or (None,) * 4
            # needs_input_grad says True under no_grad too: without grad mode, nothing to make for a backward.
            x_in, w_in = (x, self.weight) if torch.is_grad_enabled() else _detached(x, self.weight)
            y = _GroupedLinearFP8.apply(x_in, w_in, offs, w8, sw, wt8, swt, self.fp8, fuse, self.fp8_grad_dtype,
                                        self.save_original_input)
        elif fuse:
            y = _GroupedLinearMainGrad.apply(x, self.weight, offs)
        else:
            y = grouped_mm(x, self.weight, offs)
        if self.bias is not None:  # in FP32: the bias gradient sums every row of its expert
            y = (y.float() + _bias_of_rows(self.bias, _expert_of_rows(offs, x.shape[0]))).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, fp8={self.fp8}"
                + (f", fp8_grad_dtype={self.fp8_grad_dtype}" if self.fp8 else ""))


class GroupedMLP(nn.Module):
    """Every expert's MLP of a Mixture-of-Experts layer, fc1 -> activation -> fc2, in one
    grouped GEMM per projection and pass (:func:`distgemm.moe.grouped_mlp`).

    forward(x, offs): x (T, hidden) grouped by expert, offs (num_experts,) int32 cumulative
    row ends on x's device (read on the GPU only: CUDA-graph capture replays with new routing);
    returns (T, hidden). ``activation="swiglu"`` (``fc1_weight`` (G, 2 * ffn, hidden): gate and
    up in one weight and one GEMM) or ``"gelu"`` (G, ffn, hidden); ``fc2_weight`` (G, hidden,
    ffn). ``fp8="block"`` or ``"row"`` runs the six GEMMs in FP8 (sm_90) with the quantization
    folded into the passes that read each tensor anyway; the weights' FP8 copies are made per
    call, or kept across micro-batches with ``is_first_microbatch`` (see GroupedLinear).
    ``fuse_wgrad_accumulation=True`` adds the weight gradients into ``weight.main_grad`` (FP32).
    ``save_original_input=True`` (FP8) keeps x for the backward instead of its FP8 transposed
    copy: less memory where the caller keeps x anyway (see :func:`distgemm.moe.grouped_mlp`).
    """

    def __init__(self, num_experts: int, hidden: int, ffn: int, activation: str = "swiglu",
                 bias: bool = False, dtype: torch.dtype = torch.bfloat16, device=None,
                 fuse_wgrad_accumulation: bool = False, fp8: Optional[str] = None,
                 fp8_grad_dtype: torch.dtype = torch.float8_e4m3fn, save_original_input: bool = False):
        super().__init__()
        _check_sizes("GroupedMLP", num_experts=num_experts, hidden=hidden, ffn=ffn)
        check_flags("GroupedMLP", bias=bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                    save_original_input=save_original_input)
        if activation not in ACTIVATIONS:
            raise ValueError(f"GroupedMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if fp8 is not None and fp8 not in FP8_RECIPES:
            raise ValueError(f"GroupedMLP: fp8 must be None or one of {FP8_RECIPES}, got {fp8!r}")
        if fp8_grad_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError("GroupedMLP: fp8_grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
                             f"got {fp8_grad_dtype}")
        if dtype != torch.bfloat16:
            raise ValueError(f"GroupedMLP: dtype must be torch.bfloat16, got {dtype}")
        self.num_experts, self.hidden, self.ffn, self.activation = num_experts, hidden, ffn, activation
        self.fp8, self.fp8_grad_dtype, self.fuse_wgrad_accumulation = fp8, fp8_grad_dtype, fuse_wgrad_accumulation
        self.save_original_input = save_original_input
        width = 2 * ffn if activation == "swiglu" else ffn
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, width, hidden, dtype=dtype, device=device))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden, ffn, dtype=dtype, device=device))
        self.fc1_bias = nn.Parameter(torch.empty(num_experts, width, dtype=dtype, device=device)) if bias else None
        self.fc2_bias = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device)) if bias else None
        self._fp8_copies = (_FP8WeightCopies(fp8), _FP8WeightCopies(fp8)) if fp8 else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w, b, fan_in in ((self.fc1_weight, self.fc1_bias, self.hidden), (self.fc2_weight, self.fc2_bias, self.ffn)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)
            if b is not None:
                nn.init.uniform_(b, -bound, bound)

    def forward(self, x: torch.Tensor, offs: torch.Tensor, is_first_microbatch: Optional[bool] = None, *,
                routing=None) -> torch.Tensor:
        """x (T, hidden) grouped by expert with offs; or with ``routing`` (:func:`distgemm.moe.route`'s,
        offs = routing.offs) x's tokens, gathered into expert order as they are read (see
        :func:`distgemm.moe.grouped_mlp`)."""
        _check_microbatch("GroupedMLP", is_first_microbatch)
        copies = None
        if self.fp8:
            copies = (self._fp8_copies[0].get(self.fc1_weight, is_first_microbatch),
                      self._fp8_copies[1].get(self.fc2_weight, is_first_microbatch))
            copies = None if copies[0] is None else copies
        return grouped_mlp(x, offs, self.fc1_weight, self.fc2_weight, activation=self.activation,
                           fc1_bias=self.fc1_bias, fc2_bias=self.fc2_bias, fp8=self.fp8,
                           fp8_grad_dtype=self.fp8_grad_dtype,
                           fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, fp8_weights=copies,
                           routing=routing, save_original_input=self.save_original_input)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, ffn={self.ffn}, "
                f"activation={self.activation!r}, bias={self.fc1_bias is not None}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, fp8={self.fp8}"
                + (f", fp8_grad_dtype={self.fp8_grad_dtype}" if self.fp8 else ""))


class MoEExperts(nn.Module):
    """A Mixture-of-Experts layer's expert path from the router's choice: each token's rows
    gathered into expert order (:func:`distgemm.moe.route`; the gather is folded into the pass
    that reads them: with FP8 block scaling, the quantization, so no permuted bf16 copy is made),
    every expert's MLP (:class:`GroupedMLP`, bf16 or FP8), and the probability-weighted sum of
    each token's k outputs (:func:`distgemm.moe.unpermute`). The router stays the caller's.

    forward(x, topk_ids, topk_weights): x (T, hidden), topk_ids (T, k) int expert indices (-1:
    dropped by the router), topk_weights (T, k); returns (T, hidden) in x's dtype. Gradients
    reach x, the experts' weights and topk_weights. No host synchronisation.

    ``mlp_options`` go to :class:`GroupedMLP`. With ``fp8="block"`` its ``save_original_input``
    defaults to True here: x is the layer's input, which the model keeps anyway (the router's
    linear layer saves it for its own weight gradient), so the backward keeps x and gathers and
    transposes its rows again for fc1's weight gradient (one more gathered read of x) instead of
    holding their FP8 transposed copy, k bytes per element of x, from the forward to the end
    (modelled: 0.61 -> 0.54x the torch-ops layer's peak at 64 experts top-4, 0.62 -> 0.53x at
    256 top-8). Pass ``save_original_input=False`` to keep the copy."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, **mlp_options):
        super().__init__()
        mlp_options.setdefault("save_original_input", mlp_options.get("fp8") == "block")
        self.experts = GroupedMLP(num_experts, hidden, ffn, **mlp_options)

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        op, hidden = "MoEExperts", self.experts.hidden
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != hidden or x.dtype != torch.bfloat16:
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{op}: x must be a 2-D bfloat16 (T, hidden={hidden}) tensor, got {got}")
        if x.device != self.experts.fc1_weight.device:
            raise ValueError(f"{op}: x is on {x.device} but the experts' weights are on {self.experts.fc1_weight.device}")
        _check_routing(op, topk_ids, x.shape[0], self.num_experts)
        if topk_ids.shape[1] < 1:
            raise ValueError(f"{op}: topk_ids must route each token to k >= 1 experts, got shape "
                             f"{tuple(topk_ids.shape)}")
        if topk_ids.device != x.device:
            raise ValueError(f"{op}: topk_ids is on {topk_ids.device} but x is on {x.device}")
        if not isinstance(topk_weights, torch.Tensor) or not topk_weights.dtype.is_floating_point:
            got = topk_weights.dtype if isinstance(topk_weights, torch.Tensor) else type(topk_weights).__name__
            raise ValueError(f"{op}: topk_weights must be a floating-point (T, k) tensor, got {got}")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(f"{op}: topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got "
                             f"{tuple(topk_weights.shape)}")
        if topk_weights.device != x.device:
            raise ValueError(f"{op}: topk_weights is on {topk_weights.device} but x is on {x.device}")
        _check_microbatch(op, is_first_microbatch)
        routing = _route(topk_ids, self.num_experts)  # route() without its checks, made above
        y = self.experts(x, routing.offs, is_first_microbatch=is_first_microbatch, routing=routing)
        return unpermute(y, routing.row_map, topk_weights, topk_ids, self.num_experts)


# ---------------------------------------------------------------- tensor parallelism


def _shard(op: str, total: int, group, what: str) -> int:
    world = group.size()
    if total % world:
        raise ValueError(f"{op}: {what}={total} must divide evenly by the tensor-parallel group size {world}")
    return total // world


def _init_parallel_linear(layer, in_features, out_features, bias, group, sequence_parallel, dtype,
                          device, split_out: bool) -> None:
    """This rank's shard of an nn.Linear(in_features, out_features): output features split
    (column-parallel, bias split too) or input features split (row-parallel, full bias)."""
    from .tp import _resolve

    op = type(layer).__name__
    _check_sizes(op, in_features=in_features, out_features=out_features)
    check_flags(op, bias=bias, sequence_parallel=sequence_parallel)
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    layer.group = _resolve(group)
    layer.in_features, layer.out_features = in_features, out_features
    layer.sequence_parallel = sequence_parallel
    if split_out:
        rows = _shard(op, out_features, layer.group, "out_features")
        shape, bias_len = (rows, in_features), rows
    else:
        shape, bias_len = (out_features, _shard(op, in_features, layer.group, "in_features")), out_features
    layer.weight = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))
    layer.bias = nn.Parameter(torch.empty(bias_len, dtype=dtype, device=device)) if bias else None
    layer.reset_parameters()


def _reset_parallel_linear(layer, split_out: bool) -> None:
    """Draws the whole nn.Linear(in_features, out_features)'s weight and bias as nn.Linear does
    (same generator calls, dtype and device) and keeps this rank's shard: ranks seeded alike hold
    the shards of one weight, those a single process's nn.Linear gets from that seed, rather than
    copies of one shard (which stay copies through training)."""
    w, rank = layer.weight, layer.group.rank()
    full = torch.empty(layer.out_features, layer.in_features, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        piece = slice(rank * w.shape[0 if split_out else 1], (rank + 1) * w.shape[0 if split_out else 1])
        w.copy_(full[piece] if split_out else full[:, piece])
        del full
        if layer.bias is not None:
            bound = 1.0 / math.sqrt(layer.in_features)
            full_bias = torch.empty(layer.out_features, dtype=w.dtype, device=w.device).uniform_(-bound, bound)
            layer.bias.copy_(full_bias[piece] if split_out else full_bias)


def _parallel_input(op: str, x, features: int) -> torch.Size:
    """x's shape: a tensor of at least one dimension whose last is this rank's `features`."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != features:
        raise ValueError(f"{op}: x must be a (..., {features}) tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    return x.shape


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


class _ParallelLinear(nn.Module):
    """What the column- and row-parallel layers share: a copy of one keeps its process group."""

    def __deepcopy__(self, memo):
        import copy

        memo[id(self.group)] = self.group  # a process group is not copied (nor can be): the copy uses it too
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            twin.__dict__[name] = copy.deepcopy(value, memo)
        return twin

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}, tensor_parallel={self.group.size()}")


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with the output features split over the
    tensor-parallel ``group``: this rank holds ``weight`` (out_features / P, in_features).

    With ``sequence_parallel=True`` the input is this rank's (S / P, in_features) rows and the
    all-gather runs under the GEMM (:func:`distgemm.all_gather_matmul`); the output is
    (S, out_features / P). Otherwise the input is the full (S, in_features). Inputs of more
    dimensions are sequence-first, as in Megatron-LM: (S / P, B, in_features) -> (S, B, out_features / P).

    The parameters are this rank's rows of the weight and bias that ``nn.Linear(in_features,
    out_features, dtype=dtype, device=device)`` draws (:meth:`reset_parameters`): ranks seeded
    alike hold the shards of one layer."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 sequence_parallel: bool = True, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        _init_parallel_linear(self, in_features, out_features, bias, group, sequence_parallel, dtype,
                              device, split_out=True)

    def reset_parameters(self) -> None:
        _reset_parallel_linear(self, split_out=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .dense import gemm
        from .tp import all_gather_matmul

        shape = _parallel_input("ColumnParallelLinear", x, self.weight.shape[1])
        x2 = x.reshape(-1, shape[-1])
        if self.sequence_parallel:
            y = all_gather_matmul(x2, self.weight, group=self.group, c=self.bias,
                                  beta=1.0 if self.bias is not None else 0.0)
            rows = shape[0] * self.group.size() if len(shape) > 1 else -1  # every rank's S / P rows
            return y.reshape(rows, *shape[1:-1], y.shape[-1])
        x2 = _CopyToParallel.apply(x2, self.group)
        y = gemm(x2, self.weight, self.bias, beta=1.0 if self.bias is not None else 0.0)
        return y.reshape(*shape[:-1], y.shape[-1])


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with the input features split over the
    tensor-parallel ``group``: this rank holds ``weight`` (out_features, in_features / P).

    The input is this rank's (S, in_features / P) slice. With ``sequence_parallel=True`` the
    output is this rank's (S / P, out_features) rows, reduce-scattered under the GEMM
    (:func:`distgemm.matmul_reduce_scatter`); otherwise the full all-reduced output. Inputs of
    more dimensions are sequence-first: (S, B, in_features / P) -> (S / P, B, out_features), S a
    multiple of P.

    The parameters are this rank's columns of the weight ``nn.Linear(in_features, out_features,
    dtype=dtype, device=device)`` draws, and its whole bias (:meth:`reset_parameters`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 sequence_parallel: bool = True, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        _init_parallel_linear(self, in_features, out_features, bias, group, sequence_parallel, dtype,
                              device, split_out=False)

    def reset_parameters(self) -> None:
        _reset_parallel_linear(self, split_out=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .dense import gemm
        from .tp import matmul_reduce_scatter

        shape = _parallel_input("RowParallelLinear", x, self.weight.shape[1])
        x2 = x.reshape(-1, shape[-1])
        beta = 1.0 if self.bias is not None else 0.0
        if self.sequence_parallel:
            seq, world = (shape[0] if len(shape) > 1 else 1), self.group.size()
            if seq % world:  # rows split along the sequence: (S / P, B, ...) on each rank
                raise ValueError(f"RowParallelLinear: with sequence_parallel, x's sequence length (its first "
                                 f"dimension) {seq} must divide evenly by the tensor-parallel group size {world}")
            # Every rank adds the replicated bias to its own rows: its gradient is the sum over
            # all ranks' rows (all-reduced in backward, so bias.grad is complete on each rank).
            bias = None if self.bias is None else _CopyToParallel.apply(self.bias, self.group)
            y = matmul_reduce_scatter(x2, self.weight, group=self.group, c=bias, beta=beta)
            return y.reshape(seq // world, *shape[1:-1], y.shape[-1])
        y = _ReduceFromParallel.apply(gemm(x2, self.weight), self.group)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], y.shape[-1])
