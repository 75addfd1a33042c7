"""Runtime autotuning of the dense GEMM: the first eager call of each shape times every
candidate that computes it (each of distgemm's compiled tile configurations, and the vendor path
through PyTorch: cuBLAS for bf16/fp16, torch._scaled_mm for FP8) on the call's own operands and
remembers the fastest, in memory and on disk; the vendor's keeps near-ties (PREFER_MARGIN).

- Keys: device arch and name, M, N, K, dtypes, b's layout and the epilogue's form; the file is
  per GPU model, torch version and distgemm build (setting ``cache_dir``, ``$DISTGEMM_CACHE``,
  default ``~/.cache/distgemm``; ``autotune_cache`` / ``DISTGEMM_AUTOTUNE_CACHE`` names the file
  itself).
- Never during CUDA-graph capture or torch.compile tracing: those take the cached choice or,
  for a shape never timed, the tile heuristic. The first call of a shape synchronizes the
  device once (it times with CUDA events).
- ``DISTGEMM_AUTOTUNE=0`` (or ``distgemm.settings(autotune=False)``) turns it off (the
  heuristic's configuration, no vendor path).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from . import _settings

_LOCK = threading.Lock()
_CHOICES: Dict[str, str] = {}
_LOADED = False
# Which file _CHOICES holds: the (autotune_cache, cache_dir) it was read under (None: marked
# loaded without a file), and the settings object last seen to name it (settings are interned,
# so an unchanged object means an unchanged file).
_LOADED_FROM: Optional[tuple] = None
_LOADED_SETTINGS: Optional[object] = None
# What the last dense or grouped call ran, for the benchmarks: one item, which the native
# repeat-call tables (_repeat_calls) write too.
LAST_RAN: list = [None]
_ON_CLEAR: list = []  # what else forgets the choices with clear() (the tables of repeat calls)


def enabled() -> bool:
    return _settings.current().autotune


def _cache_file() -> Path:
    settings = _settings.current()
    if settings.autotune_cache:
        return Path(settings.autotune_cache)
    from ._build_info import BUILD_ID  # noqa: PLC0415 (written by the build)

    gpu = torch.cuda.get_device_name().replace(" ", "_").replace("/", "_")
    return settings.cache_dir / f"autotune-{gpu}-torch{torch.__version__}-{BUILD_ID[:12]}.json"


def _read_choices(path: Path, warn: bool = True) -> Dict[str, str]:
    """The choices stored in `path`: {} when there is no file; a file that is not a flat JSON
    object of strings (corrupt, truncated, not UTF-8, or nested past the parser's recursion
    limit) is treated as empty, with a warning, and rewritten at the next save."""
    try:
        raw = path.read_bytes()
    except OSError:
        return {}
    try:
        # UnicodeDecodeError is a ValueError; deep nesting raises RecursionError, not ValueError
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        data = e
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        what = type(data).__name__ if not isinstance(data, Exception) else f"unreadable: {type(data).__name__}"
        if warn:
            warnings.warn(f"distgemm.autotune: ignoring the cache file {path} ({what}, not a JSON object of "
                          "strings); shapes are timed again", RuntimeWarning, stacklevel=3)
        return {}
    return data


def _load() -> None:
    """Under _LOCK: makes _CHOICES hold the choices of the current settings' file, read on first
    use and again where the settings name another file (autotune_cache, cache_dir); the other
    file's choices are then forgotten (they stay in their file), not carried into this one."""
    global _LOADED, _LOADED_FROM, _LOADED_SETTINGS
    current = _settings.current()
    if _LOADED and current is _LOADED_SETTINGS:
        return
    source = (current.autotune_cache, current.cache_dir)
    if _LOADED and _LOADED_FROM in (None, source):
        _LOADED_SETTINGS = current
        return
    if _LOADED:
        _CHOICES.clear()
        for forget in _ON_CLEAR:
            forget()
    _LOADED, _LOADED_FROM, _LOADED_SETTINGS = True, source, current
    try:
        path = _cache_file()
    except ImportError:
        return
    _CHOICES.update(_read_choices(path))


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float = 10.0):
    """An exclusive lock on `path` + '.lock' between processes (bounded: after `timeout_s` the
    write goes ahead unlocked; still atomic, it may then lose a concurrent writer's choices)."""
    lock_path = path.with_name(path.name + ".lock")
    fd = None
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)
    except OSError:
        pass  # no lock file (read-only directory): the write itself will say so
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _save() -> None:
    """Writes the choices atomically (a temporary file renamed over the cache), merged under a
    file lock with what other processes stored since this one read the file: ranks tuning at
    once keep every rank's choices."""
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(path):
            merged = _read_choices(path, warn=False)  # a corrupt file was reported when loaded
            merged.update(_CHOICES)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                tmp.write_text(json.dumps(merged, indent=0, sort_keys=True))
                os.replace(tmp, path)
            finally:
                if tmp.exists():
                    tmp.unlink()
    except OSError:
        pass  # a read-only home still autotunes, per process


def may_time() -> bool:
    """Whether this call may time candidates: not while torch.compile traces, not inside
    CUDA-graph capture."""
    if torch.compiler.is_compiling():
        return False
    return not torch.cuda.is_current_stream_capturing()


