"""distgemm's settings: every ``DISTGEMM_*`` environment variable, read once into one frozen
:class:`Settings` when distgemm is imported (and again by :func:`reload_settings`).
``distgemm.settings(**overrides)`` changes some of them for a block. No other module of distgemm
reads the environment.

A changed setting reaches every later call: equal settings are one object (interned), and the
tables of repeat calls that depend on settings key their entries by it, so that a block under
other settings and the calls after it each find their own. The settings are process-wide, not
per thread. Every rank of a
tensor-parallel group must hold the same ``tp_algo``, ``tp_pieces`` and ``rs_split_gflops``: a
call whose ranks differ fails on every rank with a ValueError naming them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

GROUPED_BACKENDS = ("auto", "cutlass", "cublas", "torch")
TP_BACKENDS = ("auto", "fused", "collectives")
TP_ALGOS = ("auto", "fused", "decomposed")
TP_MAX_PIECES = 4  # DG_TP_MAX_PIECES
BENCH_TIMINGS = ("interleaved", "sequential", "sustained")
DEFAULT_TIMEOUT_S = 600.0  # NCCL's default: a slow but live peer is not failed sooner


def _bool_or_text(value):
    """A flag's value: a bool (an int 0 or 1 too) as it is, a string stripped; anything else is
    refused (a tensor's truth is no setting)."""
    if isinstance(value, bool) or (type(value) is int and value in (0, 1)):
        return bool(value)
    if isinstance(value, str):
        return value.strip()
    raise TypeError(f"must be True, False or a string, got {type(value).__name__}")


def _flag(value) -> bool:
    value = _bool_or_text(value)
    return value if isinstance(value, bool) else value.lower() not in ("", "0", "false", "no")


def _enabled_unless_zero(value) -> bool:
    value = _bool_or_text(value)
    return value if isinstance(value, bool) else value != "0"


def _choice(options):
    def parse(value) -> str:
        text = str(value).strip().lower()
        if text not in options:
            raise ValueError(f"must be one of {options}, got {value!r}")
        return text
    return parse


def _timeout(value) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"must be a finite positive number of seconds, got {value!r}")
    return seconds


def _pieces(value) -> str:
    text = str(value).strip().lower() or "auto"
    if text == "auto":
        return text
    digits = text[:-1] if text.endswith("t") else text
    if not digits.isdigit() or not 1 <= int(digits) <= TP_MAX_PIECES:
        raise ValueError(f"must be 'auto', N or Nt (tapered) with N in [1, {TP_MAX_PIECES}], got {value!r}")
    return text


def _split_gflops(value) -> Optional[float]:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None  # the core's default (25 GFLOP)
    try:
        gflops = float(value)
    except (TypeError, ValueError):
        gflops = -1.0
    if not math.isfinite(gflops) or gflops < 0:
        raise ValueError(f"must be a non-negative number of GFLOP, got {value!r}")
    return gflops


def _optional_text(value) -> Optional[str]:
    if value is None:
        return None
    text = str(value)
    return text or None


def _path(value) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"must be a path, got {type(value).__name__}")
    return Path(value).expanduser()


@dataclasses.dataclass(frozen=True)
class _Field:
    variable: str
    parse: Callable
    default: object


