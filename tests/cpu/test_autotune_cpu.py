"""The autotuner's choice rule with the timing replaced (no GPU needed): the fastest candidate
wins, except that the preferred one (the vendor library) keeps near-ties."""

import json
import multiprocessing

import pytest

import distgemm
from distgemm import autotune


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """choose() with each candidate's measured time given by the test."""
    monkeypatch.setattr(autotune, "may_time", lambda: True)
    monkeypatch.setattr(autotune, "_LOADED", True)
    autotune.clear()
    times = {}

    def time_ms(fn, reps, flush):  # a number, or a list: the next timing of that candidate
        t = times[fn()]
        return t.pop(0) if isinstance(t, list) else t
    monkeypatch.setattr(autotune, "_time_ms", time_ms)
    monkeypatch.setattr(autotune, "flush_buffer", lambda: None)
    with distgemm.settings(autotune_cache=str(tmp_path / "cache.json")):
        yield times
    autotune.clear()


def candidates(names):
    return {name: (lambda n=name: n) for name in names}


def test_fastest_wins_without_a_preference(timed):
    timed.update({"ours": 0.99, "vendor": 1.0})
    assert autotune.choose("k1", candidates(["ours", "vendor"])) == "ours"


@pytest.mark.parametrize("ours_ms, expected", [(0.99, "vendor"), (0.975, "vendor"), (0.96, "ours"), (1.2, "vendor")])
def test_preferred_keeps_near_ties(timed, ours_ms, expected):
    timed.update({"ours": ours_ms, "vendor": 1.0})
    assert autotune.choose(f"k-{ours_ms}", candidates(["ours", "vendor"]), prefer="vendor") == expected


def test_choice_is_remembered(timed):
    timed.update({"a": 2.0, "b": 1.0})
    assert autotune.choose("k2", candidates(["a", "b"])) == "b"
    timed.update({"a": 0.1})  # not timed again: the stored choice stands
    assert autotune.choose("k2", candidates(["a", "b"])) == "b"
    assert autotune.lookup("k2") == "b"


def test_a_close_win_must_hold_head_to_head(timed):
    # 5% ahead in the first rounds (one of several candidates, by chance), level when timed
    # again beside the vendor alone: the vendor keeps it
    timed.update({"ours": [0.95] * 3 + [1.0] * 3, "other": 1.1, "vendor": 1.0})
    assert autotune.choose("close", candidates(["ours", "other", "vendor"]), prefer="vendor") == "vendor"
    timed.update({"ours": [0.95] * 3 + [0.94] * 3, "vendor": 1.0})
    assert autotune.choose("close-held", candidates(["ours", "other", "vendor"]), prefer="vendor") == "ours"


def test_a_clear_win_is_not_timed_again(timed):
    timed.update({"ours": [0.5] * 3, "vendor": 1.0})  # a fourth timing of ours would fail
    assert autotune.choose("clear", candidates(["ours", "vendor"]), prefer="vendor") == "ours"


def _remember_many(path, prefix, count, barrier):
    """A process that stores `count` choices one by one into the cache file at `path`."""
    import distgemm
    from distgemm import autotune as tuner

    with distgemm.settings(autotune_cache=path):
        barrier.wait()
        for i in range(count):
            tuner.remember(f"{prefix}-{i}", f"choice-{prefix}-{i}")


def test_two_processes_storing_at_once_keep_both_sides_choices(tmp_path):
    path = tmp_path / "cache.json"
    path.write_text(json.dumps({"earlier": "kept"}))
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_remember_many, args=(str(path), name, 150, barrier)) for name in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0
    stored = json.loads(path.read_text())
    expected = {f"{name}-{i}": f"choice-{name}-{i}" for name in ("a", "b") for i in range(150)}
    expected["earlier"] = "kept"
    assert stored == expected
    assert not list(tmp_path.glob("*.tmp")), "a temporary file was left behind"


@pytest.mark.parametrize("content", ["[" * 200_000, '{"k": {"nested": "dict"}}', "{truncated", "[1, 2]",
                                     b"\xff\xfe{\x80 not UTF-8", b'{"k": "\xc3"}'])
def test_a_corrupt_cache_file_is_treated_as_empty(monkeypatch, tmp_path, content):
    path = tmp_path / "cache.json"
    if isinstance(content, bytes):  # binary garbage (a truncated or clobbered write)
        path.write_bytes(content)
    else:
        path.write_text(content)
    monkeypatch.setattr(autotune, "_LOADED", False)
    autotune.clear()
    try:
        with distgemm.settings(autotune_cache=str(path)):
            with pytest.warns(RuntimeWarning, match="ignoring the cache file"):
                assert autotune.lookup("k") is None
            autotune.remember("k", "v")  # rewrites the file whole
            assert json.loads(path.read_text()) == {"k": "v"}
    finally:
        autotune.clear()


def test_another_cache_file_is_read_and_written_alone(monkeypatch, tmp_path):
    """A block under another autotune_cache reads that file, not the choices of the one read
    before, and writes its own choices there alone; the first file's choices come back after."""
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps({"k": "first"}))
    second.write_text(json.dumps({"k": "second"}))
    monkeypatch.setattr(autotune, "_LOADED", False)
    autotune.clear()
    try:
        with distgemm.settings(autotune_cache=str(first)):
            assert autotune.lookup("k") == "first"
        with distgemm.settings(autotune_cache=str(second)):
            assert autotune.lookup("k") == "second"
            autotune.remember("only-second", "v")
        assert json.loads(second.read_text()) == {"k": "second", "only-second": "v"}
        with distgemm.settings(autotune_cache=str(first)):
            assert autotune.lookup("k") == "first" and autotune.lookup("only-second") is None
            autotune.remember("only-first", "w")
        assert json.loads(first.read_text()) == {"k": "first", "only-first": "w"}
    finally:
        autotune.clear()
