"""Tensor-parallel GEMMs whose all-gather / reduce-scatter is hidden under the GEMM.

One process per GPU (torchrun), a ``torch.distributed`` process group per tensor-parallel
group. On NVLink-connected sm_90 GPUs with an NCCL group the ranks share peer-mapped
workspaces (PyTorch symmetric memory, NVLink multicast off) and the GEMM waits, tile row by
tile row, for the copy engine's transfers (all-gather) or for the previous rank's partial
sums (reduce-scatter ring). Elsewhere (gloo, CPU tensors, other GPUs, or
``DISTGEMM_TP_BACKEND=collectives``) the same ops run as the group's collectives plus a GEMM.

Every wait on another GPU is bounded by ``DISTGEMM_TIMEOUT_S`` (default 600 s, NCCL's own
default). The ranks check on every call, on the GPU, that they run the same call (shapes,
dtypes, settings, call count). A call whose wait times out or whose ranks disagree hands back
NaN, and the error is raised by the next call on that device (``TimeoutError``, or
``ValueError`` for a disagreement) or by :func:`check_errors`. From then on the group's calls
raise until every rank calls :func:`recover`.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import threading
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from . import _settings
from ._checks import FLOAT8, block_scales, check_flags, check_scalars, check_tp_operands
from ._library import aligned16, kernel_arch, ops, warn_once
from .dense import _config_names, _flat, gemm_unchecked, grad_of_c, kernel_out_dtype, kernel_ready

# distgemm never uses NVLink multicast: symmetric memory must not create multicast objects.
_settings.set_environment({"TORCH_SYMM_MEM_DISABLE_MULTICAST": _settings.MULTICAST_OFF["TORCH_SYMM_MEM_DISABLE_MULTICAST"]})

_AG, _RS = 1, 2
_OP_NAMES = {_AG: "distgemm.all_gather_matmul", _RS: "distgemm.matmul_reduce_scatter"}
_ALGOS = {"auto": 0, "fused": 1, "decomposed": 2}  # dg_tp_algo

# Error word (see csrc/tp/tp_kernels.cuh): reason << 24 | op << 16 | (peer + 1).
_REASON_PEER_FAILED = 8
_REASONS = {
    1: "is at another call (the ranks' call counts differ: an earlier call failed or was skipped on one side)",
    2: "runs another op, algorithm or piece split (DISTGEMM_TP_ALGO, DISTGEMM_TP_PIECES and "
       "DISTGEMM_RS_SPLIT_GFLOPS must match on every rank)",
    3: "passed another number of rows",
    4: "passed another K (all-gather) or N (reduce-scatter)",
    5: "passed other dtypes or FP8 scale modes",
    6: "has another group size",
    7: "runs the call elsewhere than this rank (one through the collectives fallback: dtypes, or a K or N, that "
       "the fused kernels cannot take, or DISTGEMM_TP_BACKEND=collectives; the other on the fused path)",
}


def timeout_s() -> float:
    """How long a call waits on a peer (``distgemm.settings(timeout_s=...)``, DISTGEMM_TIMEOUT_S)."""
    return _settings.current().timeout_s


def check_errors(device: Optional[torch.device] = None) -> None:
    """Raises if a tensor-parallel call on `device` (default: current) failed: TimeoutError when
    a wait on a peer ran past DISTGEMM_TIMEOUT_S, ValueError when the ranks disagreed. Reads
    mapped host memory without synchronizing: synchronize first to include calls in flight.
    The failed call's outputs were filled with NaN; :func:`recover` re-synchronises the group."""
    if not torch.cuda.is_available():
        return
    _raise_on_error_word(torch.cuda.current_device() if device is None else torch.device(device).index)


def _raise_on_error_word(index: int) -> None:
    code = ops.tp_error(index)
    if code:
        _raise_for_code(code, index)


def _raise_for_code(code: int, index: int) -> None:
    reason, kind, peer = code >> 24, (code >> 16) & 0xFF, (code & 0xFFFF) - 1
    op = _OP_NAMES.get(kind, "distgemm")
    after = ("; that call's outputs were filled with NaN, and every tensor-parallel call on this device "
             "raises until every rank of the group calls distgemm.recover(group)")
    if reason == 0:
        raise TimeoutError(f"{op}: rank on cuda:{index} waited more than DISTGEMM_TIMEOUT_S={timeout_s():g} s for "
                           f"group rank {peer}, which never arrived (died, hung, or was not in the call){after}")
    if reason == _REASON_PEER_FAILED:
        raise TimeoutError(f"{op}: group rank {peer} had given up on the call of the rank on cuda:{index} (it "
                           f"waited more than DISTGEMM_TIMEOUT_S={timeout_s():g} s for it, or an earlier call of "
                           f"its failed), so this rank did not read what that rank still wrote{after}")
    raise ValueError(f"{op}: the ranks disagree: group rank {peer} {_REASONS.get(reason, 'differs')} "
                     f"(seen by the rank on cuda:{index}){after}")


