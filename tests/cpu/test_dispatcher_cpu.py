"""The dispatcher's rules, with the candidates and the timing replaced (no GPU needed): the
fastest taker wins and the vendor's keeps near-ties, a candidate that refuses the call (its
why_not, or an error on its trial run) is left out, a lone taker is chosen without running it,
a choice is remembered per problem key, and nothing is timed or looked up where autotuning is
off, under torch.compile, or (for a problem never timed) under graph capture."""

import pytest
import torch

import distgemm
from distgemm import autotune
from distgemm._dispatch import Candidate, Dispatcher, GroupedPass, configs


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """The candidates' medians given by the test (name -> ms); every run is recorded."""
    monkeypatch.setattr(autotune, "may_time", lambda: True)
    monkeypatch.setattr(autotune, "_LOADED", True)
    monkeypatch.setattr(autotune, "flush_buffer", lambda *args, **kwargs: None)
    record = {"times": {}, "runs": [], "timings": 0}

    def medians(candidates, flush):
        record["timings"] += 1
        for fn in candidates.values():
            fn()
        return {name: record["times"][name] for name in candidates}
    monkeypatch.setattr(autotune, "_medians", medians)
    autotune.clear()
    with distgemm.settings(autotune_cache=str(tmp_path / "cache.json"), autotune=True):
        yield record
    autotune.clear()


def candidates(record, names, vendor=None, refuse=(), why_not=None):
    """One candidate per name; those in `refuse` raise on their trial run; why_not(call, name)."""
    def make(name):
        def run(call):
            record["runs"].append((name, call))
            if name in refuse:
                raise RuntimeError(f"{name} cannot implement this call")
            return name
        reason = None if why_not is None else (lambda call, name=name: why_not(call, name))
        return Candidate(name, run, reason, vendor=name == vendor)
    return tuple(make(n) for n in names)


def test_the_fastest_wins_and_the_vendor_keeps_near_ties(timed):
    d = Dispatcher("test")
    timed["times"].update({"a": 1.0, "b": 0.5, "vendor": 0.8})
    assert d.choose("k1", "call", candidates(timed, ["a", "b", "vendor"], vendor="vendor")).name == "b"
    timed["times"].update({"b": 0.79})
    assert d.choose("k2", "call", candidates(timed, ["a", "b", "vendor"], vendor="vendor")).name == "vendor"


def test_a_choice_is_remembered_per_key_and_not_timed_again(timed):
    d = Dispatcher("test")
    timed["times"].update({"a": 2.0, "b": 1.0})
    assert d.choose("k", "call", candidates(timed, ["a", "b"])).name == "b"
    timed["runs"].clear()
    timed["times"].update({"a": 0.1})
    assert d.choose("k", "call", candidates(timed, ["a", "b"])).name == "b"
    assert timed["runs"] == [] and timed["timings"] == 1
    assert autotune.lookup("k") == "b"
    assert d.choose("k-other", "call", candidates(timed, ["a", "b"])).name == "a"


def test_a_candidate_that_raises_on_its_trial_is_left_out(timed):
    d = Dispatcher("test")
    timed["times"].update({"a": 0.1, "b": 1.0, "c": 2.0})
    assert d.choose("k", "call", candidates(timed, ["a", "b", "c"], refuse={"a"})).name == "b"


def test_the_one_candidate_left_after_the_trials_is_remembered_untimed(timed):
    d = Dispatcher("test")
    assert d.choose("k", "call", candidates(timed, ["a", "b"], refuse={"a"})).name == "b"
    assert timed["timings"] == 0 and autotune.lookup("k") == "b"
    timed["runs"].clear()
    assert d.choose("k", "call", candidates(timed, ["a", "b"], refuse={"a"})).name == "b"
    assert timed["runs"] == []  # the next call of the problem runs nothing to choose


def test_nothing_takes_the_call(timed):
    d = Dispatcher("test")
    assert d.choose("k", "call", candidates(timed, ["a", "b"], refuse={"a", "b"})) is None
    assert autotune.lookup("k") is None


def test_why_not_leaves_a_candidate_out_without_running_it(timed):
    d = Dispatcher("test")
    timed["times"].update({"a": 1.0, "b": 2.0, "vendor": 0.1})
    chosen = d.choose("k", "call", candidates(timed, ["a", "b", "vendor"], vendor="vendor",
                                              why_not=lambda call, name: "no" if name == "vendor" else None))
    assert chosen.name == "a" and all(name != "vendor" for name, _ in timed["runs"])


def test_a_lone_taker_is_chosen_without_a_trial_even_under_capture(timed, monkeypatch):
    # One compiled config and no peer (fp16, a bf16-out wgrad, a call torch may not answer): a
    # trial run would never be cached and so run the kernel twice on every call.
    d = Dispatcher("test")
    only = candidates(timed, ["only", "vendor"], why_not=lambda call, name: "no" if name == "vendor" else None)
    assert d.choose("k", "call", only).name == "only"
    monkeypatch.setattr(autotune, "may_time", lambda: False)
    assert d.choose("k", "call", only).name == "only"
    assert timed["runs"] == [] and autotune.lookup("k") is None


