"""Grouped GEMMs for Mixture-of-Experts: every expert in one launch, group sizes on the GPU.

``offs`` follows ``torch._grouped_mm``: G int32 cumulative row ends (expert g owns rows
``offs[g-1]:offs[g]`` of x, with ``offs[-1] = 0``). Backends, picked by
``DISTGEMM_GROUPED_BACKEND=auto|cutlass|cublas|torch``: ``cutlass`` is distgemm's ptr-array
kernel (no host sync, CUDA-graph safe); ``cublas`` a multi-stream cuBLAS loop in the core
(reads ``offs`` on the host); ``torch`` is ``torch._grouped_mm``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch

from . import _repeat_calls, autotune
from ._dispatch import Candidate, Dispatcher, GroupedPass, configs
from ._settings import current as _current_settings
from ._checks import check_flags, check_no_overlap, needs_autograd
from ._library import aligned16, device_arch, is_aligned16, has_kernels, ops, warn_once
from ._routing import check_offs_tensor, check_offs_values, group_bounds
from .grouped_fp8 import FLOAT8, grouped_mm_fp8, grouped_mm_wgrad_fp8

_CUTLASS, _CUBLAS = 0, 1
FLOAT16 = (torch.bfloat16, torch.float16)


def _shape(t):
    return tuple(t.shape)


def _check_offs(op: str, offs, groups: int, tokens: int, device) -> torch.Tensor:
    """offs checked, and contiguous (a strided view is copied: G values)."""
    check_offs_tensor(op, offs)
    if offs.device != device:
        raise ValueError(f"{op}: offs is on {offs.device} but the inputs are on {device}")
    if offs.numel() != groups:
        raise ValueError(f"{op}: offs must hold one end per group ({groups}), got {offs.numel()}")
    check_offs_values(op, offs, tokens)
    return offs.contiguous()


def _check_out(op, out, shape, dtype, device, accumulate):
    if out is None:
        if accumulate:
            raise ValueError(f"{op}: accumulate=True needs out")
        return
    if not isinstance(out, torch.Tensor) or _shape(out) != shape or out.dtype != dtype:
        raise ValueError(f"{op}: out must be a {dtype} tensor of shape {shape}, got "
                         f"{getattr(out, 'dtype', None)} {_shape(out) if isinstance(out, torch.Tensor) else out}")
    if out.device != device or not out.is_contiguous():
        raise ValueError(f"{op}: out must be contiguous and on {device}")


def _out_dtype(op, dtype, out_dtype, out):
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be a torch.Tensor or None, got {type(out).__name__}")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else dtype
    if out_dtype not in (dtype, torch.float32):
        name = "out" if out is not None and out.dtype == out_dtype else "out_dtype"  # the one passed
        raise ValueError(f"{op}: {name} must be {dtype} or torch.float32, got {out_dtype}")
    return out_dtype


def _check_inputs(op, pairs):
    for name, t, dims in pairs:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{op}: {name} must be {dims}-D, got shape {_shape(t)}")
    first = pairs[0][1]
    if first.dtype not in FLOAT16:
        raise ValueError(f"{op}: {pairs[0][0]} must be bfloat16 or float16, got {first.dtype}")
    for name, t, _ in pairs[1:]:
        if t.dtype != first.dtype:
            raise ValueError(f"{op}: {name} must have {pairs[0][0]}'s dtype {first.dtype}, got {t.dtype}")
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {pairs[0][0]} is on {first.device}")


# (kind, in, out) of the sm_90 grouped kernels in this build, read once at import.
_COMPILED = frozenset((kind, i, o) for kind in (0, 1, 2) for i in FLOAT16 for o in FLOAT16 + (torch.float32,)
                      if ops.grouped_configs(kind, i, o, 90))


def _backend(op: str, device, n: int, k: int, in_dtype, out_dtype, kind: int,
             accumulate: bool = False) -> Tuple[str, bool]:
    """The backend for this call: the requested one when it applies, else the best that
    does (warning once, with the reason); and whether torch._grouped_mm may stand in for
    distgemm's kernel when the autotuner times it faster (backend auto only)."""
    requested = _current_settings().grouped_backend
    reasons = {}
    if device.type != "cuda":
        reasons = {b: "the inputs are not on a CUDA device" for b in ("cutlass", "cublas", "torch")}
    else:
        # 16-byte rows: distgemm's kernels, the core's cuBLAS loop and torch._grouped_mm's stride
        # checks alike; the per-group loop takes any N and K.
        unaligned = f"N={n} and K={k} must be multiples of 8" if n % 8 or k % 8 else None
        if unaligned:
            reasons["cublas"] = unaligned
        if not has_kernels(device) or device_arch(device) != 90:
            reasons["cutlass"] = "distgemm's grouped kernels are built for sm_90 only"
        elif unaligned:
            reasons["cutlass"] = unaligned
        elif (kind, in_dtype, out_dtype) not in _COMPILED:
            reasons["cutlass"] = f"no grouped kernel is built for {in_dtype} -> {out_dtype}"
        if device_arch(device) < 90 or out_dtype != torch.bfloat16:
            reasons["torch"] = "torch._grouped_mm needs sm_90+ and gives bfloat16 output only"
        elif accumulate:
            reasons["torch"] = ("accumulate=True (torch._grouped_mm rounds the product to bfloat16 before "
                                "the addition)")
        elif unaligned:
            reasons["torch"] = unaligned
    order = ("cutlass", "torch", "cublas") if requested == "auto" else (requested, "cutlass", "torch", "cublas")
    torch_may_answer = requested == "auto" and "torch" not in reasons
    for name in order:
        if name not in reasons:
            if requested not in ("auto", name):
                warn_once(f"{op}: backend {requested!r} unavailable ({reasons[requested]}); using {name!r}")
            return name, torch_may_answer
    if requested != "auto":
        warn_once(f"{op}: backend {requested!r} unavailable ({reasons[requested]}); using the "
                  "per-group PyTorch loop")
    return "loop", False


