"""distgemm.gemm: ``alpha * (a @ b.T) + beta * c`` on CUTLASS kernels, with autograd."""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from . import _repeat_calls, autotune
from ._checks import (FLOAT8, FLOAT16, block_scales, check_flags, check_operands, check_scalars, needs_autograd,
                      require_fp8_scales)
from ._library import aligned16, kernel_arch, ops, warn_once
from ._dispatch import Candidate, Dispatcher, configs, recording



def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: Optional[torch.Tensor] = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    out_dtype: Optional[torch.dtype] = None,
    scale_a: Optional[torch.Tensor] = None,
    scale_b: Optional[torch.Tensor] = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``alpha * (scale_a * scale_b * (a @ b.T)) + beta * c`` with FP32 accumulation.

    a: (M, K); b: (N, K), the ``nn.Linear`` weight layout; c: (M, N) or a bias (N,).
    bfloat16/float16 inputs give their own dtype or float32 (``out_dtype``); float8 inputs
    (e4m3, or e5m2 against e4m3) take FP32 scales, one per tensor or one per row of a
    (``scale_a``, M values) / of b (``scale_b``, N values), and give bfloat16 by default.
    ``use_fast_accum`` (float8, as in ``torch._scaled_mm``) keeps the partial sums in the
    tensor cores' reduced precision for the whole K: faster, less accurate.
    128-block scales (DeepSeek-V3; float8_e4m3fn, bfloat16 out, no c): ``scale_a``
    (M, ceil(K/128)) per 1 x 128 of a, ``scale_b`` (ceil(N/128), ceil(K/128)) per 128 x 128
    of b, promoted to FP32 every 128 of K (the grouped FP8 kernel with one group).
    Differentiable for bfloat16/float16 in a, b and c.
    """
    plain = scale_a is None and scale_b is None and use_fast_accum is False
    if plain:  # a repeated call skips the checks too (they are functions of its key)
        if not _is_compiling():
            out = _repeat_gemm(a, b, c, alpha, beta, out_dtype)
            if out is not None:
                return out
    elif scale_a is not None and scale_b is not None:  # float8 with scales: the same
        if not _is_compiling():
            out = _repeat_scaled_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, use_fast_accum)
            if out is not None:
                return out
        run = _repeat_scaled(a, b, c, alpha, beta, out_dtype, (scale_a, scale_b, use_fast_accum))  # 128-block
        if run is not None:
            return run(a, b, c, scale_a, scale_b)
    autograd = needs_autograd(a, b, c)
    looked_up = plain and not autograd
    check_flags("distgemm.gemm", use_fast_accum=use_fast_accum)
    alpha, beta = check_scalars("distgemm.gemm", alpha=alpha, beta=beta)
    out_dtype = check_operands("distgemm.gemm", a, b, c, out_dtype, scale_a, scale_b)
    require_fp8_scales("distgemm.gemm", a, scale_a, scale_b)
    arch = kernel_arch(a.device)
    if autograd:
        return _GemmFunction.apply(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, use_fast_accum, arch)
    return gemm_unchecked(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, use_fast_accum, arch,
                          looked_up=looked_up)


# One dispatcher for every dense call: 16-bit ones (cuBLAS or a tile configuration), float8
# ones with per-tensor or row-wise scales (torch._scaled_mm or a tile configuration) and
# 128-block-scaled ones (F.scaled_mm or our grouped kernel with one group). Settled 16-bit calls
# without scales and float8 calls with per-tensor or row-wise scales (the vendor call, or ours on
# operands read in place) go to the native tables of repeat calls, which run them in one call
# (`_repeat_calls`); 128-block-scaled calls to the dispatcher's table of Python runners. The
# checks are functions of the key, and so is the choice.
_DISPATCH = Dispatcher("distgemm.gemm")
_REPEAT_CALLS = _DISPATCH.calls
_repeat_gemm = _repeat_calls.gemm
_repeat_scaled_gemm = _repeat_calls.scaled_gemm
_is_compiling = torch.compiler.is_compiling
_NATIVE = "native"  # the signature of a call the native tables take: they read its key off the operands


def _scaled_signature(a, b, c, alpha, beta, out_dtype, scales) -> Optional[tuple]:
    """The key of a 128-block-scaled float8 call in the Python table of repeat calls (out_dtype
    None: bfloat16; the calls with per-tensor or row-wise scales have the native table's key);
    scales: its (scale_a, scale_b, use_fast_accum). None for non-tensors, which the checks will
    name."""
    try:
        scale_a, scale_b, fast_accum = scales
        return (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device,
                None if c is None else (c.shape, c.stride(), c.dtype, c.device), alpha, beta,
                out_dtype if out_dtype is not None else torch.bfloat16,
                scale_a.shape, scale_a.stride(), scale_a.dtype, scale_a.device,
                scale_b.shape, scale_b.stride(), scale_b.dtype, scale_b.device, fast_accum)
    except AttributeError:
        return None


def _repeat_scaled(a, b, c, alpha, beta, out_dtype, scales) -> Optional[Callable]:
    """The runner of a 128-block-scaled float8 call seen before with this signature, where it may
    run as is (eager, no autograd to record, autotuning on); else None (the full path).
    run(a, b, c, scale_a, scale_b)."""
    if not _REPEAT_CALLS or _is_compiling() or not autotune.enabled():
        return None
    try:
        run = _REPEAT_CALLS.get(_scaled_signature(a, b, c, alpha, beta, out_dtype, scales))
    except TypeError:  # an unhashable argument: the checks name it
        return None
    # bool (and NumPy's) hash and compare equal to 1 and 0, which the checks refuse: only the
    # plain number types may stand for the checked floats a signature was stored with.
    if (run is None or alpha.__class__ not in _PLAIN_REALS or beta.__class__ not in _PLAIN_REALS
            or (torch.is_grad_enabled()
                and (a.requires_grad or b.requires_grad or (c is not None and c.requires_grad)))):
        return None
    return run


_PLAIN_REALS = frozenset((float, int))


class _Call:
    """A dense call as its candidates take it: the caller's operands, the kernels' (copied or
    padded by _kernel_operands where they cannot be read in place), the epilogue, and the
    signature a settled call is remembered under (_NATIVE: the native tables', read off the
    operands; None: not remembered). fast_accum is the accumulation the kernels run,
    asked_fast_accum the caller's (a float8 call's key)."""

    __slots__ = ("a", "b", "c", "alpha", "beta", "out_dtype", "scale_a", "scale_b", "fast_accum", "kernel_dtype",
                 "arch", "ka", "kb", "kc", "kscale_a", "kscale_b", "n", "signature", "asked_fast_accum")

    def __init__(self, a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, kernel_dtype, arch, signature,
                 asked_fast_accum=None):
        self.a, self.b, self.c, self.alpha, self.beta, self.out_dtype = a, b, c, alpha, beta, out_dtype
        self.scale_a, self.scale_b, self.fast_accum, self.kernel_dtype = scale_a, scale_b, fast_accum, kernel_dtype
        self.arch, self.signature = arch, signature
        self.asked_fast_accum = fast_accum if asked_fast_accum is None else asked_fast_accum
        if kernel_dtype is not None:
            self.ka, self.kb, self.kc, self.kscale_b, self.n = _kernel_operands(a, b, c, kernel_dtype, scale_b, arch)
            self.kscale_a = _flat(scale_a)

    def in_place(self) -> bool:
        """Whether the kernels read the caller's operands as they are (a repeated call then
        needs no copies either)."""
        return self.ka is self.a and self.kb is self.b and self.kc is self.c


def _run_config(call: _Call, config: int):
    """Tile configuration `config` (-1: the heuristic's) on the call's kernel operands."""
    out = ops.gemm(call.ka, call.kb, call.kc, call.alpha, call.beta, call.kernel_dtype, call.kscale_a,
                   call.kscale_b, call.fast_accum, config)
    return _trim(out, call.n, call.kernel_dtype, call.out_dtype)


def _run(call: _Call, candidate: Candidate):
    """Runs the chosen candidate; a settled call's runner is remembered for its signature."""
    _DISPATCH.record(candidate.name)
    if call.signature is _NATIVE and not _is_compiling():
        _remember_native(call, candidate)
    elif call.signature is not None and not _is_compiling():
        runner = _runner_of(call, candidate)
        if runner is not None:
            _DISPATCH.remember(call.signature, runner)
    return candidate.run(call)


def _remember_native(call: _Call, candidate: Candidate) -> None:
    """A call's entry in the native tables. 16-bit: cuBLAS (F.linear, or addmm with c) or a tile
    configuration without c; float8 with per-tensor or row-wise scales: torch._scaled_mm (as
    _scaled_mm_runner calls it) or a tile configuration (as _run_config, with c). Ours where it
    reads the operands in place (padding or a copy would show as operands not in place)."""
    if call.scale_a is not None:
        if candidate.name == _SCALED_MM or (candidate.config >= 0 and call.in_place()):
            _repeat_calls.remember_scaled_gemm(call.a, call.b, call.c, call.alpha, call.beta, call.out_dtype,
                                               call.scale_a, call.scale_b, call.asked_fast_accum,
                                               call.kernel_dtype, call.fast_accum, candidate.name, candidate.config)
    elif candidate.name == _CUBLAS or (candidate.config >= 0 and call.c is None and call.in_place()):
        _repeat_calls.remember_gemm(call.a, call.b, call.c, call.alpha, call.beta, call.out_dtype, candidate.name,
                                    candidate.config)


def _runner_of(call: _Call, candidate: Candidate) -> Optional[Callable]:
    """A 128-block-scaled call's runner."""
    if candidate.name == _TORCH_BLOCK:
        alpha = call.alpha
        return recording(_TORCH_BLOCK, lambda a, b, c, scale_a, scale_b:
                          _scaled_by(_block_peer(a, b, scale_a, scale_b), alpha))
    if candidate.name == _OURS_BLOCK:
        return recording(_OURS_BLOCK, _block_ours_runner(call.alpha))
    return None


def _block_ours_runner(alpha):
    """run(a, b, c, scale_a, scale_b) on our kernel. offs is made once, at the first call outside
    CUDA-graph capture (a repeated call launches the GEMM alone); a call being captured makes its
    own, in the graph's memory: made during capture, offs would be filled only on replay (eager
    calls would read unwritten memory), and a graph must not read a tensor this table may drop."""
    offs = []

    def run(a, b, c, scale_a, scale_b):
        if _capturing(a):
            return _scaled_by(_block_ours(a, b, scale_a, scale_b), alpha)
        if not offs:
            offs.append(_one_group(a))
        return _scaled_by(_block_ours(a, b, scale_a, scale_b, offs[0]), alpha)
    return run


# ---------------------------------------------------------------- candidates

_CUBLAS, _SCALED_MM = "cublas", "torch._scaled_mm"
_TORCH_BLOCK, _OURS_BLOCK = "F.scaled_mm", autotune.CUTLASS_PREFIX + "grouped"


def _cublas_why_not(call: _Call) -> Optional[str]:
    if call.alpha != 1.0 or (call.c is not None and call.beta != 1.0):
        return "cuBLAS through PyTorch has no alpha, and beta 1 only"
    if call.out_dtype != call.a.dtype:
        return "cuBLAS through PyTorch gives the inputs' dtype"
    return None


def _cublas_gemm(a, b, c, out_dtype):
    """alpha = 1, beta = 1 (or no c) through PyTorch's cuBLAS: the 16-bit vendor candidate (as the
    native table's repeated calls run it: csrc/torch/repeat_calls.cpp)."""
    if torch._C._is_any_autocast_enabled():
        # F.linear and addmm follow autocast (another dtype out, float16 overflowing bfloat16's
        # range); our kernels, and so gemm, do not.
        with torch.autocast(a.device.type, enabled=False):
            return _cublas_gemm_as_is(a, b, c, out_dtype)
    return _cublas_gemm_as_is(a, b, c, out_dtype)


def _cublas_gemm_as_is(a, b, c, out_dtype):
    if c is None:  # F.linear: a @ b.T without a Python-side view of b (~0.3 us less than mm)
        return F.linear(a, b)
    return torch.addmm(c.to(out_dtype), a, b.t())


_CUBLAS_CANDIDATE = Candidate(_CUBLAS, lambda call: _cublas_gemm(call.a, call.b, call.c, call.out_dtype),
                              _cublas_why_not, vendor=True)


def _row_wise(scale_a, scale_b) -> bool:
    return any(s is not None and s.numel() > 1 for s in (scale_a, scale_b))


def _scaled_mm_why_not(call: _Call) -> Optional[str]:
    """Why torch._scaled_mm (cuBLAS for per-tensor scales, PyTorch's row-wise kernel) cannot
    compute this call, or None."""
    a, b, c, out_dtype = call.a, call.b, call.c, call.out_dtype
    n = b.shape[0]
    if c is not None and (call.beta != 1.0 or out_dtype not in FLOAT16 or c.numel() != n
                          or not (c.dim() == 1 or c.shape[0] == 1)):
        return "torch._scaled_mm adds a bias row with beta 1 only"
    if call.alpha != 1.0:
        return "torch._scaled_mm has no alpha"
    if a.shape[1] % 16 or n % 16 or a.shape[0] == 0 or not (a.is_contiguous() and b.is_contiguous()):
        return "torch._scaled_mm needs K and N multiples of 16 and contiguous operands"
    if _row_wise(call.scale_a, call.scale_b) and (out_dtype != torch.bfloat16 or a.dtype != torch.float8_e4m3fn
                                                  or b.dtype != a.dtype):
        return "torch._scaled_mm's row-wise scales take e4m3 x e4m3 to bfloat16 only"
    return None


def _scaled_mm_runner(call: _Call) -> Callable:
    """run(a, b, c, scale_a, scale_b) through torch._scaled_mm for calls of this one's signature
    (the native table's repeated calls run the same: csrc/torch/repeat_calls.cpp). The scales and
    bias are put in its forms when it runs, not when a call that runs our kernel asks."""
    m, n, out_dtype, fast_accum = call.a.shape[0], call.b.shape[0], call.out_dtype, call.fast_accum
    row_wise = _row_wise(call.scale_a, call.scale_b)

    def as_scale(s, shape, device):  # torch._scaled_mm's forms: 0-D per tensor; (M, 1) and (1, N) row-wise
        if s is None:
            s = torch.ones((), device=device, dtype=torch.float32)
        if not row_wise:
            return s.reshape(())
        return (s.reshape(1, 1).expand(shape) if s.numel() == 1 else s.reshape(shape)).contiguous()

    def run(a, b, c, scale_a, scale_b):
        bias = None if c is None else c.reshape(-1).to(out_dtype)
        return torch._scaled_mm(a, b.t(), as_scale(scale_a, (m, 1), a.device), as_scale(scale_b, (1, n), a.device),
                                bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return run


_SCALED_MM_CANDIDATE = Candidate(
    _SCALED_MM, lambda call: _scaled_mm_runner(call)(call.a, call.b, call.c, call.scale_a, call.scale_b),
    _scaled_mm_why_not, vendor=True)


@functools.lru_cache(maxsize=None)
def _config_names(a_dtype, b_dtype, out_dtype, b_k_major: bool, arch: int, fast_accum: bool = False) -> tuple:
    return tuple(ops.gemm_configs(a_dtype, b_dtype, out_dtype, b_k_major, arch, fast_accum))


@functools.lru_cache(maxsize=None)
def _candidates(a_dtype, b_dtype, kernel_dtype, b_k_major: bool, arch: int, fast_accum: bool) -> tuple:
    """A dense call's candidates: every compiled tile configuration for its dtypes, and the
    vendor call (cuBLAS for 16-bit inputs, torch._scaled_mm for float8)."""
    vendor = _CUBLAS_CANDIDATE if a_dtype in FLOAT16 else _SCALED_MM_CANDIDATE
    names = _config_names(a_dtype, b_dtype, kernel_dtype, b_k_major, arch, fast_accum)
    return configs(names, _run_config) + (vendor,)


def _problem_key(call: _Call, arch: int) -> str:
    """The autotuner's key of a dense call (the disk cache's: a change drops stored choices)."""
    a, b, c, m, n, k = call.a, call.b, call.c, call.a.shape[0], call.b.shape[0], call.a.shape[1]
    if a.dtype in FLOAT16:
        cublas_ok = _cublas_why_not(call) is None
        b_layout = "K" if _k_major(b) else "N" if b.stride(0) == 1 else "S"
        return f"sm{arch}|{m}x{n}x{k}|{a.dtype}->{call.out_dtype}|b:{b_layout}|c:{_c_form(c, m)}|cublas:{int(cublas_ok)}"
    scales = "row" if _row_wise(call.scale_a, call.scale_b) else "tensor"
    peer = _scaled_mm_why_not(call) is None
    return (f"sm{arch}|{m}x{n}x{k}|{a.dtype}x{b.dtype}->{call.out_dtype}|scales:{scales}|fast:{int(call.fast_accum)}"
            f"|c:{_c_form(c, m)}|peer:{int(peer)}")


def _c_form(c, m: int) -> str:
    """How the epilogue reads c, for the autotuner's keys: none, a full (M, N) c, or a bias row."""
    if c is None:
        return "none"
    return "full" if c.dim() == 2 and c.shape[0] == m and c.stride(0) != 0 else "bias"


# 128-block scales: our FP8 grouped kernel with one group, or cuBLAS's block-scaled GEMM.
def _capturing(t) -> bool:
    """Whether work on t's device is being captured into a CUDA graph now."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _one_group(a):
    """offs of one group of a's rows."""
    return torch.full((1,), a.shape[0], dtype=torch.int32, device=a.device)


def _block_ours(a, b, scale_a, scale_b, offs=None):
    from .grouped_fp8 import grouped_mm_fp8

    offs = _one_group(a) if offs is None else offs
    return grouped_mm_fp8(a, b.unsqueeze(0), offs, scale_x=scale_a, scale_w=scale_b.unsqueeze(0))


def _block_peer(a, b, scale_a, scale_b):
    from ._torch_block_scaled import cublas_scale_a, cublas_scale_b, scaled_mm_block

    return scaled_mm_block(a.contiguous(), b.contiguous().t(), cublas_scale_a(scale_a), cublas_scale_b(scale_b))


def _block_peer_why_not(call: _Call) -> Optional[str]:
    a, b = call.a, call.b
    if not call.arch or a.dtype != torch.float8_e4m3fn or b.dtype != a.dtype:
        return "F.scaled_mm's block scales take e4m3 on sm_90 and later"
    if a.shape[1] % 16 or b.shape[0] % 16 or a.shape[0] == 0:
        return "F.scaled_mm needs K and N multiples of 16 and at least one row"
    return None


def _scaled_by(out, alpha):
    return out if alpha == 1.0 else (out.float() * alpha).to(out.dtype)


_BLOCK_CANDIDATES = (
    Candidate(_OURS_BLOCK, lambda call: _scaled_by(_block_ours(call.a, call.b, call.scale_a, call.scale_b), call.alpha)),
    Candidate(_TORCH_BLOCK, lambda call: _scaled_by(_block_peer(call.a, call.b, call.scale_a, call.scale_b),
                                                    call.alpha), _block_peer_why_not, vendor=True),
)


def _block_scaled_gemm(call: _Call):
    """128-block-scaled a @ b.T in bfloat16: cuBLAS's block-scaled GEMM where the autotuner
    timed it faster for this shape, else our FP8 grouped kernel with one group."""
    a, b = call.a, call.b
    if _DISPATCH.active() and _block_peer_why_not(call) is not None:  # ours alone: nothing to choose
        return _run(call, _BLOCK_CANDIDATES[0])
    chosen = None
    if _DISPATCH.active():
        m, k, n = a.shape[0], a.shape[1], b.shape[0]
        # torch's version in the key: a cached choice of F.scaled_mm must not outlive the torch
        # that took the call (its block-scaled API is recent).
        key = f"sm{call.arch}|{m}x{n}x{k}|{a.dtype}x{b.dtype}->bf16|scales:block|torch:{torch.__version__}"
        chosen = _DISPATCH.choose(key, call, _BLOCK_CANDIDATES, a.device)
    if chosen is None:  # nothing to remember: autotuning off, tracing, or capture of an untimed shape
        _DISPATCH.record(_OURS_BLOCK)
        return _BLOCK_CANDIDATES[0].run(call)
    return _run(call, chosen)


def gemm_unchecked(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, arch: int, *,
                   looked_up=False):
    """gemm for arguments check_operands accepted, without autograd. A call the autotuner settled
    before runs its remembered choice (every caller: gemm, its autograd, the modules, the TP
    fallback); `arch`: kernel_arch of a's device, read once by the caller; `looked_up`: gemm
    already looked for it."""
    unscaled = scale_a is None and scale_b is None
    scaled = scale_a is not None and scale_b is not None
    compiling = _is_compiling()
    if not looked_up and unscaled and not fast_accum and not compiling:
        out = _repeat_gemm(a, b, c, alpha, beta, out_dtype)
        if out is not None:
            return out
    signature = None if compiling or not (unscaled or scaled) else _NATIVE
    if scaled and block_scales(a, b, scale_a, scale_b):
        # Remembered for bfloat16 out without c only: gemm refuses others, but looks its table up
        # before its checks. The TP ops pass a c, which these kernels have no epilogue for.
        if signature is not None and out_dtype == torch.bfloat16 and c is None:
            signature = _scaled_signature(a, b, c, alpha, beta, out_dtype, (scale_a, scale_b, fast_accum))
        else:
            signature = None
        call = _Call(a, b, None, alpha, beta, torch.bfloat16, scale_a, scale_b, fast_accum, None, arch, signature)
        out = _block_scaled_gemm(call)
        if c is not None and beta != 0:
            out = out.float() + beta * c.float().reshape(-1, b.shape[0])
        return out if out.dtype == out_dtype else out.to(out_dtype)  # float32: TP's partial sums
    if a.shape[1] == 0 or not arch:
        if a.device.type == "cuda" and a.shape[1] > 0:
            warn_once(f"distgemm: no CUTLASS kernels for {torch.cuda.get_device_name(a.device)}; "
                      "running the PyTorch reference")
        return reference_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b)
    kernel_dtype, fast = kernel_out_dtype(a.dtype, b.dtype, out_dtype, arch, fast_accum)
    if kernel_dtype is None:
        warn_once(f"distgemm: no kernel in this build for {a.dtype} x {b.dtype} -> {out_dtype} (nor float32 "
                  "out); running the PyTorch reference")
        return reference_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b)
    call = _Call(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast, kernel_dtype, arch, signature, fast_accum)
    # 16-bit calls are tuned where the kernel gives out_dtype itself (the key does not name a cast).
    if (a.dtype in FLOAT8 or kernel_dtype == out_dtype) and _DISPATCH.active():
        candidates = _candidates(a.dtype, b.dtype, kernel_dtype, _k_major(call.kb), arch, fast)
        chosen = _DISPATCH.choose(_problem_key(call, arch), call, candidates, a.device)
        if chosen is not None:
            return _run(call, chosen)
    _DISPATCH.record("cutlass")
    return _run_config(call, -1)