def _time_ms(fn: Callable[[], object], reps: int, flush: torch.Tensor) -> float:
    """Median device time of `reps` calls of `fn`, each timed alone as the benchmarks time it:
    L2 overwritten by `flush`, then ~0.5 ms of queued GPU work, so that neither the host's
    launch cost (which differs between candidates) nor a previous call's tail or cached
    operands count. Timed back to back instead, the kernels ranked differently: 24 of 50 FP8
    fast-accumulation shapes picked tiles that then ran up to 16% behind (bench/NOTES.md)."""
    pairs = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(1_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    pairs[-1][1].synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def flush_buffer(device=None, times_l2: int = 2) -> torch.Tensor:
    """A buffer of `times_l2` times the L2's size on the CUDA `device` (None: the current one),
    overwritten between timed calls to evict the L2: the autotuner's (freed after tuning) and the
    benchmarks' Timer's, so that the two time alike."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
    return torch.empty(times_l2 * l2 // 4, dtype=torch.int32, device=device)


def lookup(key: str) -> Optional[str]:
    """The remembered choice for `key`, if any (reads the file on first use, and on the first use
    under settings that name another file)."""
    if not _LOADED or _settings.current() is not _LOADED_SETTINGS:
        with _LOCK:
            _load()
    return _CHOICES.get(key)


# How much faster than the `prefer`red candidate another must measure to be chosen: the spread
# of these short measurements (clocks move with power draw, FP8 most) is a few percent, and a
# near-tie picked by noise measured up to 8% slower afterwards (bench/NOTES.md, autotuning).
PREFER_MARGIN = 0.03

_REPS = 5  # calls timed per candidate and round
_ROUNDS = 3  # rounds, the candidates taking turns; each keeps its median

# A win over the preferred candidate by less than this is timed again, the two alone, and kept
# only if it holds there too: among 6 to 8 candidates the best of several noisy medians
# beats the vendor by chance (the sweep's worst dense row was a 3-5% "win" the bench then
# measured 8% behind; bench/NOTES.md, autotuning).
CONFIRM_BELOW = 0.10


def _medians(candidates: Dict[str, Callable[[], object]], flush) -> Dict[str, float]:
    samples: Dict[str, list] = {name: [] for name in candidates}
    for _ in range(_ROUNDS):
        for name, fn in candidates.items():
            samples[name].append(_time_ms(fn, _REPS, flush))
    return {name: statistics.median(times) for name, times in samples.items()}


def _pick(best: Dict[str, float], prefer: Optional[str]) -> str:
    choice = min(best, key=best.get)
    if prefer in best and best[choice] > best[prefer] * (1.0 - PREFER_MARGIN):
        return prefer
    return choice


# What a candidate's trial run may raise to say that it does not take the call (a kernel that
# cannot implement the problem, a vendor call whose checks refuse it). Anything else is a bug
# and propagates.
REFUSALS = (RuntimeError, ValueError, NotImplementedError)


def choose(key: str, candidates: Dict[str, Callable[[], object]], prefer: Optional[str] = None,
           device: Optional[torch.device] = None) -> Optional[str]:
    """The fastest candidate's name for `key` (timed now if never timed), or None where this
    call may not time and nothing is cached, or no candidate takes the call. Each candidate
    runs once first (its warm-up: module load, handles, cuBLAS heuristics); one that raises
    there is left out, and a lone one left is kept untimed. `prefer` (the vendor library's
    candidate) keeps the choice unless another is faster by more than PREFER_MARGIN, in the
    first timing and, for a win by less than CONFIRM_BELOW, again head to head. `device`:
    where the candidates run (the timing's events, queued work and L2 flush go there)."""
    known = lookup(key)
    if known in candidates:
        return known
    if not may_time():
        return None
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        takers = {}
        for name, fn in candidates.items():
            try:
                fn()
                takers[name] = fn
            except REFUSALS:
                pass
        if len(takers) < 2:
            choice = next(iter(takers), None)
        else:
            flush = flush_buffer()
            best = _medians(takers, flush)
            choice = _pick(best, prefer)
            if choice != prefer and prefer in best and best[choice] > best[prefer] * (1.0 - CONFIRM_BELOW):
                pair = {name: takers[name] for name in (choice, prefer)}
                choice = _pick(_medians(pair, flush), prefer)
            del flush
    if choice is not None:
        remember(key, choice)
    return choice


def remember(key: str, choice: str) -> None:
    """Stores `choice` for `key` (memory and disk) without timing: where only one candidate
    takes the call."""
    with _LOCK:
        _load()  # this file's choices, not another's, go with it
        _CHOICES[key] = choice
        _save()


CUTLASS_PREFIX = "cutlass:"  # a choice of one of distgemm's tile configurations: "cutlass:<config name>"


def record(backend: str) -> None:
    if not torch.compiler.is_compiling():
        LAST_RAN[0] = backend


def record_eager(backend: str) -> None:
    """record() for a caller that knows it is not being traced (a repeated call's runner)."""
    LAST_RAN[0] = backend


def last_backend() -> Optional[str]:
    """What the last dense or grouped GEMM call ran: 'cutlass:<config>' (or 'cutlass': the
    heuristic's), 'cublas', 'torch._scaled_mm' or 'torch._grouped_mm' (for benchmarks)."""
    return LAST_RAN[0]


def clear() -> None:
    """Forgets every choice (in memory; the file stays)."""
    with _LOCK:
        _CHOICES.clear()
        for forget in _ON_CLEAR:
            forget()


def on_clear(forget: Callable[[], None]) -> None:
    """Registers what clear() must also forget."""
    _ON_CLEAR.append(forget)