def _accumulate_once(out: torch.Tensor, product_into: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """out += product, rounded to out's 16-bit dtype once: cuBLAS with beta = 1 and a bf16/fp16
    C rounds the product to that dtype before adding (1-ulp errors, seen by the GPU fuzz), so the
    multi-stream cuBLAS backend computes the product into FP32 zeros first (what it does not
    write, rows past offs[-1] or empty groups, adds nothing)."""
    tmp = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    product_into(tmp)
    return out.copy_(out.float() + tmp)


def reference_grouped_mm(x, w, offs, out, accumulate, trans_w):
    """Per-group PyTorch loop with FP32 accumulation, into `out`."""
    for g, (s, e) in enumerate(group_bounds(offs, x.shape[0])):
        if e > s:
            y = x[s:e].float() @ (w[g].float().T if trans_w else w[g].float())
            out[s:e] = (out[s:e].float() + y) if accumulate else y
    return out


def reference_grouped_mm_wgrad(dy, x, offs, out, accumulate):
    for g, (s, e) in enumerate(group_bounds(offs, x.shape[0])):
        y = dy[s:e].float().T @ x[s:e].float()
        out[g] = (out[g].float() + y) if accumulate else y
    return out


# One dispatcher for the 16-bit grouped passes. Forward/dgrad calls (no out, no scales, no
# autograd) whose checks passed and which ran on x and w in place go to the native table of
# repeat calls (`_repeat_calls`): the checks and the choice are functions of its key, the
# settings (the backend, debug) included.
_DISPATCH = Dispatcher("distgemm.grouped_mm")
_repeat_grouped_mm = _repeat_calls.grouped_mm
TORCH = "torch._grouped_mm"
_KIND_NAMES = ("forward", "dgrad", "wgrad")


def _run_forward_config(call: GroupedPass, config: int):
    """The forward/dgrad kernel's tile configuration `config` (-1: the cost model's): into out,
    or a new output (through the functional op where autograd records it or torch.compile
    traces it; outside autograd, as the op's Python wrapper costs ~10 us of host time)."""
    if call.out is None and (call.autograd or torch.compiler.is_compiling()):
        return ops.grouped_mm(call.a, call.b, call.offs, call.out_dtype, call.trans_w, _CUTLASS, config)
    out = call.destination()
    ops.grouped_mm_out(call.a, call.b, call.offs, out, call.accumulate, call.trans_w, _CUTLASS, config)
    return out


def _run_wgrad_config(call: GroupedPass, config: int):
    if call.out is None:
        return ops.grouped_mm_wgrad(call.a, call.b, call.offs, call.out_dtype, _CUTLASS, config)
    ops.grouped_mm_wgrad_out(call.a, call.b, call.offs, call.out, call.accumulate, _CUTLASS, config)
    return call.out


def _torch_why_not(call: GroupedPass) -> Optional[str]:
    return None if call.torch_ok else ("torch._grouped_mm answers bfloat16 calls without out, accumulate or "
                                       "autograd (its autograd would bypass ours), backend auto, sm_90+")


def _run_torch_forward(call: GroupedPass):
    return torch._grouped_mm(call.a, call.b.transpose(-2, -1) if call.trans_w else call.b, offs=call.offs,
                             out_dtype=call.out_dtype)


def _run_torch_wgrad(call: GroupedPass):
    return torch._grouped_mm(call.a.T, call.b, offs=call.offs, out_dtype=call.out_dtype)


@functools.lru_cache(maxsize=None)
def _candidates(kind: int, in_dtype, out_dtype) -> tuple:
    """A grouped pass's candidates: each sm_90 tile configuration of this build for (kind, in,
    out), and torch._grouped_mm where it computes the same call."""
    names = ops.grouped_configs(kind, in_dtype, out_dtype, 90)
    if kind < 2:
        return configs(names, _run_forward_config) + (Candidate(TORCH, _run_torch_forward, _torch_why_not,
                                                                vendor=True),)
    return configs(names, _run_wgrad_config) + (Candidate(TORCH, _run_torch_wgrad, _torch_why_not, vendor=True),)


# The cost model's configuration, where nothing was chosen (autotuning off, torch.compile,
# capture of a problem never timed).
_COST_MODEL = (Candidate("cutlass", lambda call: _run_forward_config(call, -1)),
               Candidate("cutlass", lambda call: _run_wgrad_config(call, -1)))


def _forward(call: GroupedPass, remember: bool, requested_dtype) -> torch.Tensor:
    """A forward/dgrad call on distgemm's kernel or torch._grouped_mm, as the dispatcher chooses.
    A settled plain call on operands read in place (`remember`) goes to the native table, under
    the out_dtype it was passed (`requested_dtype`); its repeated calls then run the kernel's
    configuration into a new output, or torch._grouped_mm with w.mT
    (csrc/torch/repeat_calls.cpp)."""
    kind = 0 if call.trans_w else 1
    chosen = None
    if _DISPATCH.active():
        chosen = _DISPATCH.choose(call.key(_KIND_NAMES[kind], call.a.shape[0]), call,
                                  _candidates(kind, call.a.dtype, call.out_dtype), call.a.device, call.scratch)
    candidate = chosen or _COST_MODEL[0]
    settled = chosen is not None or not autotune.enabled()  # not a stand-in during capture
    if (remember and settled and call.out is None and not call.autograd
            and not torch.compiler.is_compiling() and not _current_settings().debug):
        _repeat_calls.remember_grouped_mm(call.a, call.b, call.offs, requested_dtype, call.trans_w, call.out_dtype,
                                          candidate.name, candidate.config)
    _DISPATCH.record(candidate.name)
    return candidate.run(call)


# ---------------------------------------------------------------- public API


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *,
               out: Optional[torch.Tensor] = None, accumulate: bool = False,
               out_dtype: Optional[torch.dtype] = None, trans_w: bool = True,
               scale_x: Optional[torch.Tensor] = None, scale_w: Optional[torch.Tensor] = None,
               use_fast_accum: bool = False) -> torch.Tensor:
    """Per expert g: ``out[rows_g] = x[rows_g] @ w[g].T`` (``trans_w=True``, w (G, N, K), the
    per-expert ``nn.Linear`` weights) or ``x[rows_g] @ w[g]`` (``trans_w=False``, w (G, K, N)).

    x (T, K) bfloat16/float16, rows grouped by expert; offs (G,) int32 on x's device.
    Returns (T, N) in ``out_dtype`` (x's dtype or float32), FP32 accumulation. Rows past
    ``offs[-1]`` are not written (a new output leaves them uninitialized), nor are those rows of
    x's gradient. With ``out`` the
    result is written there, or added to it with ``accumulate=True``. Differentiable in x
    and w when ``out`` is not given.

    FP8: x and w float8_e4m3fn with ``scale_x`` and ``scale_w`` (row-wise or 128-block; see
    ``distgemm.grouped_fp8``), bfloat16 out, partial sums promoted to FP32 every 128 of K
    (``use_fast_accum`` is accepted and changes nothing). Not differentiable.
    """
    op = "distgemm.grouped_mm"
    plain = (out is None and accumulate is False and scale_x is None and scale_w is None
             and (use_fast_accum is False or use_fast_accum is True))  # checked below, not part of the call
    if plain and not torch.compiler.is_compiling():  # a repeated call skips the checks too
        y = _repeat_grouped_mm(x, w, offs, out_dtype, trans_w)
        if y is not None:
            return y
    check_flags(op, accumulate=accumulate, trans_w=trans_w, use_fast_accum=use_fast_accum)
    if isinstance(x, torch.Tensor) and x.dtype in FLOAT8:
        if scale_x is None or scale_w is None:
            raise ValueError(f"{op}: float8 x needs scale_x and scale_w")
        return grouped_mm_fp8(x, w, offs, scale_x=scale_x, scale_w=scale_w, out=out,
                              accumulate=accumulate, out_dtype=out_dtype, trans_w=trans_w,
                              use_fast_accum=use_fast_accum)
    if scale_x is not None or scale_w is not None:
        if not isinstance(x, torch.Tensor):  # x itself is what is wrong
            raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
        raise ValueError(f"{op}: scale_x and scale_w apply to float8 inputs only (x is {x.dtype})")
    _check_inputs(op, [("x", x, 2), ("w", w, 3)])
    groups, k = w.shape[0], x.shape[1]
    n = w.shape[1] if trans_w else w.shape[2]
    k_w = w.shape[2] if trans_w else w.shape[1]
    if k_w != k:
        layout = "(G, N, K)" if trans_w else "(G, K, N)"
        raise ValueError(f"{op}: w must have shape {layout} with K = x.shape[1] = {k} "
                         f"(trans_w={trans_w}), got {_shape(w)}")
    offs = _check_offs(op, offs, groups, x.shape[0], x.device)
    requested_dtype = out_dtype
    out_dtype = _out_dtype(op, x.dtype, out_dtype, out)
    _check_out(op, out, (x.shape[0], n), out_dtype, x.device, accumulate)
    if out is not None and needs_autograd(x, w):
        raise ValueError(f"{op}: out= is not differentiable, and x or w requires grad; call without out "
                         "(or under torch.no_grad())")
    check_no_overlap(op, out, (("x", x), ("w", w)))

    backend, torch_may_answer = _backend(op, x.device, n, k, x.dtype, out_dtype, 0 if trans_w else 1, accumulate)
    if backend in ("cutlass", "cublas"):
        code = _CUTLASS if backend == "cutlass" else _CUBLAS
        in_place = x.is_contiguous() and w.is_contiguous() and is_aligned16(x, w)
        x, w = aligned16(x.contiguous()), aligned16(w.contiguous())
        autograd = needs_autograd(x, w)
        if code == _CUTLASS:
            # torch._grouped_mm may answer a plain call only: its autograd would bypass ours.
            call = GroupedPass(x, w, offs, out, accumulate, (x.shape[0], n), out_dtype, trans_w, autograd,
                               torch_may_answer and out is None and not autograd)
            eager = in_place and not torch.compiler.is_compiling()  # the key reads data pointers
            return _forward(call, eager, requested_dtype)
        autotune.record(backend)
        if out is None:
            return ops.grouped_mm(x, w, offs, out_dtype, trans_w, code)
        if accumulate and out.dtype != torch.float32:
            return _accumulate_once(out, lambda tmp: ops.grouped_mm_out(x, w, offs, tmp, False, trans_w, code))
        ops.grouped_mm_out(x, w, offs, out, accumulate, trans_w, code)
        return out
    if backend == "torch":
        if out is not None and offs.numel() == 0:  # no groups: no rows to write (and no offs[-1])
            return out
        x, w = aligned16(x.contiguous()), aligned16(w.contiguous())  # its stride checks refuse other views
        y = torch._grouped_mm(x, w.transpose(-2, -1) if trans_w else w, offs=offs, out_dtype=out_dtype)
        if out is None:
            return y
        # Rows past offs[-1] stay as they were (known on the device only: no host sync).
        grouped = torch.arange(x.shape[0], device=x.device) < offs[-1].clamp(0, x.shape[0])
        return out.copy_(torch.where(grouped.unsqueeze(1), y, out))
    if out is None and x.device.type == "cpu":
        return ops.grouped_mm(x, w, offs, out_dtype, trans_w)  # the op's CPU kernel, with autograd
    if out is None:
        out = torch.empty((x.shape[0], n), dtype=out_dtype, device=x.device)
    return reference_grouped_mm(x, w, offs, out, accumulate, trans_w)