def _trim(out, n: int, kernel_dtype, out_dtype):
    """A kernel's output as the caller asked for it: the N columns padding added dropped, cast
    where the kernel ran in another dtype."""
    out = out if out.shape[1] == n else out[:, :n].contiguous()
    return out if kernel_dtype == out_dtype else out.to(out_dtype)


def _compiled_combinations() -> frozenset:
    """(arch, a, b, out, fast_accum) of every K-major kernel in this build, read once at import
    so that torch.compile traces a plain set lookup."""
    dtypes = FLOAT16 + FLOAT8 + (torch.float32,)
    return frozenset((arch, a, b, out, fast) for arch in (90, 100) for a in FLOAT16 + FLOAT8
                     for b in FLOAT16 + FLOAT8 for out in dtypes for fast in (False, True)
                     if ops.gemm_configs(a, b, out, True, arch, fast))


_COMPILED = _compiled_combinations()
# (arch, dtype, out) of the 16-bit kernels that read b N-major (its transpose view) in place.
_N_MAJOR = frozenset((arch, t, out) for arch in (90, 100) for t in FLOAT16 for out in FLOAT16 + (torch.float32,)
                     if ops.gemm_configs(t, t, out, False, arch, False))


def kernel_out_dtype(a_dtype, b_dtype, out_dtype, arch: int,
                     fast_accum: bool) -> Tuple[Optional[torch.dtype], bool]:
    """The output dtype and accumulation to run the kernel in: out_dtype when compiled, else
    float32 (float8 combinations with fewer instances), the result then being cast; None when
    neither is built (a narrower type in between would lose precision). Fast accumulation is a
    speed hint, so a combination built only with promoted accumulation runs that (more
    accurate)."""
    for fast in (fast_accum, False) if fast_accum else (False,):
        for candidate in (out_dtype, torch.float32):
            if (arch, a_dtype, b_dtype, candidate, fast) in _COMPILED:
                return candidate, fast
    return None, fast_accum


