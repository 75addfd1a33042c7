"""Tensor-parallel ops through gloo on CPU tensors (the collectives path), at the group sizes
users run: 2, 4 and 8 ranks."""

import pytest

from tests import tp_checks
from tests.dist_helpers import run_ranks


@pytest.mark.parametrize("world", [2, 4, 8])
def test_tp_ops_and_modules_match_reference(world):
    run_ranks(tp_checks.check_everything_gloo, world, "gloo")


def test_mismatched_shapes_are_reported():
    run_ranks(tp_checks.check_mismatched_shapes, 2, "gloo")


@pytest.mark.parametrize("var,value", [("DISTGEMM_TP_ALGO", "fastest"), ("DISTGEMM_TP_BACKEND", "nvshmem"),
                                       ("DISTGEMM_TIMEOUT_S", "-1"), ("DISTGEMM_TIMEOUT_S", "soon")])
def test_malformed_environment_is_named(monkeypatch, var, value):
    from distgemm import tp

    monkeypatch.setenv(var, value)
    read = {"DISTGEMM_TP_ALGO": tp._algo, "DISTGEMM_TP_BACKEND": tp._backend,
            "DISTGEMM_TIMEOUT_S": tp.timeout_s}[var]
    with pytest.raises(ValueError, match=var):
        read()


@pytest.mark.parametrize("value,code", [("auto", 0), ("fused", 1), ("DECOMPOSED", 2)])
def test_algo_environment_maps_to_the_c_api(monkeypatch, value, code):
    from distgemm import tp

    monkeypatch.setenv("DISTGEMM_TP_ALGO", value)
    assert tp._algo() == code  # dg_tp_algo: AUTO 0, FUSED 1, DECOMPOSED 2
