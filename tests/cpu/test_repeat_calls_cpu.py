"""The table of repeated calls: bounded, tolerant of keys the checks will refuse."""

import pytest

from distgemm._repeat_calls import RepeatCalls


def test_stores_and_forgets():
    table = RepeatCalls(limit=3)
    assert not table
    table.put(("a", 1), len)
    assert table and table.get(("a", 1)) is len
    table.clear()
    assert not table and table.get(("a", 1)) is None


def test_starts_again_beyond_its_limit():
    table = RepeatCalls(limit=3)
    for i in range(3):
        table.put(i, str)
    table.put(3, repr)  # the fourth signature: the table restarts with it alone
    assert table.get(3) is repr and table.get(0) is None


def test_none_and_unhashable_keys_are_misses():
    table = RepeatCalls()
    table.put(None, str)
    assert not table
    table.put(("x",), str)
    assert table.get(None) is None
    with pytest.raises(TypeError):  # an unhashable alpha: callers treat it as a miss
        table.get(([1], 2))