# ---------------------------------------------------------------- group state and workspaces


class _Workspace:
    """A symmetric allocation of every rank of a group (the same size on all of them, so that
    what a rank writes into a peer stays inside the peer's allocation), zeroed and mapped."""

    def __init__(self, state: "_GroupState", nbytes: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.nbytes = nbytes
        self.captured = False  # used by a CUDA graph capture: kept alive for its replays
        self.tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.tensor.zero_()
        self.handle = symm_mem.rendezvous(self.tensor, state.group)
        self.ptrs = [int(p) for p in self.handle.buffer_ptrs]
        torch.cuda.synchronize(device)
        state.exchange("zeroed", "1")  # every rank's flags are zero before anyone signals


class _GroupState:
    """What distgemm keeps per process group: its rank and size, whether the fused backend runs
    on it (agreed by every rank), its workspace, and the workspaces CUDA graphs still use."""

    _uses: dict = {}  # group name -> states made for it (a group recreated under its name)

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.name = group.group_name
        self.use = _GroupState._uses[self.name] = _GroupState._uses.get(self.name, 0) + 1
        self.size = group.size()
        self.rank = group.rank()
        self.fused: Optional[bool] = None
        self.workspace: Optional[_Workspace] = None
        self.retired: list = []       # workspaces captured by CUDA graphs
        self.exchanges = 0
        self.generation = 0           # of recover(): every rank's exchanges restart counting there
        self.calls = 0                # the collectives path's calls in this generation (they pair by it)
        self.failed: Optional[str] = None  # why the collectives path's calls raise until recover()
        # One call at a time enqueues on the workspace, or runs its agreement and collectives (a
        # thread's call must not interleave its collectives with another's); reentrant: the
        # collectives path on a fused group agrees on the workspace.
        self.lock = threading.RLock()
        self.last_stream = None

    def exchange(self, tag: str, value: str, timeouts: float = 1.0) -> list:
        """Every rank's `value`, through the default store, bounded by `timeouts` times
        DISTGEMM_TIMEOUT_S; the ranks must call it in the same order (they do: set-up, growth
        and recovery)."""
        self.exchanges += 1
        store = _store()
        prefix = f"distgemm/{self.name}/{self.use}/g{self.generation}/{self.exchanges}/{tag}"  # never reused
        store.set(f"{prefix}/{self.rank}", value)
        keys = [f"{prefix}/{r}" for r in range(self.size)]
        limit = timeouts * timeout_s()
        try:
            store.wait(keys, datetime.timedelta(seconds=limit))
        except Exception as e:  # DistStoreError: a timeout, or the store is gone
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise TimeoutError(f"distgemm: ranks {missing} of group {self.name!r} did not join the {tag!r} step "
                               f"within DISTGEMM_TIMEOUT_S={limit:g} s (died, hung, or called something "
                               f"else): {e}") from e
        return [store.get(k).decode() for k in keys]


_thread_stores = threading.local()


def _store():
    """The default store, one clone per thread: a store client serves one blocking call at a
    time, and calls on several threads (several groups) wait on it at once."""
    default = dist.distributed_c10d._get_default_store()
    cached = getattr(_thread_stores, "pair", None)
    if cached is None or cached[0] is not default:
        try:
            clone = default.clone()
        except (RuntimeError, NotImplementedError):  # a store that cannot be cloned: shared
            clone = default
        cached = _thread_stores.pair = (default, clone)
    return cached[1]


_states: dict = {}  # ProcessGroup -> _GroupState
# A state holds its ProcessGroup, which would keep a destroyed group alive until the interpreter
# finalizes; gloo's worker threads then meet a finalizing interpreter (a thread that asks for the
# GIL there is ended by pthread_exit: "terminate called without an active exception", SIGABRT,
# seen rarely on rank 0 of the gloo tests). Dropped at exit, while Python is still whole.
atexit.register(_states.clear)


def _state(group: dist.ProcessGroup) -> _GroupState:
    state = _states.get(group)
    if state is None:
        live = dist.distributed_c10d._world.pg_names
        for stale in [g for g in _states if g not in live]:  # destroyed groups
            del _states[stale]
        state = _states[group] = _GroupState(group)
    return state


def _backend() -> str:
    return _settings.current().tp_backend


def _core_settings(settings: _settings.Settings) -> list:
    """The TP settings the core takes as descriptor fields (dg_tp_settings: algo, pieces, tapered,
    rs_split_gflops), from tp_algo, tp_pieces and rs_split_gflops (see distgemm._settings)."""
    pieces, tapered = 0, False
    if settings.tp_pieces != "auto":
        tapered = settings.tp_pieces.endswith("t")
        pieces = int(settings.tp_pieces[:-1] if tapered else settings.tp_pieces)
    split = settings.rs_split_gflops
    split = 0.0 if split is None else (split if split > 0 else -1.0)  # 0: the core's default; < 0 halves every step
    return [float(_ALGOS[settings.tp_algo]), float(pieces), 1.0 if tapered else 0.0, split]


_core_settings_of: Tuple[Optional[_settings.Settings], list] = (None, [])


def _tp_settings() -> list:
    global _core_settings_of
    settings = _settings.current()
    if _core_settings_of[0] is not settings:
        _core_settings_of = (settings, _core_settings(settings))
    return _core_settings_of[1]


def _use_fused(group: dist.ProcessGroup, arch: int) -> bool:
    """Whether this call may take the fused path. The group decides once, all ranks together (a
    bounded exchange): fused where every rank can (NCCL, sm_90 kernels, peer-mappable memory)
    and wants to (DISTGEMM_TP_BACKEND is not `collectives`). A call that then takes the
    collectives path on a fused group (operands the fused kernels cannot take, or the setting
    changed since) says so to its peers first (_agree_before_collectives). `arch`: kernel_arch of
    the call's device."""
    state = _state(group)
    backend = _backend()
    if state.fused is None:
        with state.lock:  # once, also when several threads make the group's first calls
            if state.fused is None:
                capable = dist.get_backend(group) == "nccl" and arch == 90 and state.size <= 64
                votes = state.exchange("fused", f"{int(capable)}{int(backend != 'collectives')}")
                state.fused = _decide_fused(votes, state.name)
                if not state.fused and backend == "fused":
                    warn_once("distgemm: DISTGEMM_TP_BACKEND=fused needs NCCL and sm_90 GPUs on every rank; "
                              "using collectives + GEMM")
    return state.fused and backend != "collectives"


def _decide_fused(votes: list, group_name: str) -> bool:
    """The group's choice from every rank's vote ("<can run fused><wants fused>", 0/1 each): fused
    where all can and want to. Ranks that all could but disagree on DISTGEMM_TP_BACKEND would
    otherwise wait for each other on different paths: a ValueError on every rank names them."""
    can = [v[0] == "1" for v in votes]
    want = [v[1] == "1" for v in votes]
    if all(can) and len(set(want)) > 1:
        collectives = [r for r, w in enumerate(want) if not w]
        raise ValueError(f"distgemm: the ranks disagree: ranks {collectives} of group {group_name!r} set "
                         f"DISTGEMM_TP_BACKEND=collectives and the others do not; every rank must set the same")
    return all(can) and all(want)


_GAVE_UP = 1 << 40  # added to a call's arrival count by a rank that stopped waiting for it


def _agree_collectively(group, op: str, key: tuple) -> None:
    """The collectives path: every rank must be in the same call with the same shapes, checked on
    every call through the default store (the data collectives that follow would wait for a rank
    that is not there, or mix up bytes), before any collective. Calls pair by their order on the
    group. Every wait is bounded by DISTGEMM_TIMEOUT_S and touches no collective, so a rank that
    never makes its call is a TimeoutError on its peers, one that arrives after a peer gave up
    on it is one too, at once, and the group's collectives stay in step for recover()."""
    state = _state(group)
    if state.failed is not None:
        raise TimeoutError(state.failed)
    state.calls += 1
    store = _store()
    base = f"distgemm/{state.name}/{state.use}/g{state.generation}/call"
    prefix, value = f"{base}{state.calls}", repr(key)
    keys = [f"{prefix}/{r}" for r in range(state.size)]
    store.set(keys[state.rank], value)
    arrived = store.add(f"{prefix}/arrived", 1)
    after = ("; every tensor-parallel call on this group raises until every rank of the group calls "
             "distgemm.recover(group)")
    if arrived > _GAVE_UP:
        peer = store.get(f"{prefix}/gave-up").decode()
        state.failed = (f"{op}: group rank {peer} had given up on this rank's call (it waited more than "
                        f"DISTGEMM_TIMEOUT_S for it, or an earlier call of its failed){after}")
        raise TimeoutError(state.failed)
    if arrived == state.size:
        store.set(f"{prefix}/go", "1")
    else:
        limit = datetime.timedelta(seconds=timeout_s())

        def missing() -> str:
            state.failed = (f"{op}: group rank {', '.join(str(r) for r, k in enumerate(keys) if not store.check([k]))} "
                            f"did not arrive within DISTGEMM_TIMEOUT_S={timeout_s():g} s (died, hung, or was not in "
                            f"the call){after}")
            return state.failed

        try:
            store.wait([f"{prefix}/go"], limit)
        except Exception:  # DistStoreError: mark the call given up unless the last rank came meanwhile
            store.set(f"{prefix}/gave-up", str(state.rank))
            if store.add(f"{prefix}/arrived", _GAVE_UP) % _GAVE_UP < state.size:  # other ranks may have too
                store.set(f"{prefix}/go", "gave up")  # the ranks still waiting fail now, not a timeout later
                raise TimeoutError(missing()) from None
            store.wait([f"{prefix}/go"], limit)  # the last rank sets it right after arriving
        if store.get(f"{prefix}/go") != b"1":  # a peer gave up while this rank waited
            raise TimeoutError(missing())
    values = [v.decode() for v in store.multi_get(keys)]
    # Every rank arrived at this call, so none reads the previous call's keys any more.
    if state.calls > 1:
        store.delete_key(f"{base}{state.calls - 1}/{state.rank}")
        if arrived == state.size:
            for name in ("arrived", "go", "gave-up"):
                store.delete_key(f"{base}{state.calls - 1}/{name}")
    if any(v != value for v in values):
        detail = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise ValueError(f"{op}: the ranks disagree: they passed different shapes or dtypes: {detail}")


def _agree_before_collectives(group, kind: int, a, out_rows: int, n: int, out_dtype, scale_a, key: tuple) -> None:
    """The collectives path: before its data collectives, every rank must be in the same call
    the same way. On a fused group (its peers may have taken the fused path) this rank says on
    the group's workspace that it runs the call through collectives, on the GPU and bounded, and
    waits for the verdict: a peer on the fused path then fails with a named disagreement
    instead of waiting for this rank in vain, and so does this rank, before any collective a peer
    would never join. Ranks that all take the collectives path agree on the call's shape and
    dtypes there. Elsewhere: through the default store, bounded (_agree_collectively)."""
    state = _state(group)
    if not state.fused:
        _agree_collectively(group, _OP_NAMES[kind], key)
        return
    scale = _flat(scale_a)
    timeout = timeout_s()

    def call(ws, agree_only):
        ops.tp_agree_elsewhere(kind, a, out_rows, n, out_dtype, scale, state.rank, state.size, ws.ptrs, ws.nbytes,
                               timeout)

    # The agreement reads only the workspace's header: any workspace will do (the smallest
    # call's, where none exists yet).
    smallest = _workspace_bytes(_AG, 1, 8, 8, torch.bfloat16, torch.bfloat16, state.size)
    _run_on_workspace(state, smallest, a.device, call)
    torch.cuda.current_stream(a.device).synchronize()  # the fallback's price: one host sync
    _raise_on_error_word(a.device.index)


def _workspace(state: _GroupState, call, nbytes: int, device) -> _Workspace:
    """The group's workspace, at least `nbytes`. A first one is sized to the largest need of any
    rank; a larger one is made only after the ranks agreed on this call on the GPU (`call`
    with agree_only: the old workspace's per-call check), so a rank that passed other shapes
    gets a clear error instead of a collective its peers never join."""
    ws = state.workspace
    if ws is not None and ws.nbytes >= nbytes:
        return ws
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"distgemm: a tensor-parallel call inside CUDA graph capture needs a larger workspace "
                           f"({nbytes} bytes, group {state.name!r}): run it once before capturing")
    if ws is not None:
        call(ws, True)
        torch.cuda.synchronize(device)
        _raise_on_error_word(device.index)
        if ws.captured:
            state.retired.append(ws)
    needs = [int(v) for v in state.exchange("size", str(nbytes))]
    size = max(needs + [int(1.25 * ws.nbytes) if ws is not None else 0])
    state.workspace = None
    state.workspace = _Workspace(state, size, device)
    return state.workspace


