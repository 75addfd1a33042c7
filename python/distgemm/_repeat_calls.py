"""Calls seen before: the signature of a call whose checks passed and whose path was settled ->
the runner that path took. A repeated call is then one dict lookup, for the ops where the host
path shows (the dense and grouped GEMMs of a few microseconds)."""

from __future__ import annotations

from typing import Callable, Dict, Hashable, Optional


class RepeatCalls:
    """A bounded table: beyond `limit` signatures it starts again, so dynamic shapes stay bounded."""

    def __init__(self, limit: int = 4096):
        self._runs: Dict[Hashable, Callable] = {}
        self._limit = limit

    def __bool__(self) -> bool:
        return bool(self._runs)

    def get(self, key: Optional[Hashable]) -> Optional[Callable]:
        """The runner stored for `key`; None for a key never stored, None, or unhashable (an
        argument the checks will name)."""
        try:
            return self._runs.get(key)
        except TypeError:
            return None

    def put(self, key: Optional[Hashable], run: Callable) -> None:
        if key is None:
            return
        if len(self._runs) >= self._limit:
            self._runs.clear()
        self._runs[key] = run

    def clear(self) -> None:
        self._runs.clear()