# field name -> its environment variable, how a value is read, and the value when unset.
_FIELDS: Dict[str, _Field] = {
    # How long a tensor-parallel call waits on a peer before it fails (TimeoutError).
    "timeout_s": _Field("DISTGEMM_TIMEOUT_S", _timeout, DEFAULT_TIMEOUT_S),
    # Tensor parallel: the fused kernels, the collectives fallback, or the best that applies.
    "tp_backend": _Field("DISTGEMM_TP_BACKEND", _choice(TP_BACKENDS), "auto"),
    # How the fused backend hides the communication: one CUTLASS GEMM per ring step waiting on
    # per-tile-row flags (fused); one cuBLASLt GEMM per chunk piece (decomposed); auto: decomposed
    # where it applies, except reduce-scatters of under ~50 GFLOP per rank.
    "tp_algo": _Field("DISTGEMM_TP_ALGO", _choice(TP_ALGOS), "auto"),
    # How many pieces a chunk of the decomposed algorithm travels in: auto, N or Nt (tapered).
    "tp_pieces": _Field("DISTGEMM_TP_PIECES", _pieces, "auto"),
    # The fused reduce-scatter halves a ring step when each half is at least this many GFLOP
    # (None: 25; 0 halves every step).
    "rs_split_gflops": _Field("DISTGEMM_RS_SPLIT_GFLOPS", _split_gflops, None),
    # Runtime autotuning of the dense and grouped GEMMs (off: the tile heuristic, no vendor path).
    "autotune": _Field("DISTGEMM_AUTOTUNE", _enabled_unless_zero, True),
    # The autotuner's file (None: one per GPU model, torch version and build under cache_dir).
    "autotune_cache": _Field("DISTGEMM_AUTOTUNE_CACHE", _optional_text, None),
    "cache_dir": _Field("DISTGEMM_CACHE", _path, Path.home() / ".cache" / "distgemm"),
    # The grouped GEMM's backend (auto: distgemm's kernels, torch._grouped_mm when timed faster).
    "grouped_backend": _Field("DISTGEMM_GROUPED_BACKEND", _choice(GROUPED_BACKENDS), "auto"),
    # Checks that cost a device synchronisation (offs on the GPU), and no repeat-call shortcuts.
    "debug": _Field("DISTGEMM_DEBUG", _flag, False),
    # The benchmarks: how Timer.compare times, whether suites also time torch.compile'd peers,
    # and the commit their results name (None: git's HEAD).
    "bench_timing": _Field("DISTGEMM_BENCH_TIMING", _choice(BENCH_TIMINGS), "interleaved"),
    "bench_compile": _Field("DISTGEMM_BENCH_COMPILE", _enabled_unless_zero, True),
    "commit": _Field("DISTGEMM_COMMIT", _optional_text, None),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """distgemm's settings (fields: see ``_FIELDS``)."""
    timeout_s: float
    tp_backend: str
    tp_algo: str
    tp_pieces: str
    rs_split_gflops: Optional[float]
    autotune: bool
    autotune_cache: Optional[str]
    cache_dir: Path
    grouped_backend: str
    debug: bool
    bench_timing: str
    bench_compile: bool
    commit: Optional[str]


def _parsed(name: str, value, source: str):
    try:
        return _FIELDS[name].parse(value)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{source} {exc}") from None


def from_environment(environ=None) -> Settings:
    """Settings read from `environ` (default: the process environment); unset variables take
    their defaults. A malformed value raises ValueError naming its variable."""
    env = os.environ if environ is None else environ
    values = {}
    for name, field in _FIELDS.items():
        raw = env.get(field.variable)
        values[name] = field.default if raw is None or raw == "" else _parsed(name, raw, field.variable)
    return Settings(**values)


def variable_field(variable: str) -> str:
    """The settings field an environment variable sets ('DISTGEMM_TP_ALGO' -> 'tp_algo')."""
    for name, field in _FIELDS.items():
        if field.variable == variable:
            return name
    raise ValueError(f"{variable!r} is not a distgemm setting; they are {[f.variable for f in _FIELDS.values()]}")


# Equal settings as one object: id(current()) keys what depends on them (never freed, so an id
# is never reused; a process holds a handful).
_interned: Dict[Settings, Settings] = {}


def _canonical(s: Settings) -> Settings:
    return _interned.setdefault(s, s)


_current: Settings = _canonical(from_environment())


def current() -> Settings:
    """The settings in force (equal settings are the same object)."""
    return _current


def _install(new: Settings) -> None:
    global _current
    _current = _canonical(new)


def reload_settings() -> Settings:
    """Reads the DISTGEMM_* environment variables again (distgemm reads them once, at import)."""
    _install(from_environment())
    return _current


def replaced(**overrides) -> Settings:
    """The current settings with `overrides` (field names; None: the default) applied and checked."""
    values = {}
    for name, value in overrides.items():
        if name not in _FIELDS:
            raise TypeError(f"distgemm.settings: unknown setting {name!r}; the settings are {sorted(_FIELDS)}")
        values[name] = _FIELDS[name].default if value is None else _parsed(name, value, f"distgemm.settings: {name}")
    return dataclasses.replace(_current, **values)


@contextlib.contextmanager
def settings(**overrides) -> Iterator[Settings]:
    """Runs a block with some settings changed (field names of :class:`Settings`, e.g.
    ``with distgemm.settings(grouped_backend="torch", timeout_s=30): ...``), restoring the
    previous ones after it. A bad value raises ValueError naming the setting before the block."""
    previous = _current
    _install(replaced(**overrides))
    try:
        yield _current
    finally:
        _install(previous)


# NVLink multicast off: distgemm never uses it, and multicast objects can take shared GPU hosts down.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launcher_ranks() -> Tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun passes them (RANK, WORLD_SIZE, LOCAL_RANK)."""
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def set_environment(values: Dict[str, str]) -> None:
    """Sets other libraries' environment variables for this process and those it starts (the one
    place distgemm writes the environment)."""
    os.environ.update(values)
