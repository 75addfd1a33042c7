"""The grouped autotuner's rule with the timing replaced (no GPU needed): the fastest of the
compiled configurations and torch._grouped_mm wins, torch keeps near-ties, a candidate that
refuses the call is left out, a choice is remembered under the problem's key, and nothing is
timed when autotuning is off."""

import pytest
import torch

import distgemm
from distgemm import autotune, grouped_autotune

BF16 = torch.bfloat16


@pytest.fixture
def timed(monkeypatch, tmp_path):
    monkeypatch.setattr(autotune, "may_time", lambda: True)
    monkeypatch.setattr(autotune, "_LOADED", True)
    monkeypatch.setattr(autotune, "flush_buffer", lambda: None)
    autotune.clear()
    times = {}
    monkeypatch.setattr(autotune, "_time_ms", lambda fn, reps, flush: times[fn()])
    with distgemm.settings(autotune_cache=str(tmp_path / "cache.json"), autotune=True):
        yield times
    autotune.clear()


def names(kind=0):
    found = grouped_autotune.config_names(kind, BF16, BF16 if kind < 2 else torch.float32)
    if len(found) < 2:
        pytest.skip("this build has fewer than two grouped configurations for the pass")
    return found


def choose(times, kind=0, with_torch=True, refuse=(), n=512):
    configs = names(kind)
    out = BF16 if kind < 2 else torch.float32

    def run_config(i):
        if i in refuse:
            raise RuntimeError("CUTLASS cannot implement")
        return f"cutlass:{configs[i]}"

    run_torch = (lambda: grouped_autotune.TORCH) if with_torch else None
    return grouped_autotune.choose(kind, 8, 1000, n, 256, BF16, out, False, run_config, run_torch,
                                   None)


def test_fastest_config_wins(timed):
    configs = names()
    timed.update({f"cutlass:{c}": 1.0 for c in configs})
    timed[f"cutlass:{configs[-1]}"] = 0.5
    timed[grouped_autotune.TORCH] = 0.9
    choice = choose(timed)
    assert choice == f"cutlass:{configs[-1]}"
    assert grouped_autotune.config_index(choice, 0, BF16, BF16) == len(configs) - 1


def test_torch_keeps_near_ties(timed):
    configs = names()
    timed.update({f"cutlass:{c}": 1.0 for c in configs})
    timed[grouped_autotune.TORCH] = 1.01
    choice = choose(timed)
    assert choice == grouped_autotune.TORCH
    assert grouped_autotune.config_index(choice, 0, BF16, BF16) == -1  # not one of ours


def test_refusing_candidates_are_left_out(timed):
    configs = names()
    timed.update({f"cutlass:{c}": 2.0 for c in configs})
    timed[f"cutlass:{configs[0]}"] = 0.1  # fastest, but it raises on this call
    timed[grouped_autotune.TORCH] = 1.0
    assert choose(timed, refuse=(0,)) == grouped_autotune.TORCH


def test_choice_is_remembered_per_problem(timed):
    configs = names(2)
    timed.update({f"cutlass:{c}": 1.0 + i for i, c in enumerate(configs)})
    assert choose(timed, kind=2, with_torch=False) == f"cutlass:{configs[0]}"
    timed.update({f"cutlass:{configs[0]}": 9.0})  # not timed again for the same problem
    assert choose(timed, kind=2, with_torch=False) == f"cutlass:{configs[0]}"
    assert choose(timed, kind=2, with_torch=False, n=768) == f"cutlass:{configs[1]}"  # another problem


def test_nothing_is_timed_when_disabled(timed, monkeypatch):
    names()
    with distgemm.settings(autotune=False):
        assert choose(timed) is None  # timed is empty: a timing would have raised KeyError
    monkeypatch.setattr(autotune, "may_time", lambda: False)  # graph capture, compile
    assert choose(timed) is None


def _choose_among(monkeypatch, configs, run_config, run_torch=None, scale_mode=0, in_dtype=BF16):
    asked = []

    def config_names(kind, i, o, mode=0):
        asked.append(mode)
        return tuple(configs)

    monkeypatch.setattr(grouped_autotune, "config_names", config_names)
    choice = grouped_autotune.choose(2, 8, 1000, 512, 256, in_dtype, BF16, False, run_config, run_torch, None,
                                     scale_mode=scale_mode)
    assert set(asked) == {scale_mode}  # the FP8 scale mode selects the kernels listed
    return choice


def test_a_sole_config_is_chosen_without_a_trial_run(timed, monkeypatch):
    # One compiled config and no peer (fp16, a bf16-out wgrad, a call torch may not answer): a
    # trial run would never be cached and so run the kernel twice on every call.
    def never(i):
        raise AssertionError("a sole candidate was run to be chosen")

    assert _choose_among(monkeypatch, ["only"], never) == "cutlass:only"
    monkeypatch.setattr(autotune, "may_time", lambda: False)  # graph capture: the same answer
    assert _choose_among(monkeypatch, ["only"], never) == "cutlass:only"


def test_the_one_candidate_that_takes_a_problem_is_remembered(timed, monkeypatch):
    runs = []

    def second_only(i):
        runs.append(i)
        if i == 0:
            raise RuntimeError("CUTLASS cannot implement")
        return "cutlass:b"

    assert _choose_among(monkeypatch, ["a", "b"], second_only) == "cutlass:b"
    assert sorted(runs) == [0, 1] and not timed  # one trial each, nothing timed
    runs.clear()
    assert _choose_among(monkeypatch, ["a", "b"], second_only) == "cutlass:b"
    assert runs == []  # the next call of the problem runs nothing to choose


def test_the_fp8_scale_mode_keeps_its_own_choice(timed, monkeypatch):
    # The FP8 block wgrad and a 16-bit wgrad of the same sizes are different problems: each
    # is timed once and remembered under its own key.
    runs = []

    def run(i):
        runs.append(i)
        if i == 0:
            raise RuntimeError("CUTLASS cannot implement")

    fp8 = torch.float8_e4m3fn
    assert _choose_among(monkeypatch, ["a", "b"], run, scale_mode=2, in_dtype=fp8) == "cutlass:b"
    assert _choose_among(monkeypatch, ["a", "b"], run, scale_mode=2, in_dtype=fp8) == "cutlass:b"
    assert sorted(runs) == [0, 1]  # remembered: the second call ran nothing
    assert _choose_among(monkeypatch, ["a", "b"], run) == "cutlass:b"
    assert sorted(runs) == [0, 0, 1, 1]  # the 16-bit problem was timed on its own