def recover(group=None) -> None:
    """Re-synchronises a group after a tensor-parallel error (a timeout or a disagreement):
    every rank must call it. Waits (bounded by 3 x DISTGEMM_TIMEOUT_S) for the other ranks, lets
    the device finish (its waits are bounded too), clears the device's error word and drops
    the group's workspaces; the next call sets the group up afresh."""
    group = _resolve(group)
    state = _state(group)
    # The ranks' exchange counts may differ here (a rank whose set-up exchange timed out counted
    # it; its peers may never have reached it): the store's count of recover() arrivals names a
    # generation every rank agrees on, and the exchanges restart counting within it.
    store = _store()
    arrivals = store.add(f"distgemm/{state.name}/{state.use}/recover-arrivals", 1)
    state.generation = (arrivals - 1) // state.size + 1
    state.exchanges = 0
    # The ranks come from a failed call at different times: one may have seen the error at once,
    # another only when its own wait timed out (up to a timeout later).
    state.exchange("recover", "1", timeouts=3.0)
    # Workspaces a CUDA graph captured stay alive (a replay writes into them and the peers'),
    # zeroed as at set-up: every rank zeroes its own before the "recovered" step, so a replay
    # after recover() starts on flags and call counts that agree again. Only once every rank's
    # device is idle ("drained"): a peer's kernel still in flight writes flags and failure marks
    # into this rank's workspace.
    kept = list(state.retired)
    if state.workspace is not None and state.workspace.captured:
        kept.append(state.workspace)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    state.exchange("drained", "1")
    if cuda:
        device = torch.cuda.current_device()
        ops.tp_clear_error(device)
        for ws in kept:
            ws.tensor.zero_()
        torch.cuda.synchronize(device)
    state.exchange("recovered", "1")
    state.retired = kept
    state.workspace = None
    state.fused = None
    state.last_stream = None
    state.calls = 0
    state.failed = None


