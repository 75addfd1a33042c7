"""distgemm's settings: the DISTGEMM_* variables read into one frozen object, overrides for a
block that restore what was there, bad values named, and no other module reading the
environment."""

import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch

import distgemm
from distgemm import _settings

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_from_an_empty_environment():
    s = _settings.from_environment({})
    assert (s.timeout_s, s.tp_backend, s.tp_algo, s.tp_pieces, s.rs_split_gflops) == (600.0, "auto", "auto", "auto", None)
    assert (s.autotune, s.autotune_cache, s.grouped_backend, s.debug) == (True, None, "auto", False)
    assert (s.bench_timing, s.bench_compile, s.commit) == ("interleaved", True, None)
    assert s.cache_dir == Path.home() / ".cache" / "distgemm"


def test_every_variable_sets_its_field():
    env = {"DISTGEMM_TIMEOUT_S": "12.5", "DISTGEMM_TP_BACKEND": "Collectives", "DISTGEMM_TP_ALGO": "decomposed",
           "DISTGEMM_TP_PIECES": "3T", "DISTGEMM_RS_SPLIT_GFLOPS": "0", "DISTGEMM_AUTOTUNE": "0",
           "DISTGEMM_AUTOTUNE_CACHE": "/tmp/c.json", "DISTGEMM_CACHE": "/tmp/dg", "DISTGEMM_GROUPED_BACKEND": "torch",
           "DISTGEMM_DEBUG": "yes", "DISTGEMM_BENCH_TIMING": "sustained", "DISTGEMM_BENCH_COMPILE": "0",
           "DISTGEMM_COMMIT": "abc123"}
    s = _settings.from_environment(env)
    assert dataclasses.asdict(s) == {
        "timeout_s": 12.5, "tp_backend": "collectives", "tp_algo": "decomposed", "tp_pieces": "3t",
        "rs_split_gflops": 0.0, "autotune": False, "autotune_cache": "/tmp/c.json", "cache_dir": Path("/tmp/dg"),
        "grouped_backend": "torch", "debug": True, "bench_timing": "sustained", "bench_compile": False,
        "commit": "abc123"}
    assert {_settings.variable_field(v) for v in env} == set(dataclasses.asdict(s))


@pytest.mark.parametrize("flag, expected", [("0", False), ("false", False), ("no", False), ("1", True), ("on", True)])
def test_debug_flag_spellings(flag, expected):
    assert _settings.from_environment({"DISTGEMM_DEBUG": flag}).debug is expected


@pytest.mark.parametrize("var, value", [("DISTGEMM_TIMEOUT_S", "0"), ("DISTGEMM_TIMEOUT_S", "inf"),
                                        ("DISTGEMM_TP_BACKEND", "nccl"), ("DISTGEMM_TP_ALGO", "ring"),
                                        ("DISTGEMM_TP_PIECES", "0"), ("DISTGEMM_TP_PIECES", "t"),
                                        ("DISTGEMM_RS_SPLIT_GFLOPS", "-1"), ("DISTGEMM_GROUPED_BACKEND", "fastest"),
                                        ("DISTGEMM_BENCH_TIMING", "random")])
def test_a_malformed_variable_is_named(var, value):
    with pytest.raises(ValueError, match=f"{var} must be"):
        _settings.from_environment({var: value})


def test_overrides_apply_to_the_block_and_restore_after_it():
    before = distgemm.current_settings()
    with distgemm.settings(grouped_backend="torch", timeout_s=5) as inside:
        assert distgemm.current_settings() is inside
        assert (inside.grouped_backend, inside.timeout_s, inside.tp_algo) == ("torch", 5.0, before.tp_algo)
        with distgemm.settings(grouped_backend=None, debug=True):  # None: the default
            assert distgemm.current_settings().grouped_backend == "auto"
            assert distgemm.current_settings().debug is True
        assert distgemm.current_settings() is inside
    assert distgemm.current_settings() is before
    with pytest.raises(RuntimeError, match="inside"):
        with distgemm.settings(debug=True):
            raise RuntimeError("inside")
    assert distgemm.current_settings() is before  # restored on an exception too


def test_the_settings_object_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        distgemm.current_settings().timeout_s = 1.0


@pytest.mark.parametrize("name, value", [("timeout_s", -2), ("timeout_s", "soon"), ("tp_pieces", 5),
                                         ("tp_backend", "nvshmem"), ("rs_split_gflops", float("nan")),
                                         ("grouped_backend", 3)])
def test_a_bad_override_is_named_before_the_block(name, value):
    before = distgemm.current_settings()
    with pytest.raises(ValueError, match=f"distgemm.settings: {name} must be"):
        with distgemm.settings(**{name: value}):
            raise AssertionError("the block ran")
    assert distgemm.current_settings() is before


def test_an_unknown_setting_is_named():
    with pytest.raises(TypeError, match="unknown setting 'grouped_backed'"):
        with distgemm.settings(grouped_backed="torch"):
            pass
    with pytest.raises(ValueError, match="'DISTGEMM_NOPE' is not a distgemm setting"):
        _settings.variable_field("DISTGEMM_NOPE")


def test_equal_settings_are_one_object():
    before = distgemm.current_settings()
    with distgemm.settings(debug=not before.debug, tp_pieces=2) as first:
        pass
    with distgemm.settings(tp_pieces="2", debug=not before.debug) as again:
        assert again is first
    with distgemm.settings():
        assert distgemm.current_settings() is before


def test_reload_reads_the_environment_and_a_bad_value_keeps_the_settings(monkeypatch):
    before = distgemm.current_settings()
    try:
        monkeypatch.setenv("DISTGEMM_TIMEOUT_S", "7")
        assert distgemm.current_settings().timeout_s == before.timeout_s  # read once
        assert distgemm.reload_settings().timeout_s == 7.0
        monkeypatch.setenv("DISTGEMM_TIMEOUT_S", "never")
        with pytest.raises(ValueError, match="DISTGEMM_TIMEOUT_S must be"):
            distgemm.reload_settings()
        assert distgemm.current_settings().timeout_s == 7.0
    finally:
        monkeypatch.undo()
        distgemm.reload_settings()
    assert distgemm.current_settings() == before


def test_symmetric_memory_multicast_is_off_after_import():
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_only_the_settings_module_reads_the_environment():
    pattern = re.compile(r"os\.environ|getenv")
    readers = []
    for path in sorted((ROOT / "python" / "distgemm").rglob("*.py")) + sorted((ROOT / "csrc").rglob("*.*")):
        if path.name == "_settings.py" or "__pycache__" in path.parts:
            continue
        text = path.read_text(errors="replace")
        readers += [f"{path.relative_to(ROOT)}:{i + 1}" for i, line in enumerate(text.splitlines())
                    if pattern.search(line)]
    assert readers == [], readers


@pytest.mark.parametrize("name, value, kind", [("debug", torch.ones(2), TypeError), ("autotune", 2.5, TypeError),
                                               ("cache_dir", 3, TypeError), ("debug", 2, TypeError)])
def test_a_setting_of_the_wrong_type_is_named(name, value, kind):
    with pytest.raises(kind, match=f"distgemm.settings: {name} must be"):
        with distgemm.settings(**{name: value}):
            raise AssertionError("the block ran")


def test_flags_take_bools_and_their_spellings():
    with distgemm.settings(debug="yes", autotune=0) as s:
        assert s.debug is True and s.autotune is False
    with distgemm.settings(debug=1, autotune="1") as s:
        assert s.debug is True and s.autotune is True
