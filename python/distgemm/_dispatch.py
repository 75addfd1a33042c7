"""One dispatch layer for the GEMM ops. Each op lists its candidates (distgemm's compiled tile
configurations, a vendor call through PyTorch); its `Dispatcher` decides which one runs a call and
remembers calls it has settled.

What the dispatcher owns, for every op alike:
- the choice per problem key: the cached one (memory and disk, ``distgemm.autotune``), else
  timed on the call's own operands on the first eager call (a candidate that raises on its
  trial run is left out, a lone taker is kept without timing), the vendor's keeping near-ties;
- the rules under CUDA-graph capture and torch.compile: no timing, no trial runs (the cached
  choice, else None: the op runs its cost model's kernel);
- the table of repeat calls: the signature of a call whose checks passed and whose choice is
  settled -> the runner it took, so that a repeated call is one dict lookup (the 16-bit dense
  and grouped calls have native tables instead, ``_repeat_calls``; forgotten with these);
- what the last call ran (``autotune.last_backend()``).

The ops keep their argument checks, their autograd and their candidates.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Optional, Sequence

import torch

from . import _repeat_calls, autotune
from ._repeat_calls import RepeatCalls

_is_compiling = torch.compiler.is_compiling


class Candidate:
    """One way to compute an op's call.

    - name: the tuner's name ('cutlass:<config>', 'cublas', 'torch._scaled_mm', ...), stored in
      the cache;
    - run(call): computes the call (its timing runs on the call's own operands);
    - why_not(call): None where it can take the call, else the reason (checked before a cached
      choice is trusted and before anything is timed); None means always;
    - vendor: a library's call, which keeps near-ties (autotune.PREFER_MARGIN);
    - config: the core's index of a compiled tile configuration, -1 for anything else.
    """

    __slots__ = ("name", "run", "why_not", "vendor", "config")

    def __init__(self, name: str, run: Callable, why_not: Optional[Callable] = None, *, vendor: bool = False,
                 config: int = -1):
        self.name, self.run, self.why_not, self.vendor, self.config = name, run, why_not, vendor, config

    def takes(self, call) -> bool:
        return self.why_not is None or self.why_not(call) is None

    def __repr__(self) -> str:
        return f"Candidate({self.name!r})"


def configs(names: Iterable[str], run_config: Callable, why_not: Optional[Callable] = None) -> tuple:
    """A Candidate per compiled tile configuration, named 'cutlass:<config>': run_config(call, i)
    runs config i."""
    return tuple(Candidate(autotune.CUTLASS_PREFIX + name, (lambda call, i=i: run_config(call, i)), why_not,
                           config=i)
                 for i, name in enumerate(names))


def recording(name: str, run: Callable) -> Callable:
    """run(*operands), recording `name` as what the call ran (for calls never traced)."""
    def recorded(*operands):
        autotune.record_eager(name)
        return run(*operands)
    return recorded


class VendorRefused(RuntimeError):
    """A vendor call's own checks refused a call (raised as TypeError, AttributeError or
    ImportError, which from our kernels would be bugs and propagate)."""


class Dispatcher:
    """An op's kernel choice and its table of repeat calls (see the module's docstring)."""

    def __init__(self, op: str, limit: int = 4096):
        self.op = op
        # Read directly by the ops' fast paths (a dict: its truth test and get run in C).
        self.calls = RepeatCalls(limit)
        _DISPATCHERS.append(self)

    def choose(self, key: str, call, candidates: Sequence[Candidate], device: Optional[torch.device] = None,
               timed: Optional[Callable[[], object]] = None) -> Optional[Candidate]:
        """The candidate that runs `call` (problem `key`), or None where the op's cost model decides:
        autotuning off, torch.compile tracing, or graph capture of a problem never timed.
        `timed()`: the call the timing runs (one writing into a scratch output), made only if
        timing happens; `call` itself by default."""
        if not autotune.enabled() or _is_compiling():
            return None
        takers = [c for c in candidates if c.takes(call)]
        if len(takers) == 1:
            # Nothing to choose between: no trial run, which, never cached, would run the
            # kernel twice on every call.
            return takers[0]
        known = autotune.lookup(key)
        for c in takers:
            if c.name == known:
                return c
        if not takers or not autotune.may_time():
            return None
        prefer = next((c.name for c in takers if c.vendor), None)
        run_on = [None]

        def timing_call():
            if run_on[0] is None:
                run_on[0] = call if timed is None else timed()
            return run_on[0]

        def trial(c):
            if not c.vendor:
                return lambda: c.run(timing_call())

            def run_vendor():  # a vendor's checks differ by torch version: any error of theirs is a refusal
                try:
                    return c.run(timing_call())
                except (TypeError, AttributeError, ImportError) as e:
                    raise VendorRefused(f"{c.name}: {e}") from e
            return run_vendor
        name = autotune.choose(key, {c.name: trial(c) for c in takers}, prefer=prefer, device=device)
        return next((c for c in takers if c.name == name), None)

    @staticmethod
    def active() -> bool:
        """Whether a choice may be made or looked up now: autotuning on, torch.compile not
        tracing. The ops ask before they format a key or list candidates (neither is traced)."""
        return autotune.enabled() and not _is_compiling()

    def repeat(self, signature: Optional[Hashable]) -> Optional[Callable]:
        """The runner of a settled call of this signature, where one may run as is (eager,
        autotuning on); None otherwise (and for an unhashable signature: the checks name it)."""
        if not self.calls or _is_compiling() or not autotune.enabled():
            return None
        try:
            return self.calls.get(signature)
        except TypeError:
            return None

    def remember(self, signature: Optional[Hashable], run: Callable, name: Optional[str] = None) -> None:
        """Keeps run(*operands) for the calls of `signature` (eager only). With `name`, the
        runner records it as what the call ran; without, `run` records that itself (the dense
        runners, made with `recording`)."""
        if signature is None or _is_compiling():
            return
        self.calls.put(signature, run if name is None else recording(name, run))

    @staticmethod
    def record(name: str) -> None:
        autotune.record(name)


class GroupedPass:
    """A grouped GEMM call (forward, dgrad or wgrad; 16-bit or FP8) as its candidates take it:
    operands `a` and `b` (x and w, or dy and x), the routing, where the result goes (`out`,
    None: a new tensor of `shape`), and `extra` (the FP8 scales). `scratch()` is the same call
    into a scratch output, for the timing: a copy of `out` where it accumulates, so that the call
    itself adds once."""

    __slots__ = ("a", "b", "offs", "out", "accumulate", "shape", "out_dtype", "trans_w", "autograd", "torch_ok",
                 "extra")

    def __init__(self, a, b, offs, out, accumulate, shape, out_dtype, trans_w=True, autograd=False,
                 torch_ok=False, extra=None):
        self.a, self.b, self.offs, self.out, self.accumulate = a, b, offs, out, accumulate
        self.shape, self.out_dtype, self.trans_w, self.autograd = shape, out_dtype, trans_w, autograd
        self.torch_ok, self.extra = torch_ok, extra

    def destination(self) -> torch.Tensor:
        return self.out if self.out is not None else torch.empty(self.shape, dtype=self.out_dtype,
                                                                 device=self.a.device)

    def scratch(self) -> "GroupedPass":
        out = self.out.clone() if self.accumulate else torch.empty(self.shape, dtype=self.out_dtype,
                                                                     device=self.a.device)
        return GroupedPass(self.a, self.b, self.offs, out, self.accumulate, self.shape, self.out_dtype, self.trans_w,
                           False, self.torch_ok, self.extra)

    def key(self, kind: str, tokens: int, scale_mode: int = 0) -> str:
        """The autotuner's key (the disk cache's: a change drops stored choices). `tokens`: the
        call's token count (training steps keep it), not the routing."""
        n, k = (self.shape[1], self.shape[2]) if kind == "wgrad" else (self.shape[1], self.a.shape[1])
        scales = f"|scale:{scale_mode}" if scale_mode else ""
        return (f"sm90|grouped-{kind}|G{self.offs.numel()}|T{tokens}|{n}x{k}|{self.a.dtype}->{self.out_dtype}"
                f"{scales}|acc:{int(self.accumulate)}|torch:{int(self.torch_ok)}")


_DISPATCHERS: list = []


def _forget_calls() -> None:
    for dispatcher in _DISPATCHERS:
        dispatcher.calls.clear()
    _repeat_calls.clear()


autotune.on_clear(_forget_calls)  # a remembered runner holds a choice the autotuner forgot