def _group_size(group: dist.ProcessGroup) -> int:
    """The group's size; traced code makes no group state (its lock cannot be traced: a group's
    first call may be a compiled one)."""
    return group.size() if torch.compiler.is_compiling() else _state(group).size


def _resolve(group) -> dist.ProcessGroup:
    """The process group a call runs on: `group`, the one registered under that name, or the
    default group for None; a ValueError / TypeError naming `group` otherwise."""
    if group is None:
        if not dist.is_initialized():
            raise ValueError("distgemm: torch.distributed is not initialized (and no group was given)")
        return dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group hands back on the ranks it left out
        raise ValueError("distgemm: this rank is not a member of group (dist.new_group returned "
                         "GroupMember.NON_GROUP_MEMBER here): only the group's ranks call its ops and recover()")
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            return _resolve_process_group(group)
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"distgemm: group {group!r} names no process group ({e})") from None
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"distgemm: group must be a torch.distributed ProcessGroup, its name, or None, got "
                        f"{type(group).__name__}")
    return group


# ---------------------------------------------------------------- fused ops (custom ops)


def _run_on_workspace(state: _GroupState, nbytes: int, device, call):
    """Runs `call(workspace, agree_only)` on the group's workspace, one call at a time per
    group: a call from another stream than the previous one waits for it (the calls share the
    workspace and its call counter)."""
    with state.lock:
        ws = _workspace(state, call, nbytes, device)
        stream = torch.cuda.current_stream(device)
        capturing = torch.cuda.is_current_stream_capturing()
        if state.last_stream is not None and state.last_stream != stream and not capturing:
            stream.wait_stream(state.last_stream)
        if capturing:
            ws.captured = True
        state.last_stream = stream
        try:
            return call(ws, False)
        except RuntimeError as e:  # the core's DG_ERROR_TIMEOUT (an earlier call timed out)
            if "(timeout)" in str(e):
                raise TimeoutError(str(e)) from e
            raise


