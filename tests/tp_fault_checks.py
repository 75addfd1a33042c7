"""Fault injection for the tensor-parallel ops (tests/multigpu/test_tp_faults.py): a spawner
that tolerates a rank killed on purpose and detects hangs, and the rank bodies.

The contract under test (what every surviving rank must see):
- DISTGEMM_TIMEOUT_S bounds every wait on a peer.
- A wait that times out, or ranks that disagree on a call (shapes, dtypes, or the settings
  DISTGEMM_TP_ALGO / DISTGEMM_TP_PIECES / DISTGEMM_RS_SPLIT_GFLOPS, on any call), poisons
  that call's output (NaN) and records the error on the device; distgemm.check_errors()
  (after torch.cuda.synchronize()) raises it, and so does the next TP call: TimeoutError
  naming the op and the peer rank, or ValueError containing "disagree".
- After an error every TP call on the group raises until every rank calls
  distgemm.recover(group=None), a collective bounded by DISTGEMM_TIMEOUT_S (TimeoutError if
  a peer never joins); then results are right again.

Each rank reports every case to the parent as soon as it has judged it (`RankCtx.record`),
so what was seen survives a rank that is killed or hangs; the parent gives the whole spawn
one deadline and marks what did not arrive by then as a hang.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import queue as queue_mod
import sys
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distgemm
from tests.dist_helpers import SAFE_ENV, free_port
from tests.fuzz_helpers import settings_of
from tests.reference import rel_error, tolerance

KILLED_EXIT = 17
SLACK_S = float(os.environ.get("DISTGEMM_FAULT_SLACK_S", "15"))  # allowed beyond DISTGEMM_TIMEOUT_S
PG_TIMEOUT_S = 120  # the process group's own collectives (set-up only; distgemm bounds its waits)


# ---------------------------------------------------------------- spawning


class RankCtx:
    """What a rank body gets: its rank, a way to report, an out-of-band barrier (not through
    the process group, which a fault may have broken) and a way to die."""

    def __init__(self, rank, world, queue, side):
        self.rank, self.world, self._queue, self._side = rank, world, queue, side
        self.dev = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")

    def record(self, case: str, ok: bool, outcome: str, seconds: float, detail: str = "", **extra) -> None:
        self._queue.put((self.rank, case, dict(ok=ok, outcome=outcome, seconds=round(seconds, 3),
                                               detail=detail[:1500], **extra)))

    def sync(self, timeout: float = 60.0) -> bool:
        """Waits for every rank (False when one does not come within `timeout`)."""
        try:
            self._side.wait(timeout)
            return True
        except Exception:
            return False

    def die(self) -> None:
        """Exits at once, as a crashed rank would (after flushing what was reported)."""
        self._queue.put((self.rank, "__dying__", None))
        self._queue.close()
        self._queue.join_thread()
        os._exit(KILLED_EXIT)


def _worker(rank, world, port, body, args, env, queue, side, backend):
    os.environ.update(SAFE_ENV)
    os.environ.update(env)  # the parent's settings for this rank, read again here
    distgemm.reload_settings()
    faulthandler.enable()  # a crashing rank prints where it was
    try:
        nccl = backend == "nccl"
        if nccl:
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
                                device_id=torch.device("cuda", rank) if nccl else None)
        body(RankCtx(rank, world, queue, side), *args)
    except BaseException:
        queue.put((rank, "__error__", traceback.format_exc()[-3000:]))
    finally:
        queue.put((rank, "__done__", None))
        queue.close()
        queue.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no process-group teardown: a peer may be gone, and that must not hang us


class SpawnResult:
    def __init__(self, world):
        self.cases = {r: {} for r in range(world)}  # rank -> case -> info
        self.errors: dict = {}                       # rank -> traceback of an unexpected exception
        self.done: set = set()
        self.dying: set = set()
        self.hung: list = []
        self.exitcodes: list = []
        self.seconds = 0.0


def spawn(body, *args, world: int = 2, env: Optional[dict] = None, deadline_s: float = 120.0,
          backend: str = "nccl") -> SpawnResult:
    """Runs body(ctx, *args) on `world` fresh ranks (NCCL, one GPU each) and collects what they
    report until every rank finished, died or the deadline passed (then: a hang, killed)."""
    ctx = mp.get_context("spawn")
    q, side = ctx.Queue(), ctx.Barrier(world)
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, body, args, env or {}, q, side, backend))
             for r in range(world)]
    res = SpawnResult(world)
    start = time.monotonic()
    for p in procs:
        p.start()

    def take(rank, key, value):
        if key == "__done__":
            res.done.add(rank)
        elif key == "__dying__":
            res.dying.add(rank)
        elif key == "__error__":
            res.errors[rank] = value
        else:
            res.cases[rank][key] = value

    while time.monotonic() - start < deadline_s:
        try:
            take(*q.get(timeout=0.25))
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs):
                break
    while True:  # anything still queued
        try:
            take(*q.get(timeout=0.2))
        except queue_mod.Empty:
            break
    for r, p in enumerate(procs):
        p.join(2.0)
        if p.is_alive():
            res.hung.append(r)
            p.kill()
            p.join(5.0)
    res.exitcodes = [p.exitcode for p in procs]
    res.seconds = time.monotonic() - start
    return res


# ---------------------------------------------------------------- operands and attempts


def timeout_s() -> float:
    return distgemm.current_settings().timeout_s


def _full(shape, dtype, dev, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)


class Problem:
    """One op call of a rank with its reference: `call()` runs it, `check(out)` judges it."""

    def __init__(self, ctx: RankCtx, op: str, rows: int, k: int = 512, n: int = 1024, dtype=torch.bfloat16,
                 seed: int = 0, group=None):
        r, w, dev = ctx.rank, ctx.world, ctx.dev
        self.op, self.dev, self.group = op, dev, group
        if op == "ag":  # rows: this rank's shard rows
            a_full = _full((rows * w, k), dtype, dev, seed)
            self.a, self.b = a_full[r * rows:(r + 1) * rows].contiguous(), _full((n, k), dtype, dev, seed + 100 + r, 0.1)
            self._ref = lambda: a_full.double() @ self.b.double().T
        else:  # "rs": rows = M, the rows of a (M, K_local) on every rank
            parts = [(_full((rows, k), dtype, dev, seed + 10 * q), _full((n, k), dtype, dev, seed + 10 * q + 1, 0.1))
                     for q in range(w)]
            self.a, self.b = parts[r]
            m = rows // w
            self._ref = lambda: sum(a.double() @ b.double().T for a, b in parts)[r * m:(r + 1) * m]

    def call(self):
        if self.op == "ag":
            return distgemm.all_gather_matmul(self.a, self.b, group=self.group)
        return distgemm.matmul_reduce_scatter(self.a, self.b, group=self.group)

    def check(self, out) -> str:
        """'' when out is right, else why not."""
        try:
            err = rel_error(out, self._ref())
        except AssertionError as e:
            return str(e)
        tol = tolerance(out.dtype, self.a.dtype)
        return "" if err <= tol else f"relative error {err:.3e} > {tol:.1e}"


OP_NAMES = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}


def attempt(ctx: RankCtx, problem: Problem, env: Optional[dict] = None) -> dict:
    """Runs one call to completion: the call, torch.cuda.synchronize(), check_errors(). Returns
    what happened: error (exception type name or None), message, seconds, whether the output
    came back poisoned (all NaN), and for a call without error whether it was right."""
    start = time.monotonic()
    out = None
    info = {"error": None, "message": "", "raised_by": None, "poisoned": None, "wrong": ""}
    try:
        with settings_of(env or {}):
            out = problem.call()
            info["raised_by"] = "synchronize"
            torch.cuda.synchronize(ctx.dev)
            info["raised_by"] = "check_errors"
            distgemm.check_errors(ctx.dev)
        info["raised_by"] = None
    except Exception as e:
        info.update(error=type(e).__name__, message=str(e)[:800],
                    is_timeout=isinstance(e, TimeoutError), is_value=isinstance(e, ValueError),
                    raised_by=info["raised_by"] or "call")
        try:
            torch.cuda.synchronize(ctx.dev)
        except Exception as sync_error:  # a sticky CUDA error: report it, nothing after is reliable
            info["cuda_error"] = str(sync_error)[:300]
    info["seconds"] = time.monotonic() - start
    if out is not None and "cuda_error" not in info:
        o = out[0] if isinstance(out, tuple) else out
        info["poisoned"] = bool(torch.isnan(o.float()).all()) if o.numel() else True
        if info["error"] is None:
            info["wrong"] = problem.check(o)
    return info


def judge_error(info: dict, kind: str, op: Optional[str] = None, peer: Optional[int] = None,
                limit: Optional[float] = None) -> list:
    """Problems of an attempt that had to fail with `kind` ('timeout' or 'disagree')."""
    problems = []
    if info["error"] is None:
        why = f"wrong result: {info['wrong']}" if info["wrong"] else "a result returned as valid"
        return [f"no error ({why}; poisoned={info['poisoned']})"]
    msg = info["message"]
    if kind == "timeout":
        if not info.get("is_timeout"):
            problems.append(f"expected TimeoutError, got {info['error']}: {msg[:300]}")
        if op and OP_NAMES[op] not in msg:
            problems.append(f"the message does not name the op {OP_NAMES[op]}: {msg[:300]}")
        if peer is not None and f"rank {peer}" not in msg:
            problems.append(f"the message does not name the peer rank {peer}: {msg[:300]}")
    else:
        if not info.get("is_value") or "disagree" not in msg.lower():
            problems.append(f"expected ValueError containing 'disagree', got {info['error']}: {msg[:300]}")
    if info["raised_by"] != "call" and info["poisoned"] is False:
        problems.append("the failed call's output was not poisoned (NaN)")
    if "cuda_error" in info:
        problems.append(f"CUDA error: {info['cuda_error']}")
    if limit is not None and info["seconds"] > limit:
        problems.append(f"took {info['seconds']:.1f} s > {limit:.1f} s")
    return problems


def judge_correct(info: dict) -> list:
    if info["error"] is not None:
        return [f"raised {info['error']}: {info['message'][:300]}"]
    return [f"wrong result: {info['wrong']}"] if info["wrong"] else []


def try_recover(ctx: RankCtx, group=None) -> dict:
    start = time.monotonic()
    try:
        distgemm.recover(group=group)
        return {"error": None, "message": "", "seconds": time.monotonic() - start,
                "is_timeout": False}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)[:500], "seconds": time.monotonic() - start,
                "is_timeout": isinstance(e, TimeoutError)}


def _warm(ctx, problems, env=None) -> list:
    issues = []
    for p in problems:
        issues += [f"warm-up {p.op}: {x}" for x in judge_correct(attempt(ctx, p, env))]
    return issues


# ---------------------------------------------------------------- rank bodies


def killed_peer(ctx: RankCtx, mode: str, op: str):
    """Rank 1 dies just before its second call ('before') or with the call enqueued behind a
    1 s GPU sleep ('mid'). Rank 0 must get TimeoutError naming the op and rank 1 within the
    bound, the next call must raise too, and recover() without the peer must time out."""
    victim, t = 1, timeout_s()
    limit = t + SLACK_S
    prob = Problem(ctx, op, 512 if op == "ag" else 1024)
    ctx.sync()  # set-up exchanges are bounded by DISTGEMM_TIMEOUT_S: start together
    warm = _warm(ctx, [prob])
    name = f"killed_peer_{mode}_{op}"
    if not ctx.sync():
        ctx.record(name, False, "ranks did not meet after the warm-up", 0.0, "; ".join(warm))
        return
    if ctx.rank == victim:
        if mode == "mid":
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles ahead of the call on this stream
            prob.call()
        ctx.die()
    info = attempt(ctx, prob)
    problems = warm + judge_error(info, "timeout", op, victim, limit)
    ctx.record(name, not problems, "error on every surviving rank" if not problems else "; ".join(problems),
               info["seconds"], info["message"])
    nxt = attempt(ctx, prob)
    problems = judge_error(nxt, "timeout", op, None, t)  # raised at once, not after another wait
    ctx.record(f"{name}:next_call_raises", not problems,
               "error on every surviving rank" if not problems else "; ".join(problems), nxt["seconds"],
               nxt["message"])
    rec = try_recover(ctx)
    problems = []
    if not rec["is_timeout"]:
        problems.append(f"expected TimeoutError from recover() without the peer, got "
                        f"{rec['error'] or 'no error'}: {rec['message'][:300]}")
    if rec["seconds"] > limit:
        problems.append(f"recover() took {rec['seconds']:.1f} s > {limit:.1f} s")
    ctx.record(f"{name}:recover_without_peer", not problems,
               "error on every surviving rank" if not problems else "; ".join(problems), rec["seconds"],
               rec["message"])


def peer_raises_then_recover(ctx: RankCtx, op: str):
    """Rank 1 raises (in Python) before its call and never makes it; rank 0 times out. Then
    both ranks call recover() and the next calls are right."""
    t = timeout_s()
    limit = t + SLACK_S
    prob = Problem(ctx, op, 512 if op == "ag" else 1024)
    ctx.sync()
    warm = _warm(ctx, [prob])
    ctx.sync()
    name = f"peer_raises_before_call_{op}"
    if ctx.rank == 1:
        start = time.monotonic()
        try:
            raise RuntimeError("injected: rank 1 fails before its call")
        except RuntimeError as e:
            ctx.record(name, not warm, "error" if not warm else "; ".join(warm), time.monotonic() - start, str(e))
    else:
        info = attempt(ctx, prob)
        problems = warm + judge_error(info, "timeout", op, 1, limit)
        nxt = attempt(ctx, prob)
        problems += [f"next call: {p}" for p in judge_error(nxt, "timeout", op, None, t)]
        ctx.record(name, not problems, "error" if not problems else "; ".join(problems), info["seconds"],
                   info["message"])
    # recovery after a timeout: both ranks meet (out of band), recover, and compute again
    if not ctx.sync(limit + 30):
        ctx.record("recover_after_timeout", False, "ranks did not meet before recover()", 0.0)
        return
    rec = try_recover(ctx)
    problems = [] if rec["error"] is None else [f"recover() raised {rec['error']}: {rec['message'][:300]}"]
    seconds = rec["seconds"]
    if not problems:
        ctx.sync()
        for i, fresh in enumerate([Problem(ctx, "ag", 384, seed=7), Problem(ctx, "rs", 768, seed=8)]):
            info = attempt(ctx, fresh)
            seconds += info["seconds"]
            problems += [f"{fresh.op} after recover(): {p}" for p in judge_correct(info)]
    ctx.record("recover_after_timeout", not problems, "correct" if not problems else "; ".join(problems), seconds)


def late_peer(ctx: RankCtx, op: str):
    """Rank 1 calls only after rank 0's wait timed out, and rank 0 had enqueued its next call
    (another problem) before it saw the failure. Rank 0: TimeoutError naming rank 1. Rank 1:
    a TimeoutError saying rank 0 gave up, raised without another full wait, and NaN, never the
    result of rank 0's next call's data. Then both recover() and the next calls are right."""
    t = timeout_s()
    limit = t + SLACK_S
    rows = 512 if op == "ag" else 1024
    first, second = Problem(ctx, op, rows, seed=1), Problem(ctx, op, rows, seed=2)
    ctx.sync()
    warm = _warm(ctx, [first])
    name = f"late_peer_{op}"
    if not ctx.sync():
        ctx.record(name, False, "ranks did not meet after the warm-up", 0.0, "; ".join(warm))
        return
    if ctx.rank == 0:
        start = time.monotonic()
        outs, problems = [], list(warm)
        try:
            outs = [first.call(), second.call()]  # both enqueued before the host can see the first fail
        except Exception as e:
            problems.append(f"enqueueing two calls raised {type(e).__name__}: {e}")
        info = attempt(ctx, second)  # a third call: synchronizes and reads the error word
        info["seconds"] = time.monotonic() - start
        problems += judge_error(info, "timeout", op, 1, limit)
        if any(not bool(torch.isnan(o.float()).all()) for o in outs):
            problems.append("an output of the calls enqueued before the failure was not poisoned (NaN)")
    else:
        time.sleep(t + 2.0)
        info = attempt(ctx, first)
        problems = warm + judge_error(info, "timeout", op, 0, t)  # at once: rank 0's mark is there
        if info["error"] is not None and "given up" not in info["message"]:
            problems.append(f"the message does not say the peer gave up: {info['message'][:300]}")
    ctx.record(name, not problems, "error on both ranks" if not problems else "; ".join(problems), info["seconds"],
               info["message"])
    if not ctx.sync(limit + 30):
        ctx.record(f"{name}:recover", False, "ranks did not meet before recover()", 0.0)
        return
    rec = try_recover(ctx)
    problems = [] if rec["error"] is None else [f"recover() raised {rec['error']}: {rec['message'][:300]}"]
    if not problems:
        ctx.sync()
        for again in (first, second):
            problems += [f"after recover(): {p}" for p in judge_correct(attempt(ctx, again))]
    ctx.record(f"{name}:recover", not problems, "correct" if not problems else "; ".join(problems), rec["seconds"])


def _disagreement(ctx: RankCtx, name: str, warm_problems, mine: Problem, agreeing: Problem,
                  env_mine=None, env_agree=None, broken: Optional[list] = None):
    """The ranks make one call that differs (shape, dtype or setting): every rank must get
    ValueError('disagree') within the bound, the next (agreeing) call must raise too; then
    recover() on every rank and an agreeing call must be right."""
    t = timeout_s()
    limit = t + SLACK_S
    if broken:
        ctx.record(name, False, f"not run: {broken[0]}", 0.0)
        return
    ctx.sync(limit + 30)
    warm = _warm(ctx, warm_problems, env_agree)
    ctx.sync(limit + 30)
    info = attempt(ctx, mine, env_mine)
    problems = warm + judge_error(info, "disagree", limit=limit)
    nxt = attempt(ctx, agreeing, env_agree)
    problems += [f"next call: {p}" for p in judge_error(nxt, "disagree", limit=t)]
    named = info["message"]
    ctx.sync(limit + 30)
    rec = try_recover(ctx)
    if rec["error"] is not None:
        problems.append(f"recover() raised {rec['error']}: {rec['message'][:300]}")
        if broken is not None:
            broken.append(f"recover() failed in {name}")
    else:
        after = attempt(ctx, agreeing, env_agree)
        problems += [f"after recover(): {p}" for p in judge_correct(after)]
    ctx.record(name, not problems, "error" if not problems else "; ".join(problems), info["seconds"], named,
               message=named)


def shapes_disagree(ctx: RankCtx):
    """Shapes (2048 vs 1024 rows) and dtypes (bf16 vs fp16) that differ after the first
    calls, all of them seen before by both ranks: no first-call check catches them."""
    broken: list = []
    for op in ("ag", "rs"):
        big, small = Problem(ctx, op, 2048, k=256, n=512, seed=1), Problem(ctx, op, 1024, k=256, n=512, seed=2)
        mine = big if ctx.rank == 0 else small
        _disagreement(ctx, f"shapes_differ_{op}", [big, small], mine, small, broken=broken)
    bf, fp = Problem(ctx, "ag", 512, seed=3), Problem(ctx, "ag", 512, dtype=torch.float16, seed=3)
    _disagreement(ctx, "dtypes_differ_ag", [bf, fp], bf if ctx.rank == 0 else fp, bf, broken=broken)


def settings_disagree(ctx: RankCtx):
    """DISTGEMM_TP_PIECES 2 vs 3 (decomposed), DISTGEMM_TP_ALGO fused vs decomposed, and
    DISTGEMM_RS_SPLIT_GFLOPS 0 vs the default (fused reduce-scatter), after agreeing calls."""
    broken: list = []
    for op in ("ag", "rs"):
        p = Problem(ctx, op, 1024 if op == "ag" else 2048, k=512, n=1024, seed=4)
        agree = {"DISTGEMM_TP_ALGO": "decomposed", "DISTGEMM_TP_PIECES": "2"}
        mine = dict(agree, DISTGEMM_TP_PIECES="2" if ctx.rank == 0 else "3")
        _disagreement(ctx, f"pieces_differ_{op}", [p], p, p, mine, agree, broken)
    for op in ("ag", "rs"):
        p = Problem(ctx, op, 1024 if op == "ag" else 2048, k=512, n=1024, seed=5)
        agree = {"DISTGEMM_TP_ALGO": "fused"}
        mine = {"DISTGEMM_TP_ALGO": "fused" if ctx.rank == 0 else "decomposed"}
        _disagreement(ctx, f"algo_differ_{op}", [p], p, p, mine, agree, broken)
    p = Problem(ctx, "rs", 2048, k=512, n=1024, seed=6)
    agree = {"DISTGEMM_TP_ALGO": "fused", "DISTGEMM_RS_SPLIT_GFLOPS": None}
    mine = dict(agree, DISTGEMM_RS_SPLIT_GFLOPS="0" if ctx.rank == 0 else None)
    _disagreement(ctx, "rs_split_differ_rs", [p], p, p, mine, agree, broken)


def paths_disagree(ctx: RankCtx):
    """One rank on the fused path, the other on the collectives fallback, after agreeing calls:
    K (all-gather) or N (reduce-scatter) of 100 bf16 elements, no multiple of 16 bytes, on rank
    1 only; and DISTGEMM_TP_BACKEND=collectives on rank 1 only. Every rank must name it at once,
    not wait for the other past the timeout (the fused rank) or in NCCL (the other)."""
    broken: list = []
    ag, ag_odd = Problem(ctx, "ag", 512, k=256, seed=7), Problem(ctx, "ag", 512, k=100, seed=7)
    _disagreement(ctx, "path_differs_ag", [ag, ag_odd], ag if ctx.rank == 0 else ag_odd, ag, broken=broken)
    rs, rs_odd = Problem(ctx, "rs", 2048, n=512, seed=8), Problem(ctx, "rs", 2048, n=100, seed=8)
    _disagreement(ctx, "path_differs_rs", [rs, rs_odd], rs if ctx.rank == 0 else rs_odd, rs, broken=broken)
    mine = {"DISTGEMM_TP_BACKEND": "collectives" if ctx.rank == 1 else None}
    _disagreement(ctx, "backend_differs_ag", [ag], ag, ag, mine, {"DISTGEMM_TP_BACKEND": None}, broken)


def _check_all(ctx, pairs) -> list:
    """pairs: (Problem, output) computed without synchronizing; synchronize, check errors, judge."""
    problems = []
    try:
        torch.cuda.synchronize(ctx.dev)
        distgemm.check_errors(ctx.dev)
    except Exception as e:
        return [f"raised {type(e).__name__}: {str(e)[:300]}"]
    for i, (p, out) in enumerate(pairs):
        why = p.check(out)
        if why:
            problems.append(f"call {i} ({p.op}): {why}")
    return problems


def side_stream(ctx: RankCtx) -> list:
    problems = []
    dev = ctx.dev
    side = torch.cuda.Stream(device=dev)
    # round 1: both ranks on a side stream, shapes never seen (set-up on the side stream)
    ag, rs = Problem(ctx, "ag", 320, seed=11), Problem(ctx, "rs", 640, seed=12)
    ctx.sync()
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        outs = [(ag, ag.call()), (rs, rs.call())]
    torch.cuda.current_stream(dev).wait_stream(side)
    problems += [f"both on side streams: {p}" for p in _check_all(ctx, outs)]
    # round 2: rank 0 on its side stream, rank 1 on the default stream
    ag, rs = Problem(ctx, "ag", 320, seed=13), Problem(ctx, "rs", 640, seed=14)
    stream = side if ctx.rank == 0 else torch.cuda.current_stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        outs = [(ag, ag.call()), (rs, rs.call())]
    torch.cuda.current_stream(dev).wait_stream(stream)
    problems += [f"side vs default stream: {p}" for p in _check_all(ctx, outs)]
    return problems


def two_groups(ctx: RankCtx) -> list:
    problems = []
    g1, g2 = dist.new_group(list(range(ctx.world))), dist.new_group(list(range(ctx.world)))
    for rnd in range(3):
        calls = [Problem(ctx, "ag", 256 + 64 * rnd, seed=20 + 4 * rnd, group=g1),
                 Problem(ctx, "rs", 512 + 128 * rnd, seed=21 + 4 * rnd, group=g2),
                 Problem(ctx, "ag", 192 + 32 * rnd, n=768, seed=22 + 4 * rnd, group=g2),
                 Problem(ctx, "rs", 384 + 64 * rnd, n=768, seed=23 + 4 * rnd, group=g1)]
        outs = [(p, p.call()) for p in calls]  # interleaved, nothing synchronized in between
        problems += [f"round {rnd}: {p}" for p in _check_all(ctx, outs)]
    return problems


class _Canaries:
    """Memory filled with a pattern where freed memory would go (the caching allocator's blocks
    and, where the workspaces come from, symmetric memory), to catch a replay writing into it."""

    def __init__(self, dev):
        self.buffers = [torch.full((16 << 20,), 0x5A5A5A5A, dtype=torch.int32, device=dev) for _ in range(8)]
        try:
            import torch.distributed._symmetric_memory as symm_mem

            for _ in range(2):
                s = symm_mem.empty(64 << 20, dtype=torch.uint8, device=dev)
                s.fill_(0x5A)
                self.buffers.append(s)
        except Exception:
            pass
        self.snapshots = [c.clone() for c in self.buffers]

    def hit(self) -> list:
        """The indices of the buffers written since."""
        return [i for i, (c, s) in enumerate(zip(self.buffers, self.snapshots)) if not torch.equal(c, s)]


def graph_after_growth(ctx: RankCtx) -> list:
    """Capture AG + RS at a small shape, grow both workspaces with an eager call at a large
    shape, replay: the replay must be right, and neither the canary tensors allocated after
    the growth (where freed memory would be handed out again) nor anything else may be hit."""
    problems = []
    dev, w, r = ctx.dev, ctx.world, ctx.rank
    m, k, n = 256, 256, 512
    a = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
    a_rs = torch.empty(m * w, k, dtype=torch.bfloat16, device=dev)
    b = _full((n, k), torch.bfloat16, dev, 30 + r, 0.1)
    b_rs = _full((n, k), torch.bfloat16, dev, 40 + r, 0.1)
    side = torch.cuda.Stream(device=dev)

    def load(step):
        a_full = _full((m * w, k), torch.bfloat16, dev, 500 + step)
        rs_parts = [_full((m * w, k), torch.bfloat16, dev, 600 + 10 * step + q) for q in range(w)]
        a.copy_(a_full[r * m:(r + 1) * m])
        a_rs.copy_(rs_parts[r])
        b_all = [_full((n, k), torch.bfloat16, dev, 40 + q, 0.1) for q in range(w)]
        ref_ag = a_full.double() @ b.double().T
        ref_rs = sum(x.double() @ y.double().T for x, y in zip(rs_parts, b_all))[r * m:(r + 1) * m]
        return ref_ag, ref_rs

    load(0)
    ctx.sync()
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up outside the capture
        distgemm.all_gather_matmul(a, b)
        distgemm.matmul_reduce_scatter(a_rs, b_rs)
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_ag = distgemm.all_gather_matmul(a, b)
        out_rs = distgemm.matmul_reduce_scatter(a_rs, b_rs)

    def replay(step, what):
        ref_ag, ref_rs = load(step)
        ctx.sync()
        graph.replay()
        torch.cuda.synchronize(dev)
        distgemm.check_errors(dev)
        for out, ref, name in ((out_ag, ref_ag, "all_gather_matmul"), (out_rs, ref_rs, "matmul_reduce_scatter")):
            try:
                err = rel_error(out, ref)
                if err > tolerance(out.dtype):
                    problems.append(f"{what}: {name} relative error {err:.3e}")
            except AssertionError as e:
                problems.append(f"{what}: {name}: {e}")

    replay(1, "replay before the growth")
    big_ag, big_rs = Problem(ctx, "ag", 4096, k=4096, n=1024, seed=50), Problem(ctx, "rs", 8192, k=2048, n=2048, seed=51)
    ctx.sync()
    problems += [f"growth call: {p}" for p in _check_all(ctx, [(big_ag, big_ag.call()), (big_rs, big_rs.call())])]
    del big_ag, big_rs
    torch.cuda.empty_cache()
    canaries = _Canaries(dev)
    replay(2, "replay after the growth")
    replay(3, "second replay after the growth")
    hit = canaries.hit()
    if hit:
        problems.append(f"replay wrote into memory allocated after the growth (canaries {hit})")
    return problems


def graph_after_recover(ctx: RankCtx) -> list:
    """Capture AG + RS, make the ranks disagree on an eager call that runs on the captured
    workspace (smaller shapes: no growth), recover(), replay: the workspace the graph captured must
    still be alive (canaries allocated after recover() untouched) and in step again (the replay
    is right, no error)."""
    problems = []
    dev, w, r = ctx.dev, ctx.world, ctx.rank
    m, k, n = 256, 256, 512
    a = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
    a_rs = torch.empty(m * w, k, dtype=torch.bfloat16, device=dev)
    b = _full((n, k), torch.bfloat16, dev, 70 + r, 0.1)
    b_rs = _full((n, k), torch.bfloat16, dev, 80 + r, 0.1)
    side = torch.cuda.Stream(device=dev)

    def load(step):
        a_full = _full((m * w, k), torch.bfloat16, dev, 700 + step)
        rs_parts = [_full((m * w, k), torch.bfloat16, dev, 800 + 10 * step + q) for q in range(w)]
        a.copy_(a_full[r * m:(r + 1) * m])
        a_rs.copy_(rs_parts[r])
        b_all = [_full((n, k), torch.bfloat16, dev, 80 + q, 0.1) for q in range(w)]
        return a_full.double() @ b.double().T, sum(x.double() @ y.double().T for x, y in zip(rs_parts, b_all))[r * m:(r + 1) * m]

    load(0)
    ctx.sync()
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up outside the capture: the workspace is set up here
        distgemm.all_gather_matmul(a, b)
        distgemm.matmul_reduce_scatter(a_rs, b_rs)
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_ag = distgemm.all_gather_matmul(a, b)
        out_rs = distgemm.matmul_reduce_scatter(a_rs, b_rs)

    def replay(step, what):
        ref_ag, ref_rs = load(step)
        ctx.sync()
        try:
            graph.replay()
            torch.cuda.synchronize(dev)
            distgemm.check_errors(dev)
        except Exception as e:
            problems.append(f"{what}: raised {type(e).__name__}: {str(e)[:300]}")
            return
        for out, ref, name in ((out_ag, ref_ag, "all_gather_matmul"), (out_rs, ref_rs, "matmul_reduce_scatter")):
            err = rel_error(out, ref)
            if err > tolerance(out.dtype):
                problems.append(f"{what}: {name} relative error {err:.3e}")

    replay(1, "replay before the failure")
    ctx.sync()
    mine = Problem(ctx, "ag", 128 if r == 0 else 64, k=k, n=n, seed=90)  # fits the captured workspace
    problems += [f"disagreeing call: {p}" for p in judge_error(attempt(ctx, mine), "disagree")]
    ctx.sync(timeout_s() + SLACK_S + 30)
    rec = try_recover(ctx)
    if rec["error"] is not None:
        return problems + [f"recover() raised {rec['error']}: {rec['message'][:300]}"]
    torch.cuda.empty_cache()
    canaries = _Canaries(dev)
    replay(2, "replay after recover()")
    replay(3, "second replay after recover()")
    hit = canaries.hit()
    if hit:
        problems.append(f"replay wrote into memory allocated after recover() (canaries {hit})")
    ctx.sync()
    fresh = Problem(ctx, "ag", 128, k=k, n=n, seed=91)
    problems += [f"eager call after recover(): {p}" for p in judge_correct(attempt(ctx, fresh))]
    return problems


def correct_cases(ctx: RankCtx):
    """Cases that must simply give right results (each returns its problems; a raise is one);
    each recovers the group if it failed, so that the next one still runs."""
    for name, case in (("side_stream", side_stream), ("two_groups", two_groups),
                       ("graph_replay_after_growth", graph_after_growth),
                       ("graph_replay_after_recover", graph_after_recover)):
        ctx.sync()
        start = time.monotonic()
        try:
            problems = case(ctx)
        except Exception as e:
            problems = [f"raised {type(e).__name__}: {str(e)[:300]}"]
        ctx.record(name, not problems, "correct" if not problems else "; ".join(problems), time.monotonic() - start)
        ctx.sync(timeout_s() + SLACK_S + 30)
        try:
            torch.cuda.synchronize(ctx.dev)
            distgemm.check_errors(ctx.dev)
        except Exception:
            try_recover(ctx)
