"""Tensor-parallel GEMMs whose all-gather / reduce-scatter is hidden under the GEMM.

One process per GPU (torchrun), a ``torch.distributed`` process group per tensor-parallel
group. On NVLink-connected sm_90 GPUs with an NCCL group the ranks share peer-mapped
workspaces (PyTorch symmetric memory, NVLink multicast off) and the GEMM waits, tile row by
tile row, for the copy engine's transfers (all-gather) or for the previous rank's partial
sums (reduce-scatter ring). Elsewhere (gloo, CPU tensors, other GPUs, or
``DISTGEMM_TP_BACKEND=collectives``) the same ops run as the group's collectives plus a GEMM.

Every wait on another GPU is bounded by ``DISTGEMM_TIMEOUT_S`` (default 60 s). A timeout is
recorded on the device and raised (naming the op and the ranks) by the next call, or by
:func:`check_errors`.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ._library import device_arch, has_kernels, ops, warn_once
from .dense import FLOAT8, check_operands, gemm_unchecked, grad_of_c, kernel_ready

# distgemm never uses NVLink multicast: symmetric memory must not create multicast objects.
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

_AG, _RS = 1, 2
_OP_NAMES = {_AG: "distgemm.all_gather_matmul", _RS: "distgemm.matmul_reduce_scatter"}
_BACKENDS = ("auto", "fused", "collectives")
_ALGOS = {"auto": 0, "fused": 1, "decomposed": 2}  # dg_tp_algo


def timeout_s() -> float:
    value = os.environ.get("DISTGEMM_TIMEOUT_S", "60")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"DISTGEMM_TIMEOUT_S must be a positive number of seconds, got {value!r}")
    return seconds


def check_errors(device: Optional[torch.device] = None) -> None:
    """Raises RuntimeError if a tensor-parallel wait on `device` (default: current) timed out.
    Reads mapped host memory: it does not synchronize. After a timeout the group's state is
    undefined; training should stop."""
    if not torch.cuda.is_available():
        return
    _raise_on_error_word(torch.cuda.current_device() if device is None else torch.device(device).index)


def _raise_on_error_word(index: int) -> None:
    code = ops.tp_error(index)
    if code:
        kind, peer = code >> 16, (code & 0xFFFF) - 1
        raise RuntimeError(
            f"{_OP_NAMES.get(kind, 'distgemm')}: rank on cuda:{index} waited more than "
            f"DISTGEMM_TIMEOUT_S={timeout_s():g} s for group rank {peer}, which never arrived "
            "(died, hung, or called with other shapes); outputs since then are invalid")


# ---------------------------------------------------------------- workspaces


class _Workspace:
    """A symmetric allocation of every rank of a group, zeroed and mapped by all of them."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.nbytes = nbytes
        self.tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.tensor.zero_()
        self.handle = symm_mem.rendezvous(self.tensor, group)
        self.ptrs = [int(p) for p in self.handle.buffer_ptrs]
        self.handle.barrier()  # every rank's flags are zero before anyone signals


class _GroupInfo(NamedTuple):
    name: str
    size: int
    rank: int


_group_infos: dict = {}    # ProcessGroup -> _GroupInfo (read once: every call needs them)


def _info(group: dist.ProcessGroup) -> _GroupInfo:
    info = _group_infos.get(group)
    if info is None:
        info = _group_infos[group] = _GroupInfo(group.group_name, group.size(), group.rank())
    return info


_workspaces: dict = {}     # (group name, kind) -> _Workspace
_fused_ok: dict = {}       # group name -> bool, agreed by all ranks
_shapes_checked: set = set()


def _backend() -> str:
    value = os.environ.get("DISTGEMM_TP_BACKEND", "auto").lower()
    if value not in _BACKENDS:
        raise ValueError(f"DISTGEMM_TP_BACKEND must be one of {_BACKENDS}, got {value!r}")
    return value


