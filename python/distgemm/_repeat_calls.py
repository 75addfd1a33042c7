"""Calls seen before: the signature of a call whose checks passed and whose path was settled ->
the runner that path took. A repeated call is then one dict lookup, for the ops where the host
path shows (the dense and grouped GEMMs of a few microseconds)."""

from __future__ import annotations

from typing import Callable, Hashable, Optional


class RepeatCalls(dict):
    """A bounded table: beyond `limit` signatures it starts again, so dynamic shapes stay bounded.
    A dict, so that the per-call truth test and `get` run in C (a Python method costs ~0.2 us on
    the H200's host); `get` of an unhashable key raises TypeError, which callers treat as a miss
    (an argument the checks will name)."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self._limit = limit

    def put(self, key: Optional[Hashable], run: Callable) -> None:
        if key is None:
            return
        if len(self) >= self._limit:
            self.clear()
        self[key] = run
