"""Tensor-parallel ops through gloo on CPU tensors (the collectives path), at the group sizes
users run: 2, 4 and 8 ranks."""

import pytest

import distgemm

from tests import tp_checks
from tests.dist_helpers import run_ranks


@pytest.mark.parametrize("world", [2, 4, 8])
def test_tp_ops_and_modules_match_reference(world):
    run_ranks(tp_checks.check_everything_gloo, world, "gloo")


def test_mismatched_shapes_are_reported():
    run_ranks(tp_checks.check_mismatched_shapes, 2, "gloo")


def test_bad_arguments_are_named_on_every_rank():
    run_ranks(tp_checks.check_arguments_are_named, 2, "gloo")


def test_recover_after_a_set_up_exchange_timed_out_on_one_rank():
    run_ranks(tp_checks.check_recover_after_a_timed_out_exchange, 2, "gloo", timeout=120)


def test_gathered_gradient_on_some_ranks_only_keeps_the_ranks_paired():
    run_ranks(tp_checks.check_gathered_gradient_on_some_ranks_only, 2, "gloo", timeout=120)


def test_collectives_path_on_every_rank():
    run_ranks(tp_checks.check_collectives_path_on_every_rank, 2, "gloo")


def test_fp8_block_scales():
    run_ranks(tp_checks.check_fp8_block_scales, 2, "gloo")


@pytest.mark.parametrize("votes,fused", [(["11", "11"], True), (["01", "11"], False), (["10", "10"], False),
                                         (["00", "11"], False), (["01", "10"], False)])
def test_group_path_is_decided_from_every_rank(votes, fused):
    """Each rank votes '<can run fused><wants it>': fused where all can and want to."""
    from distgemm import tp

    assert tp._decide_fused(votes, "g") is fused


def test_backend_settings_that_differ_are_named():
    """Ranks that could all run fused but set DISTGEMM_TP_BACKEND differently would wait for each
    other on different paths: every rank gets the same ValueError naming the setting."""
    from distgemm import tp

    with pytest.raises(ValueError, match=r"ranks \[1, 2\] of group 'g' set DISTGEMM_TP_BACKEND=collectives"):
        tp._decide_fused(["11", "10", "10"], "g")


@pytest.mark.parametrize("var,value", [("DISTGEMM_TP_ALGO", "fastest"), ("DISTGEMM_TP_BACKEND", "nvshmem"),
                                       ("DISTGEMM_TIMEOUT_S", "-1"), ("DISTGEMM_TIMEOUT_S", "soon"),
                                       ("DISTGEMM_TP_PIECES", "5"), ("DISTGEMM_TP_PIECES", "2x"),
                                       ("DISTGEMM_RS_SPLIT_GFLOPS", "-3"), ("DISTGEMM_RS_SPLIT_GFLOPS", "nan")])
def test_malformed_setting_is_named(monkeypatch, var, value):
    """From the environment (read again by reload_settings, which keeps the settings in force)
    and as an override of distgemm.settings: a ValueError naming the variable or the setting."""
    from distgemm import _settings

    before = distgemm.current_settings()
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        distgemm.reload_settings()
    assert distgemm.current_settings() is before
    field = _settings.variable_field(var)
    with pytest.raises(ValueError, match=f"distgemm.settings: {field} must be"):
        with distgemm.settings(**{field: value}):
            raise AssertionError("the block ran with a malformed setting")
    assert distgemm.current_settings() is before


@pytest.mark.parametrize("env,settings", [
    ({}, [0, 0, 0, 0]),  # every field zero: the core's defaults
    ({"DISTGEMM_TP_ALGO": "fused"}, [1, 0, 0, 0]),
    ({"DISTGEMM_TP_ALGO": "DECOMPOSED", "DISTGEMM_TP_PIECES": "3t"}, [2, 3, 1, 0]),
    ({"DISTGEMM_TP_PIECES": "4"}, [0, 4, 0, 0]),
    ({"DISTGEMM_RS_SPLIT_GFLOPS": "0"}, [0, 0, 0, -1]),  # the core: negative halves every step
    ({"DISTGEMM_RS_SPLIT_GFLOPS": "12.5"}, [0, 0, 0, 12.5]),
])
def test_environment_maps_to_the_c_api_settings(monkeypatch, env, settings):
    """dg_tp_settings (algo, pieces, tapered, rs_split_gflops), read once and re-read on request."""
    from distgemm import tp

    for var in ("DISTGEMM_TP_ALGO", "DISTGEMM_TP_PIECES", "DISTGEMM_RS_SPLIT_GFLOPS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    distgemm.reload_settings()
    try:
        assert tp._tp_settings() == [float(v) for v in settings]
        monkeypatch.setenv("DISTGEMM_TP_PIECES", "2")  # not read again until reload_settings
        assert tp._tp_settings() == [float(v) for v in settings]
    finally:
        monkeypatch.undo()
        distgemm.reload_settings()
    overrides = {_settings_field(var): value for var, value in env.items()}
    with distgemm.settings(**overrides):  # the same through the settings
        assert tp._tp_settings() == [float(v) for v in settings]


def _settings_field(variable: str) -> str:
    from distgemm import _settings

    return _settings.variable_field(variable)


def test_workspace_sizes_follow_the_layout():
    """Host arithmetic of the symmetric workspaces (no device needed): an 8 KiB flag header, the
    exchanged data, N output elements for the scaled bias, and the decomposed algorithm's 32 MiB
    cuBLASLt scratch."""
    import torch

    from distgemm._library import ops

    def up(x, to):
        return (x + to - 1) // to * to

    scratch, header = 32 << 20, 8192
    for world, rows, k, n in ((2, 2048, 4096, 3072), (4, 333, 512, 1032), (8, 1, 64, 264)):
        # all-gather: gathered operand (world * rows, K) bf16, then world * rows FP32 scales
        gathered = header + world * rows * k * 2
        bias = up(up(gathered, 256) + world * rows * 4, 256)
        expect = up(bias + n * 2, 4096) + scratch
        assert ops.tp_workspace_size(1, rows, k, n, torch.bfloat16, torch.bfloat16, world) == expect
        # reduce-scatter: (world - 1) slots to send and (world - 1) received, (rows, N) fp32 each
        slot = up(rows * n * 4, 256)
        expect = up(header + 2 * (world - 1) * slot + n * 4, 4096) + scratch
        assert ops.tp_workspace_size(2, rows, k, n, torch.bfloat16, torch.float32, world) == expect
    with pytest.raises(ValueError, match="world size"):
        ops.tp_workspace_size(1, 16, 64, 64, torch.bfloat16, torch.bfloat16, 1)


@pytest.mark.parametrize("reason,kind,words", [
    (0, TimeoutError, ("never arrived", "group rank 1")),
    (8, TimeoutError, ("given up", "group rank 1", "did not read")),
    (3, ValueError, ("disagree", "another number of rows")),
])
def test_error_word_reasons_raise_named_errors(reason, kind, words):
    """The device's error word (reason << 24 | op << 16 | peer + 1) as the exception users see:
    a peer that gave up on this rank's call (its failure mark) is a TimeoutError too."""
    from distgemm import tp

    code = (reason << 24) | (1 << 16) | 2
    with pytest.raises(kind) as info:
        tp._raise_for_code(code, 0)
    for w in words:
        assert w in str(info.value)
    assert "recover" in str(info.value)