def _flat(scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A scale as the kernels read it: 1-D, contiguous and 16-byte aligned."""
    return None if scale is None else aligned16(scale.reshape(-1).contiguous())




def _pad_to(x: int, elems: int) -> int:
    return -x % elems


def _kernel_operands(a, b, c, out_dtype, scale_b, arch: int):
    """Copies or pads what the kernels cannot read in place (a fallback, not a fast path):
    operands that are neither K-major nor (16-bit b) N-major, K or N not a multiple of 16
    bytes (zero padding leaves the product unchanged)."""
    n = b.shape[0]
    if c is None and scale_b is None and kernel_ready(a, b, out_dtype, arch):
        return a, b, None, None, n  # the common case: nothing to copy or pad
    k_pad = _pad_to(a.shape[1], 16 // a.element_size())
    n_pad = _pad_to(n, max(16 // out_dtype.itemsize,
                           16 // b.element_size() if b.stride(0) == 1 and b.stride(1) != 1 else 1))
    if k_pad:
        a = F.pad(a, (0, k_pad))
        b = F.pad(b, (0, k_pad))
    if not _k_major(a):
        a = a.contiguous()
    if not (_k_major(b) or _n_major_readable(b, out_dtype, arch)):
        b = b.contiguous()
    if c is not None:
        c = c.to(out_dtype)
        if c.dim() == 2 and c.shape[0] == a.shape[0] and c.stride(0) == 0:
            c = c[0]  # an expanded row is a bias
        if c.dim() == 2 and c.shape[0] == 1 and a.shape[0] != 1:
            c = c[0]
        if not (_k_major(c) if c.dim() == 2 else c.stride(0) == 1):
            c = c.contiguous()
    if n_pad:
        b = F.pad(b, (0, 0, 0, n_pad))
        if c is not None:
            c = F.pad(c, (0, n_pad))
        if scale_b is not None and scale_b.numel() > 1:
            scale_b = F.pad(scale_b.reshape(-1), (0, n_pad), value=1.0)
    return a, b, c, _flat(scale_b), n


def kernel_ready(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, arch: int) -> bool:
    """True when the kernels read a and b in place (no copy or padding by _kernel_operands)."""
    out_bytes = out_dtype.itemsize
    return (a.shape[1] * a.element_size() % 16 == 0 and b.shape[0] * out_bytes % 16 == 0
            and _k_major(a) and (_k_major(b) or _n_major_readable(b, out_dtype, arch)))


def _n_major_readable(b: torch.Tensor, out_dtype: torch.dtype, arch: int) -> bool:
    """b N-major (a transposed view) with a kernel built for that layout and output."""
    return (b.dtype in FLOAT16 and _n_major(b) and b.shape[0] * b.element_size() % 16 == 0
            and (arch, b.dtype, out_dtype) in _N_MAJOR)


def _k_major(t: torch.Tensor) -> bool:
    """Row-major with a 16-byte multiple row pitch."""
    return t.stride(1) == 1 and (t.shape[0] == 1 or
                                 (t.stride(0) >= t.shape[1] and t.stride(0) * t.element_size() % 16 == 0))


def _n_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) >= t.shape[0] and t.stride(1) * t.element_size() % 16 == 0


def reference_gemm(a, b, c, alpha, beta, out_dtype, scale_a=None, scale_b=None):
    """The same math in plain PyTorch, FP32 accumulation (CPU tensors, other GPUs, tests)."""
    acc = a.float() @ b.float().T
    if scale_a is not None:
        acc = acc * scale_a.float().reshape(-1, 1)
    if scale_b is not None:
        acc = acc * scale_b.float().reshape(1, -1)
    out = alpha * acc
    if c is not None and beta != 0:  # as BLAS and our kernels: beta = 0 does not read c (NaN in c stays out)
        out = out + beta * c.float().reshape(-1, b.shape[0])
    return out.to(out_dtype)


def grad_of_c(grad: torch.Tensor, beta: float, shape, dtype) -> torch.Tensor:
    """d/dc of beta * c broadcast to grad's shape: grad itself, or summed over rows (bias)."""
    g = grad.float() * beta
    if not (len(shape) == 2 and shape[0] == grad.shape[0]):
        g = g.sum(0)
    return g.reshape(shape).to(dtype)


class _GemmFunction(torch.autograd.Function):
    """Autograd of gemm: dA = alpha * dD @ B (distgemm, B read N-major in place),
    dB = alpha * dD^T @ A (cuBLAS), dC = beta * dD (summed over rows for a bias)."""

    @staticmethod
    def forward(ctx, a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, arch):
        if a.dtype in FLOAT8 and (a.requires_grad or b.requires_grad):
            raise NotImplementedError("distgemm.gemm: autograd through float8 inputs is not supported")
        ctx.save_for_backward(a, b)
        ctx.alpha, ctx.beta, ctx.arch = alpha, beta, arch
        ctx.c_meta = None if c is None else (c.shape, c.dtype)
        return gemm_unchecked(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, arch)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = grad_b = grad_c = None
        g = grad.to(a.dtype)
        if ctx.needs_input_grad[0]:
            grad_a = gemm_unchecked(g, b.T, None, ctx.alpha, 0.0, a.dtype, None, None, False, ctx.arch)
        if ctx.needs_input_grad[1]:
            grad_b = torch.matmul(g.T, a)
            if ctx.alpha != 1.0:
                grad_b = grad_b * ctx.alpha
        if ctx.needs_input_grad[2] and ctx.c_meta is not None:
            grad_c = grad_of_c(grad, ctx.beta, *ctx.c_meta)
        return grad_a, grad_b, grad_c, None, None, None, None, None, None, None


# ---------------------------------------------------------------- op registration


@torch.library.register_fake("distgemm::gemm")
def _gemm_fake(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum=False, config=-1, swizzle=0):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.register_kernel("distgemm::gemm", "cpu")
def _gemm_cpu(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum=False, config=-1, swizzle=0):
    return reference_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b)