def _algo() -> int:
    """DISTGEMM_TP_ALGO: how the fused backend hides the communication. `fused`: one CUTLASS
    GEMM per ring step waiting on per-tile-row flags; `decomposed`: one cuBLASLt GEMM per chunk
    piece after a bounded wait for it (bf16/fp16); `auto` (default): decomposed where it
    applies, except reduce-scatters of under ~50 GFLOP per rank."""
    value = os.environ.get("DISTGEMM_TP_ALGO", "auto").lower()
    if value not in _ALGOS:
        raise ValueError(f"DISTGEMM_TP_ALGO must be one of {tuple(_ALGOS)}, got {value!r}")
    return _ALGOS[value]


def _use_fused(group: dist.ProcessGroup, device: torch.device) -> bool:
    """The fused path needs NCCL, sm_90 kernels on every rank and peer-mappable memory; all
    ranks decide together (a collective, once per group)."""
    if _backend() == "collectives":
        return False
    name = _info(group).name
    if name not in _fused_ok:
        local = (device.type == "cuda" and dist.get_backend(group) == "nccl" and has_kernels(device)
                 and device_arch(device) == 90 and _info(group).size <= 64)
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        _fused_ok[name] = bool(flag.item())
        if not _fused_ok[name] and _backend() == "fused":
            warn_once("distgemm: DISTGEMM_TP_BACKEND=fused needs NCCL and sm_90 GPUs on every rank; "
                      "using collectives + GEMM")
    return _fused_ok[name]


def _check_same_on_all_ranks(group, op: str, key: tuple) -> None:
    """On the first call with a shape, every rank must have passed the same one."""
    full = (_info(group).name, op, key)
    if full in _shapes_checked:
        return
    keys = [None] * group.size()
    dist.all_gather_object(keys, key, group=group)
    if any(k != key for k in keys):
        detail = "; ".join(f"rank {r}: {k}" for r, k in enumerate(keys))
        raise ValueError(f"{op}: ranks passed different shapes or dtypes: {detail}")
    _shapes_checked.add(full)


def _workspace(group, kind: int, nbytes: int, device) -> _Workspace:
    key = (_info(group).name, kind)
    ws = _workspaces.get(key)
    if ws is None or ws.nbytes < nbytes:
        if ws is not None:  # grow: all ranks are here; let in-flight work finish first
            torch.cuda.synchronize(device)
            dist.barrier(group=group)
        ws = _Workspace(group, max(nbytes, int(1.25 * (ws.nbytes if ws else 0))), device)
        _workspaces[key] = ws
    return ws


def _resolve(group) -> dist.ProcessGroup:
    if group is None:
        if not dist.is_initialized():
            raise ValueError("distgemm: torch.distributed is not initialized (and no group was given)")
        return dist.group.WORLD
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    return group


# ---------------------------------------------------------------- fused ops (custom ops)


def _fused_all_gather_matmul(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group,
                             return_gathered):
    _, world, rank = _info(group)
    nbytes = _workspace_bytes(_AG, a.shape[0], a.shape[1], b.shape[0], a.dtype, out_dtype, world)
    ws = _workspace(group, _AG, nbytes, a.device)
    return ops.tp_all_gather_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, rank,
                                  world, ws.ptrs, ws.nbytes, timeout_s(), return_gathered, _algo())