def grouped_mm_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, *,
                     out: Optional[torch.Tensor] = None, accumulate: bool = False,
                     out_dtype: Optional[torch.dtype] = None,
                     scale_dy: Optional[torch.Tensor] = None,
                     scale_x: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weight gradients of every expert in one launch: ``out[g] = dy[rows_g].T @ x[rows_g]``,
    a variable-K grouped GEMM. dy (T, N), x (T, K); returns (G, N, K) in ``out_dtype``: by
    default out's dtype, or FP32 without ``out``.
    Experts without tokens get zeros, or are left untouched with ``accumulate=True`` (which
    adds into ``out``, e.g. an FP32 ``main_grad``).

    FP8: dy and x float8_e4m3fn, quantized per 128 tokens of each expert, transposed and
    padded by ``quantize_fp8(t, (1, 128), transpose=True, offs=offs)``: dy (N, Tp), x (K, Tp)
    with ``scale_dy`` (N, Tp/128) and ``scale_x`` (K, Tp/128); float32 out."""
    op = "distgemm.grouped_mm_wgrad"
    check_flags(op, accumulate=accumulate)
    if out_dtype is None:
        out_dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
    if isinstance(dy, torch.Tensor) and dy.dtype in FLOAT8:
        if scale_dy is None or scale_x is None:
            raise ValueError(f"{op}: float8 dy needs scale_dy and scale_x")
        return grouped_mm_wgrad_fp8(dy, x, offs, scale_dy=scale_dy, scale_x=scale_x, out=out,
                                    accumulate=accumulate, out_dtype=out_dtype)
    if scale_dy is not None or scale_x is not None:
        if not isinstance(dy, torch.Tensor):  # dy itself is what is wrong
            raise TypeError(f"{op}: dy must be a torch.Tensor, got {type(dy).__name__}")
        raise ValueError(f"{op}: scale_dy and scale_x apply to float8 inputs only (dy is {dy.dtype})")
    _check_inputs(op, [("dy", dy, 2), ("x", x, 2)])
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: dy and x must have the same number of rows, got {_shape(dy)} and {_shape(x)}")
    check_offs_tensor(op, offs)
    groups, n, k = offs.numel(), dy.shape[1], x.shape[1]
    offs = _check_offs(op, offs, groups, x.shape[0], x.device)
    if groups == 0:
        raise ValueError(f"{op}: offs must hold at least one group")
    out_dtype = _out_dtype(op, x.dtype, out_dtype, out)
    _check_out(op, out, (groups, n, k), out_dtype, x.device, accumulate)
    check_no_overlap(op, out, (("dy", dy), ("x", x)))

    backend, torch_may_answer = _backend(op, x.device, n, k, x.dtype, out_dtype, 2, accumulate)
    if backend in ("cutlass", "cublas"):
        code = _CUTLASS if backend == "cutlass" else _CUBLAS
        dy, x = aligned16(dy.contiguous()), aligned16(x.contiguous())
        if code == _CUTLASS:
            call = GroupedPass(dy, x, offs, out, accumulate, (groups, n, k), out_dtype,
                               torch_ok=torch_may_answer and out is None and not needs_autograd(dy, x))
            chosen = _COST_MODEL[1]
            if _DISPATCH.active():
                chosen = _DISPATCH.choose(call.key("wgrad", x.shape[0]), call, _candidates(2, x.dtype, out_dtype),
                                          x.device, call.scratch) or chosen
            _DISPATCH.record(chosen.name)
            return chosen.run(call)
        autotune.record(backend)
        if out is None:
            return ops.grouped_mm_wgrad(dy, x, offs, out_dtype, code)
        if accumulate and out.dtype != torch.float32:
            return _accumulate_once(out, lambda tmp: ops.grouped_mm_wgrad_out(dy, x, offs, tmp, False, code))
        ops.grouped_mm_wgrad_out(dy, x, offs, out, accumulate, code)
        return out
    if backend == "torch":
        dy, x = aligned16(dy.contiguous()), aligned16(x.contiguous())
        y = torch._grouped_mm(dy.T, x, offs=offs, out_dtype=out_dtype)
        return y if out is None else out.copy_(y)  # accumulate never takes this backend
    if out is None and x.device.type == "cpu":
        return ops.grouped_mm_wgrad(dy, x, offs, out_dtype)
    if out is None:
        out = torch.empty((groups, n, k), dtype=out_dtype, device=x.device)
    return reference_grouped_mm_wgrad(dy, x, offs, out, accumulate)


# ---------------------------------------------------------------- op registration


@torch.library.register_fake("distgemm::grouped_mm")
def _grouped_mm_fake(x, w, offs, out_dtype, trans_w, backend=0, config=-1):
    return x.new_empty((x.shape[0], w.shape[1] if trans_w else w.shape[2]), dtype=out_dtype)


@torch.library.register_fake("distgemm::grouped_mm_wgrad")
def _grouped_mm_wgrad_fake(dy, x, offs, out_dtype, backend=0, config=-1):
    return dy.new_empty((offs.shape[0], dy.shape[1], x.shape[1]), dtype=out_dtype)


@torch.library.register_fake("distgemm::grouped_mm_out")
def _grouped_mm_out_fake(x, w, offs, out, accumulate, trans_w, backend=0, config=-1):
    return None


@torch.library.register_fake("distgemm::grouped_mm_wgrad_out")
def _grouped_mm_wgrad_out_fake(dy, x, offs, out, accumulate, backend=0, config=-1):
    return None


@torch.library.register_kernel("distgemm::grouped_mm", "cpu")
def _grouped_mm_cpu(x, w, offs, out_dtype, trans_w, backend=0, config=-1):
    check_offs_values("distgemm::grouped_mm", offs, x.shape[0])
    out = torch.zeros((x.shape[0], w.shape[1] if trans_w else w.shape[2]), dtype=out_dtype)
    return reference_grouped_mm(x, w, offs, out, False, trans_w)


@torch.library.register_kernel("distgemm::grouped_mm_wgrad", "cpu")
def _grouped_mm_wgrad_cpu(dy, x, offs, out_dtype, backend=0, config=-1):
    check_offs_values("distgemm::grouped_mm_wgrad", offs, x.shape[0])
    out = torch.empty((offs.shape[0], dy.shape[1], x.shape[1]), dtype=out_dtype)
    return reference_grouped_mm_wgrad(dy, x, offs, out, False)


def _grouped_setup_context(ctx, inputs, output):
    x, w, offs, out_dtype, trans_w = inputs[:5]
    ctx.save_for_backward(x, w, offs)
    ctx.trans_w = trans_w


def _grouped_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    grad = grad.to(x.dtype)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        # y = x @ w_g^T  =>  dx = dy @ w_g: the other transpose of the same weights.
        # Rows past offs[-1] are not written, as in the forward (zeroing them would cost a pass
        # over dx for rows that are usually not there).
        dx = grouped_mm(grad, w, offs, trans_w=not ctx.trans_w)
    if ctx.needs_input_grad[1]:
        dw = (grouped_mm_wgrad(grad, x, offs) if ctx.trans_w else grouped_mm_wgrad(x, grad, offs))
        dw = dw.to(w.dtype)
    return dx, dw, None, None, None, None, None


torch.library.register_autograd("distgemm::grouped_mm", _grouped_backward,
                                setup_context=_grouped_setup_context)
