"""Runtime autotuning of the grouped GEMMs (16-bit forward, dgrad, wgrad; the FP8 block-scaled
wgrad): the first eager call of a grouped problem times each compiled tile configuration of
distgemm's kernel and, where it computes the same call, ``torch._grouped_mm``, on the call's own
operands and routing, and remembers the fastest in the dense autotuner's cache (memory and
disk, ``distgemm.autotune``).

Why: the core's cost model cannot see the routing (``offs`` lives on the GPU), and which tile
wins depends on it: groups of exactly 128 rows want clusters along N, a few long-K tiles want
smaller tiles, Zipf routing wants short tile rows. The FP8 wgrad's 256 x 128 tile spills
registers (per-row times per-column scales in its promotion) and its 128 x 128 tile does not:
the smaller tile ran 10-18% faster with 512-1024 tokens per expert, 5% slower with 8192
(bench/NOTES.md, grouped tile choice). Timing settles it once per problem.

- Keys: arch, pass, G, T, N, K, dtypes, the FP8 scale mode, accumulate, and whether
  torch._grouped_mm may answer.
  T is the token count of the call (training steps keep it), not the routing.
- Never during CUDA-graph capture or torch.compile tracing (the cached choice, else the cost
  model); ``DISTGEMM_AUTOTUNE=0`` turns it off. The first call of a problem synchronizes the
  device once (it times with CUDA events) and writes its result into a scratch output, so
  ``accumulate=True`` adds into ``out`` once.
- torch._grouped_mm keeps near-ties (autotune.PREFER_MARGIN), as cuBLAS does for dense GEMMs.
- One candidate (one compiled config and no peer: the fp16 passes, the bf16-out wgrad, calls
  torch may not answer) is chosen without running it; where only one of several takes the
  problem, that one is remembered after a single trial of each.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from . import autotune
from ._library import ops

TORCH = "torch._grouped_mm"
_KIND_NAMES = ("forward", "dgrad", "wgrad")


@functools.lru_cache(maxsize=None)
def config_names(kind: int, in_dtype: torch.dtype, out_dtype: torch.dtype, scale_mode: int = 0) -> tuple:
    """The sm_90 grouped kernels of this build for (kind, in, out, FP8 scale mode), in the
    core's index order."""
    return tuple(ops.grouped_configs(kind, in_dtype, out_dtype, 90, scale_mode))


def _key(kind: int, groups: int, tokens: int, n: int, k: int, in_dtype, out_dtype, accumulate: bool,
         torch_ok: bool, scale_mode: int) -> str:
    scales = f"|scale:{scale_mode}" if scale_mode else ""
    return (f"sm90|grouped-{_KIND_NAMES[kind]}|G{groups}|T{tokens}|{n}x{k}|{in_dtype}->{out_dtype}"
            f"{scales}|acc:{int(accumulate)}|torch:{int(torch_ok)}")


def scratch_runner(out, accumulate: bool, shape, dtype, device,
                   run_into: Callable[[torch.Tensor, int], None]) -> Callable[[int], None]:
    """The autotuner's runner of config i: `run_into(scratch, i)` on one scratch output, made at
    the first run (a copy of `out` when accumulating, so that the call itself adds only once)."""
    scratch = []

    def run_config(i):
        if not scratch:
            scratch.append(out.clone() if accumulate else torch.empty(shape, dtype=dtype, device=device))
        run_into(scratch[0], i)
    return run_config


def choose(kind: int, groups: int, tokens: int, n: int, k: int, in_dtype, out_dtype, accumulate: bool,
           run_config: Callable[[int], object], run_torch: Optional[Callable[[], object]],
           device: Optional[torch.device], scale_mode: int = 0) -> Optional[str]:
    """'torch._grouped_mm' or 'cutlass:<config>' for this problem (timed now if never timed:
    `run_config(i)` runs config i into a scratch output, `run_torch` the peer, None where it
    does not compute this call), or None where autotuning is off or may not time now and
    nothing is cached: the caller then runs the cost model's choice (config -1)."""
    if not autotune.enabled() or torch.compiler.is_compiling():
        return None
    names = config_names(kind, in_dtype, out_dtype, scale_mode)
    key = _key(kind, groups, tokens, n, k, in_dtype, out_dtype, accumulate, run_torch is not None, scale_mode)
    known = autotune.lookup(key)
    if known == TORCH and run_torch is not None or autotune.config_index(known, names) is not None:
        return known
    if len(names) == 1 and run_torch is None:
        # Nothing to choose between (an fp16 pass, a bf16-out wgrad, a call torch may not
        # answer): no trial run, which, never cached, would run the kernel twice every call.
        return f"{autotune.CUTLASS_PREFIX}{names[0]}"
    if not autotune.may_time():
        return None
    candidates = {f"{autotune.CUTLASS_PREFIX}{name}": (lambda i=i: run_config(i))
                  for i, name in enumerate(names)}
    if run_torch is not None:
        candidates[TORCH] = run_torch
    candidates = {name: fn for name, fn in candidates.items() if _runs(fn)}
    if len(candidates) == 1:  # the one candidate that takes this problem: the trial runs once
        choice = next(iter(candidates))
        autotune.remember(key, choice)
        return choice
    if not candidates:
        return None
    prefer = TORCH if TORCH in candidates else None
    return autotune.choose(key, candidates, prefer=prefer, device=device)


def _runs(fn: Callable[[], object]) -> bool:
    """Whether a candidate takes this call: a kernel that cannot implement the problem, or a
    peer that refuses it, raises here and is left out (the others are timed)."""
    try:
        fn()
        return True
    except (RuntimeError, ValueError, NotImplementedError):
        return False


def config_index(choice: Optional[str], kind: int, in_dtype, out_dtype, scale_mode: int = 0) -> int:
    """The core's config index of a 'cutlass:<config>' choice; -1 (the cost model) otherwise."""
    if choice is None:  # no lookup of the build's configs: torch.compile traces this
        return -1
    index = autotune.config_index(choice, config_names(kind, in_dtype, out_dtype, scale_mode))
    return -1 if index is None else index
