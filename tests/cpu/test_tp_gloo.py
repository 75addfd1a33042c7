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