def _fused_matmul_reduce_scatter(a, b, bias, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group):
    _, world, rank = _info(group)
    nbytes = _workspace_bytes(_RS, a.shape[0] // world, a.shape[1], b.shape[0], a.dtype, out_dtype, world)
    ws = _workspace(group, _RS, nbytes, a.device)
    return ops.tp_gemm_reduce_scatter(a, b, bias, alpha, beta, out_dtype, scale_a, scale_b, fast_accum,
                                      rank, world, ws.ptrs, ws.nbytes, timeout_s(), _algo())


@functools.lru_cache(maxsize=256)
def _workspace_bytes(kind, rows, k, n, in_dtype, out_dtype, world) -> int:
    return ops.tp_workspace_size(kind, rows, k, n, in_dtype, out_dtype, world)


# What torch.compile sees: one opaque op around the eager implementation (its first-call
# checks and workspace set-up synchronize the group, which a traced graph cannot).
@torch.library.custom_op("distgemm::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], alpha: float,
                          beta: float, out_dtype: torch.dtype, scale_a: Optional[torch.Tensor],
                          scale_b: Optional[torch.Tensor], fast_accum: bool, group_name: str,
                          return_gathered: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    out, gathered = _all_gather_matmul_eager(a, b, c, alpha, beta, out_dtype, scale_a, scale_b,
                                             fast_accum, _resolve(group_name), return_gathered)
    return out, (gathered if gathered is not None else a.new_empty((0,)))


@_all_gather_matmul_op.register_fake
def _(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group_name, return_gathered):
    world = _resolve(group_name).size()
    gathered = a.new_empty((a.shape[0] * world, a.shape[1]) if return_gathered else (0,))
    return a.new_empty((a.shape[0] * world, b.shape[0]), dtype=out_dtype), gathered


@torch.library.custom_op("distgemm::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor],
                              alpha: float, beta: float, out_dtype: torch.dtype,
                              scale_a: Optional[torch.Tensor], scale_b: Optional[torch.Tensor],
                              fast_accum: bool, group_name: str) -> torch.Tensor:
    return _matmul_reduce_scatter_eager(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum,
                                        _resolve(group_name))


@_matmul_reduce_scatter_op.register_fake
def _(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group_name):
    world = _resolve(group_name).size()
    return a.new_empty((a.shape[0] // world, b.shape[0]), dtype=out_dtype)


# ---------------------------------------------------------------- collectives fallback


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    raw = x.view(torch.uint8)  # gloo moves bytes of any dtype, but not bf16/fp8 as such
    parts = [torch.empty_like(raw) for _ in range(group.size())]
    dist.all_gather(parts, raw, group=group)
    return torch.cat(parts).view(x.dtype)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    world = group.size()
    if dist.get_backend(group) == "nccl":
        out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out
    total = x.clone()  # gloo has no reduce-scatter: all-reduce and keep this rank's rows
    dist.all_reduce(total, group=group)
    return total.chunk(world)[group.rank()].contiguous()


def _gathered_scale_a(scale_a, rows: int, group) -> Optional[torch.Tensor]:
    """Each rank's scale_a (one value or one per row of its shard) as M row-wise values."""
    if scale_a is None:
        return None
    return _all_gather(scale_a.reshape(-1).float().expand(rows).contiguous(), group)


# ---------------------------------------------------------------- public ops


def _scaled_bias(c, beta, out_dtype):
    """(c, beta) for the fused ops: a bias ((N,) or (1, N)) comes pre-multiplied by beta, with
    beta 1 (the decomposed algorithm adds a bias unscaled); a full C keeps its beta."""
    if c is None or beta == 0.0:
        return None, 0.0
    if c.dim() == 2 and c.shape[0] != 1:
        return c.to(out_dtype), beta
    return (c.reshape(-1).float() * beta).to(out_dtype), 1.0


def _check_tp(op, a, b, c, out_dtype, scale_a, scale_b, c_rows: int):
    out_dtype = check_operands(op, a, b, None, out_dtype, scale_a, scale_b)
    n = b.shape[0]
    if c is not None:
        if not isinstance(c, torch.Tensor) or not c.is_floating_point() or c.device != a.device:
            raise ValueError(f"{op}: c must be a floating-point tensor on {a.device}")
        if tuple(c.shape) not in ((c_rows, n), (n,), (1, n)):
            raise ValueError(f"{op}: c must have shape ({c_rows}, {n}) or be a bias of shape ({n},), "
                             f"got {tuple(c.shape)}")
    return out_dtype


def _all_gather_matmul(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group,
                       return_gathered):
    """Forward of all_gather_matmul without autograd; returns (out, gathered or None)."""
    if _info(group).size > 1 and torch.compiler.is_compiling():
        out, gathered = _all_gather_matmul_op(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum,
                                              _info(group).name, return_gathered)
        return out, (gathered if return_gathered else None)
    return _all_gather_matmul_eager(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group,
                                    return_gathered)


def _all_gather_matmul_eager(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group,
                             return_gathered):
    world = _info(group).size
    if world == 1:
        out = gemm_unchecked(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum)
        return out, (a if return_gathered else None)
    if a.is_cuda:
        _raise_on_error_word(a.get_device())
    _check_same_on_all_ranks(group, _OP_NAMES[_AG], (tuple(a.shape), tuple(b.shape), str(a.dtype),
                                                     str(out_dtype), scale_a is not None))
    a = a.contiguous()
    if _use_fused(group, a.device) and kernel_ready(a, b, out_dtype):
        bias_or_c, beta = _scaled_bias(c, beta, out_dtype)
        out, gathered = _fused_all_gather_matmul(a, b, bias_or_c, alpha, beta, out_dtype, scale_a, scale_b,
                                                 fast_accum, group, return_gathered)
        return out, (gathered if return_gathered else None)
    gathered = _all_gather(a, group)
    out = gemm_unchecked(gathered, b, c, alpha, beta, out_dtype,
                         _gathered_scale_a(scale_a, a.shape[0], group), scale_b, fast_accum)
    return out, (gathered if return_gathered else None)


def _matmul_reduce_scatter(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group):
    if _info(group).size > 1 and torch.compiler.is_compiling():
        return _matmul_reduce_scatter_op(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum,
                                         _info(group).name)
    return _matmul_reduce_scatter_eager(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group)


def _matmul_reduce_scatter_eager(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group):
    world = _info(group).size
    if world == 1:
        return gemm_unchecked(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum)
    if a.is_cuda:
        _raise_on_error_word(a.get_device())
    full_c = c is not None and c.dim() == 2 and c.shape[0] != 1
    bias = None if c is None or full_c else c.reshape(-1)
    _check_same_on_all_ranks(group, _OP_NAMES[_RS], (tuple(a.shape), tuple(b.shape), str(a.dtype),
                                                     str(out_dtype), scale_a is not None))
    a = a.contiguous()
    if _use_fused(group, a.device) and kernel_ready(a, b, out_dtype):
        scaled, bias_beta = _scaled_bias(bias, beta, out_dtype)
        out = _fused_matmul_reduce_scatter(a, b, scaled, alpha, bias_beta, out_dtype, scale_a, scale_b,
                                           fast_accum, group)
    else:
        partial = gemm_unchecked(a, b, None, alpha, 0.0, torch.float32, scale_a, scale_b, fast_accum)
        out = _reduce_scatter(partial, group)
        if bias is not None:
            out = out + beta * bias.to(out_dtype).float()
        out = out.to(out_dtype)
    if full_c:  # a full C is this rank's output shard: added after the reduction
        out = (out.float() + beta * c.float()).to(out_dtype)
    return out


class _AllGatherMatmul(torch.autograd.Function):
    """Backward: dA = reduce_scatter(dOut @ B) (GEMM + reduce-scatter, overlapped), dB =
    dOut^T @ allgather(A) (local), dC = beta * dOut."""

    @staticmethod
    def forward(ctx, a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group, return_gathered):
        out, gathered = _all_gather_matmul(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum,
                                           group, True)
        ctx.save_for_backward(b, gathered)
        ctx.alpha, ctx.beta, ctx.group = alpha, beta, group
        ctx.c_meta = None if c is None else (c.shape, c.dtype)
        ctx.a_dtype = a.dtype
        return (out, gathered) if return_gathered else (out, None)

    @staticmethod
    def backward(ctx, grad, grad_gathered):
        b, gathered = ctx.saved_tensors
        g = grad.to(ctx.a_dtype)
        grad_a = grad_b = grad_c = None
        if ctx.needs_input_grad[0]:
            grad_a = _matmul_reduce_scatter(g, b.T, None, ctx.alpha, 0.0, ctx.a_dtype, None, None, False,
                                            ctx.group)
            if grad_gathered is not None:
                grad_a = grad_a + _reduce_scatter(grad_gathered.float(), ctx.group).to(ctx.a_dtype)
        if ctx.needs_input_grad[1]:
            grad_b = torch.matmul(g.T, gathered) * ctx.alpha
        if ctx.needs_input_grad[2] and ctx.c_meta is not None:
            grad_c = grad_of_c(grad, ctx.beta, *ctx.c_meta)
        return grad_a, grad_b, grad_c, None, None, None, None, None, None, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    """Backward: dA = allgather(dOut) @ B (all-gather + GEMM, overlapped), dB =
    allgather(dOut)^T @ A (local), dC = beta * dOut."""

    @staticmethod
    def forward(ctx, a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group):
        ctx.save_for_backward(a, b)
        ctx.alpha, ctx.beta, ctx.group = alpha, beta, group
        ctx.c_meta = None if c is None else (c.shape, c.dtype)
        return _matmul_reduce_scatter(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        g = grad.to(a.dtype).contiguous()
        grad_a, gathered = _all_gather_matmul(g, b.T, None, ctx.alpha, 0.0, a.dtype, None, None, False,
                                              ctx.group, True)
        grad_b = torch.matmul(gathered.T, a) * ctx.alpha if ctx.needs_input_grad[1] else None
        grad_c = None
        if ctx.needs_input_grad[2] and ctx.c_meta is not None:
            grad_c = grad_of_c(grad, ctx.beta, *ctx.c_meta)
        return grad_a, grad_b, grad_c, None, None, None, None, None, None, None


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def all_gather_matmul(a: torch.Tensor, b: torch.Tensor, *, group=None, c: Optional[torch.Tensor] = None,
                      alpha: float = 1.0, beta: float = 0.0, out_dtype: Optional[torch.dtype] = None,
                      scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
                      return_gathered: bool = False, use_fast_accum: bool = False):
    """``alpha * allgather(a) @ b.T + beta * c`` with the all-gather hidden under the GEMM.

    a: (M/P, K), this rank's rows (any M/P); b: (N_local, K) this rank's weight shard;
    c: (M, N_local) or a bias (N_local,). Returns (M, N_local), and allgather(a) too with
    ``return_gathered``. float8 inputs take scale_a (1 or M/P values, this shard's) and
    scale_b as in :func:`distgemm.gemm`. Differentiable for bfloat16/float16.
    """
    op = _OP_NAMES[_AG]
    group = _resolve(group)
    out_dtype = _check_tp(op, a, b, c, out_dtype, scale_a, scale_b, a.shape[0] * _info(group).size)
    if _needs_grad(a, b, c):
        if a.dtype in FLOAT8:
            raise NotImplementedError(f"{op}: autograd through float8 inputs is not supported")
        out, gathered = _AllGatherMatmul.apply(a, b, c, alpha, beta, out_dtype, scale_a, scale_b,
                                               use_fast_accum, group, return_gathered)
    else:
        out, gathered = _all_gather_matmul(a, b, c, alpha, beta, out_dtype, scale_a, scale_b,
                                           use_fast_accum, group, return_gathered)
    return (out, gathered) if return_gathered else out


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, *, group=None, c: Optional[torch.Tensor] = None,
                          alpha: float = 1.0, beta: float = 0.0, out_dtype: Optional[torch.dtype] = None,
                          scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
                          use_fast_accum: bool = False) -> torch.Tensor:
    """This rank's rows of ``sum_ranks(alpha * a @ b.T)``, plus ``beta * c``, with the
    reduce-scatter hidden under the GEMM.

    a: (M, K_local), b: (N, K_local) this rank's shards; M must divide by the group size P.
    c: this rank's (M/P, N) output rows or a bias (N,). Returns (M/P, N).
    """
    op = _OP_NAMES[_RS]
    group = _resolve(group)
    world = _info(group).size
    if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[0] % world:
        raise ValueError(f"{op}: a's {a.shape[0]} rows must divide evenly by the group size {world}")
    out_dtype = _check_tp(op, a, b, c, out_dtype, scale_a, scale_b, a.shape[0] // world)
    if _needs_grad(a, b, c):
        if a.dtype in FLOAT8:
            raise NotImplementedError(f"{op}: autograd through float8 inputs is not supported")
        return _MatmulReduceScatter.apply(a, b, c, alpha, beta, out_dtype, scale_a, scale_b,
                                          use_fast_accum, group)
    return _matmul_reduce_scatter(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, use_fast_accum, group)


def dist_matmul(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor] = None, alpha: float = 1.0,
                beta: float = 0.0, *, group=None) -> torch.Tensor:
    """The seed's op, in its argument order: ``alpha * allgather(a) @ b.T + beta * c`` over
    ``group`` (the default group when None); see :func:`all_gather_matmul`."""
    return all_gather_matmul(a, b, group=group, c=c, alpha=alpha, beta=beta)