def test_a_cached_choice_that_no_longer_takes_the_call_is_decided_again(timed):
    d = Dispatcher("test")
    timed["times"].update({"a": 1.0, "b": 2.0, "c": 3.0})
    assert d.choose("k", "call", candidates(timed, ["a", "b", "c"])).name == "a"
    refuse_a = candidates(timed, ["a", "b", "c"], why_not=lambda call, name: "no" if name == "a" else None)
    assert d.choose("k", "call", refuse_a).name == "b"


def test_capture_and_compile_and_autotune_off_decide_nothing(timed, monkeypatch):
    d = Dispatcher("test")
    timed["times"].update({"a": 1.0, "b": 2.0})
    with distgemm.settings(autotune=False):
        assert not d.active() and d.choose("k", "call", candidates(timed, ["a", "b"])) is None
    monkeypatch.setattr(autotune, "may_time", lambda: False)  # graph capture of a problem never timed
    assert d.choose("k", "call", candidates(timed, ["a", "b"])) is None
    monkeypatch.setattr(autotune, "may_time", lambda: True)
    assert d.choose("k", "call", candidates(timed, ["a", "b"])).name == "a"
    monkeypatch.setattr(autotune, "may_time", lambda: False)  # capture of a problem timed before
    assert d.choose("k", "call", candidates(timed, ["a", "b"])).name == "a"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr("distgemm._dispatch._is_compiling", lambda: True)
    assert not d.active() and d.choose("k", "call", candidates(timed, ["a", "b"])) is None
    assert timed["timings"] == 1


def test_the_timing_runs_on_the_timed_call_made_once(timed):
    d = Dispatcher("test")
    timed["times"].update({"a": 1.0, "b": 2.0})
    made = []

    def scratch():
        made.append(1)
        return "scratch"
    assert d.choose("k", "call", candidates(timed, ["a", "b"]), timed=scratch).name == "a"
    assert made == [1] and {call for _, call in timed["runs"]} == {"scratch"}
    timed["runs"].clear()
    assert d.choose("k", "call", candidates(timed, ["a", "b"]), timed=scratch).name == "a"
    assert made == [1]  # cached: nothing timed, no scratch made


def test_configs_name_and_index_the_tile_configurations():
    ran = []
    found = configs(("x", "y"), lambda call, i: ran.append((call, i)))
    assert [c.name for c in found] == ["cutlass:x", "cutlass:y"] and [c.config for c in found] == [0, 1]
    found[1].run("call")
    assert ran == [("call", 1)]


def test_repeat_calls_are_remembered_and_forgotten_with_the_choices(timed):
    d = Dispatcher("test")
    d.remember(("sig",), lambda *operands: ("ran", operands), name="cutlass:x")
    assert d.repeat(("sig",))(1, 2) == ("ran", (1, 2)) and autotune.last_backend() == "cutlass:x"
    assert d.repeat(("other",)) is None and d.repeat([]) is None  # unhashable: the checks name it
    d.remember(None, lambda: None)  # a call without a signature is never remembered
    assert len(d.calls) == 1
    with distgemm.settings(autotune=False):
        assert d.repeat(("sig",)) is None
    autotune.clear()
    assert d.repeat(("sig",)) is None


def test_grouped_pass_keys_and_scratch():
    x, w = torch.zeros(100, 32, dtype=torch.bfloat16), torch.zeros(4, 64, 32, dtype=torch.bfloat16)
    offs = torch.tensor([10, 10, 60, 100], dtype=torch.int32)
    out = torch.ones(100, 64)
    call = GroupedPass(x, w, offs, out, True, (100, 64), torch.float32)
    assert call.key("forward", 100) == "sm90|grouped-forward|G4|T100|64x32|torch.bfloat16->torch.float32|acc:1|torch:0"
    scratch = call.scratch()
    assert scratch.out is not out and torch.equal(scratch.out, out)  # accumulating: a copy of out
    wgrad = GroupedPass(torch.zeros(64, 512), torch.zeros(32, 512), offs, None, False, (4, 64, 32), torch.float32)
    assert wgrad.key("wgrad", 512, 2) == "sm90|grouped-wgrad|G4|T512|64x32|torch.float32->torch.float32|scale:2|acc:0|torch:0"
    assert wgrad.destination().shape == (4, 64, 32)


def test_a_vendor_type_error_is_a_refusal_and_ours_is_a_bug(timed):
    d = Dispatcher("test")
    timed["times"].update({"ours": 1.0, "other": 2.0, "vendor": 0.1})

    def raising(exc):
        def run(call):
            raise exc("unexpected argument")
        return run
    vendor = Candidate("vendor", raising(TypeError), vendor=True)
    takers = candidates(timed, ["ours", "other"]) + (vendor,)
    assert d.choose("k", "call", takers).name == "ours"  # the vendor's TypeError: left out
    broken = Candidate("broken", raising(AttributeError))
    with pytest.raises(AttributeError, match="unexpected argument"):  # ours: a bug, never hidden
        d.choose("k-bug", "call", candidates(timed, ["ours"]) + (broken,))