def _fused_all_gather_matmul(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group,
                             return_gathered):
    state = _state(group)
    world, rank = state.size, state.rank
    nbytes = _workspace_bytes(_AG, a.shape[0], a.shape[1], b.shape[0], a.dtype, out_dtype, world)
    timeout, settings = timeout_s(), _tp_settings()

    def call(ws, agree_only):
        return ops.tp_all_gather_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, rank,
                                      world, ws.ptrs, ws.nbytes, timeout, return_gathered, settings, agree_only)

    return _run_on_workspace(state, nbytes, a.device, call)


def _fused_matmul_reduce_scatter(a, b, bias, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group):
    state = _state(group)
    world, rank = state.size, state.rank
    nbytes = _workspace_bytes(_RS, a.shape[0] // world, a.shape[1], b.shape[0], a.dtype, out_dtype, world)
    timeout, settings = timeout_s(), _tp_settings()

    def call(ws, agree_only):
        return ops.tp_gemm_reduce_scatter(a, b, bias, alpha, beta, out_dtype, scale_a, scale_b, fast_accum,
                                          rank, world, ws.ptrs, ws.nbytes, timeout, settings, agree_only)

    return _run_on_workspace(state, nbytes, a.device, call)


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
    if x.numel() == 0:  # nothing to move (every rank's shape agrees); an empty view keeps any strides,
        return x.new_empty((x.shape[0] * group.size(),) + tuple(x.shape[1:]))  # which the byte view refuses
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


def _gathered_scale_a(scale_a, rows: int, group, block: bool) -> Optional[torch.Tensor]:
    """Each rank's scale_a as the gathered rows' scales: M row-wise values (from one value or one
    per row of each shard), or (M, ceil(K/128)) block scales."""
    if scale_a is None:
        return None
    if block:
        return _all_gather(scale_a.float().contiguous(), group)
    return _all_gather(scale_a.reshape(-1).float().expand(rows).contiguous(), group)


def _scale_mode(a, b, scale_a, scale_b) -> str:
    """How a's scales travel with its rows: none, one per tensor, one per row, or per 1 x 128
    block (the ranks of a collectives call must agree: they gather them)."""
    if scale_a is None:
        return "none"
    if block_scales(a, b, scale_a, scale_b):
        return "block"
    return "row" if scale_a.numel() > 1 else "tensor"


# ---------------------------------------------------------------- public ops


def _kernel_c(c, beta, out_dtype):
    """(c, beta) as the fused ops take them: in the output dtype, a bias as one (N,) row, a full C
    row-major and aligned; beta unchanged (the core scales the bias itself)."""
    if c is None or beta == 0.0:
        return None, 0.0
    if c.dim() == 2 and c.shape[0] != 1:
        return aligned16(c.to(out_dtype).contiguous()), beta
    return aligned16(c.reshape(-1).to(out_dtype).contiguous()), beta


def _fused_operands(a, b, out_dtype, fast_accum, arch: int, kind=_AG, row_scales=False, rows_per_rank=0):
    """(a, b, fast_accum) as the fused ops' GEMMs take them, or None when they cannot run
    these dtypes and sizes. Decided from dtypes and sizes alone, which the ranks share: a layout
    or an alignment the kernels cannot read is copied, never a reason for one rank to take
    another path than its peers (it would wait for them in vain)."""
    if a.shape[1] * a.element_size() % 16 or b.shape[0] * out_dtype.itemsize % 16:
        return None
    kernel_dtype, fast = kernel_out_dtype(a.dtype, b.dtype, out_dtype, arch, fast_accum)
    if kernel_dtype != out_dtype:
        return None
    configs = _config_names(a.dtype, b.dtype, out_dtype, True, arch, fast)
    # The fused reduce-scatter's ring steps wait for their C operand in the epilogue, which only
    # the cooperative kernels run.
    if kind == _RS and a.dtype in FLOAT8 and not any(name.startswith("coop") for name in configs):
        return None
    # Each ring step reads its rows' FP8 scales in place, 16-byte aligned only at multiples of 4 rows.
    if kind == _RS and row_scales and rows_per_rank % 4:
        return None
    if not kernel_ready(a, b, out_dtype, arch):
        b = b.contiguous()
    return aligned16(a), aligned16(b), fast


def _empty_product(rows: int, b, c, beta, out_dtype) -> torch.Tensor:
    """(rows, N) of a product with nothing to multiply (no rows, no K or no N): beta * c
    (a bias, or the full c), zeros without c; beta = 0 does not read c."""
    out = torch.zeros(rows, b.shape[0], dtype=torch.float32, device=b.device)
    if c is not None and beta != 0:
        out = out + beta * c.to(out_dtype).float().reshape(-1, b.shape[0])  # c as the kernels read it
    return out.to(out_dtype)


def _all_gather_matmul(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group,
                       return_gathered):
    """Forward of all_gather_matmul without autograd; returns (out, gathered or None)."""
    if torch.compiler.is_compiling() and group.size() > 1:  # traced: the eager call runs in the op
        out, gathered = _all_gather_matmul_op(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum,
                                              group.group_name, return_gathered)
        return out, (gathered if return_gathered else None)
    return _all_gather_matmul_eager(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group,
                                    return_gathered)


def _all_gather_matmul_eager(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group,
                             return_gathered):
    world = _group_size(group)
    mode = _scale_mode(a, b, scale_a, scale_b)
    arch = kernel_arch(a.device)  # read once, handed to every GEMM of the call
    if world == 1:
        out = gemm_unchecked(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, arch)
        return out, (a if return_gathered else None)
    if a.is_cuda:
        _raise_on_error_word(a.get_device())
    a = a.contiguous()
    # Every call takes part in the group's choice; 128-block scales run the collectives path.
    fused = _use_fused(group, arch)
    if _state(group).fused and a.numel() == 0:
        # No rows or no K, on every rank alike (the fused path's ranks agree on both): nothing
        # to exchange, and no operand the fused kernels (or their agreement on the workspace) take.
        gathered = a.new_empty((a.shape[0] * world, a.shape[1]))
        return _empty_product(gathered.shape[0], b, c, beta, out_dtype), (gathered if return_gathered else None)
    fused = fused and mode != "block" and _fused_operands(a, b, out_dtype, fast_accum, arch)
    if fused:
        a, b, fast = fused
        bias_or_c, beta = _kernel_c(c, beta, out_dtype)
        out, gathered = _fused_all_gather_matmul(a, b, bias_or_c, alpha, beta, out_dtype, _flat(scale_a),
                                                 _flat(scale_b), fast, group, return_gathered)
        return out, (gathered if return_gathered else None)
    with _state(group).lock:
        _agree_before_collectives(group, _AG, a, a.shape[0] * world, b.shape[0], out_dtype, scale_a,
                                  (tuple(a.shape), str(a.dtype), str(out_dtype), mode))
        gathered = _all_gather(a, group)
        gathered_scale = _gathered_scale_a(scale_a, a.shape[0], group, mode == "block")
    out = gemm_unchecked(gathered, b, c, alpha, beta, out_dtype, gathered_scale, scale_b, fast_accum, arch)
    return out, (gathered if return_gathered else None)


def _matmul_reduce_scatter(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group):
    if torch.compiler.is_compiling() and group.size() > 1:  # traced: the eager call runs in the op
        return _matmul_reduce_scatter_op(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum,
                                         group.group_name)
    return _matmul_reduce_scatter_eager(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group)


def _matmul_reduce_scatter_eager(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, group):
    world = _group_size(group)
    mode = _scale_mode(a, b, scale_a, scale_b)
    arch = kernel_arch(a.device)  # read once, handed to every GEMM of the call
    if world == 1:
        return gemm_unchecked(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast_accum, arch)
    if a.is_cuda:
        _raise_on_error_word(a.get_device())
    full_c = c is not None and c.dim() == 2 and c.shape[0] != 1
    bias = None if c is None or full_c else c.reshape(-1)
    a = a.contiguous()
    fused = _use_fused(group, arch)
    # No rows or no N, on every rank alike (the fused path's ranks agree on both): nothing to
    # exchange, and no operand the fused kernels (or their agreement on the workspace) take.
    # (K may differ.)
    empty = _state(group).fused and a.shape[0] * b.shape[0] == 0
    kernel_operands = fused and not empty and mode != "block" and _fused_operands(
        a, b, out_dtype, fast_accum, arch, _RS, mode == "row", a.shape[0] // world)
    if empty:
        out = _empty_product(a.shape[0] // world, b, bias, beta, out_dtype)
    elif kernel_operands:
        a, b, fast = kernel_operands
        bias_c, bias_beta = _kernel_c(bias, beta, out_dtype)
        out = _fused_matmul_reduce_scatter(a, b, bias_c, alpha, bias_beta, out_dtype, _flat(scale_a),
                                           _flat(scale_b), fast, group)
    else:
        # FP32 partial sums (rounded to bfloat16 first where block scales take the FP8 kernel)
        partial = gemm_unchecked(a, b, None, alpha, 0.0, torch.float32, scale_a, scale_b, fast_accum, arch)
        with _state(group).lock:
            _agree_before_collectives(group, _RS, a, a.shape[0] // world, b.shape[0], out_dtype, scale_a,
                                      (a.shape[0], b.shape[0], str(out_dtype)))
            out = _reduce_scatter(partial, group)
        if bias is not None and beta != 0:  # beta = 0 does not read c (as the fused path and BLAS)
            out = out + beta * bias.to(out_dtype).float()
        out = out.to(out_dtype)
    if full_c and beta != 0:  # a full C is this rank's output shard: added after the reduction
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
        ctx.return_gathered = return_gathered
        return (out, gathered) if return_gathered else (out, None)

    @staticmethod
    def backward(ctx, grad, grad_gathered):
        b, gathered = ctx.saved_tensors
        g = grad.to(ctx.a_dtype) if ctx.needs_input_grad[0] or ctx.needs_input_grad[1] else None
        grad_a = grad_b = grad_c = None
        if ctx.needs_input_grad[0]:
            grad_a = _matmul_reduce_scatter(g, b.T, None, ctx.alpha, 0.0, ctx.a_dtype, None, None, False,
                                            ctx.group)
            if ctx.return_gathered:
                # A collective: every rank runs it, whether or not its own gathered copy got a
                # gradient (one that did not adds zeros), so that no rank's reduce-scatter pairs
                # with a peer's next collective.
                if grad_gathered is None:
                    grad_gathered = torch.zeros_like(gathered)
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
        grad_a = grad_b = grad_c = None
        if a.dtype not in FLOAT8:  # float8: only c requires grad, on every rank (a and b cannot)
            # A collective: every rank runs it, whichever of its inputs require grad.
            g = grad.to(a.dtype).contiguous()
            grad_a, gathered = _all_gather_matmul(g, b.T, None, ctx.alpha, 0.0, a.dtype, None, None, False,
                                                  ctx.group, True)
            grad_b = torch.matmul(gathered.T, a) * ctx.alpha if ctx.needs_input_grad[1] else None
        if ctx.needs_input_grad[2] and ctx.c_meta is not None:
            grad_c = grad_of_c(grad, ctx.beta, *ctx.c_meta)
        return grad_a, grad_b, grad_c, None, None, None, None, None, None, None


def all_gather_matmul(a: torch.Tensor, b: torch.Tensor, *, group=None, c: Optional[torch.Tensor] = None,
                      alpha: float = 1.0, beta: float = 0.0, out_dtype: Optional[torch.dtype] = None,
                      scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
                      return_gathered: bool = False, use_fast_accum: bool = False):
    """``alpha * allgather(a) @ b.T + beta * c`` with the all-gather hidden under the GEMM.

    a: (M/P, K), this rank's rows (any M/P); b: (N_local, K) this rank's weight shard;
    c: (M, N_local) or a bias (N_local,). Returns (M, N_local), and allgather(a) too with
    ``return_gathered``. float8 inputs take scale_a (1 or M/P values, this shard's) and
    scale_b as in :func:`distgemm.gemm`. Differentiable for bfloat16/float16 (float8: c only).
    """
    op = _OP_NAMES[_AG]
    check_flags(op, return_gathered=return_gathered, use_fast_accum=use_fast_accum)
    alpha, beta = check_scalars(op, alpha=alpha, beta=beta)
    group = _resolve(group)
    out_dtype, autograd = check_tp_operands(op, a, b, c, out_dtype, scale_a, scale_b, lambda m: m * _group_size(group))
    if autograd:
        if a.dtype in FLOAT8 and (a.requires_grad or b.requires_grad):  # c's gradient is given
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
    check_flags(op, use_fast_accum=use_fast_accum)
    alpha, beta = check_scalars(op, alpha=alpha, beta=beta)
    group = _resolve(group)
    world = _group_size(group)
    if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[0] % world:
        raise ValueError(f"{op}: a's {a.shape[0]} rows must divide evenly by the group size {world}")
    out_dtype, autograd = check_tp_operands(op, a, b, c, out_dtype, scale_a, scale_b, lambda m: m // world)
    if autograd:
        if a.dtype in FLOAT8 and (a.requires_grad or b.requires_grad):  # c's gradient is given
            raise NotImplementedError(f"{op}: autograd through float8 inputs is not supported")
        return _MatmulReduceScatter.apply(a, b, c, alpha, beta, out_dtype, scale_a, scale_b,
                                          use_fast_accum, group)
    return _matmul_reduce_scatter(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, use_fast_accum, group)


def dist_matmul(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor] = None, alpha: float = 1.0,
                beta: float = 0.0, *, group=None) -> torch.Tensor:
    """The seed's op, in its argument order: ``alpha * allgather(a) @ b.T + beta * c`` over
    ``group`` (the default group when None); see :func:`all_gather_matmul`."""
    return all_gather_matmul(a, b, group=group, c=c, alpha=alpha, beta=beta)
