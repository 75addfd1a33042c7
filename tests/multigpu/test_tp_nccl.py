"""Tensor-parallel ops on several GPUs with NCCL (the fused path): each test spawns its ranks,
DISTGEMM_TEST_WORLD of them (default 2; 4 and 8 on the larger machines)."""

import os

import pytest
import torch

from tests import tp_checks
from tests.dist_helpers import run_ranks

WORLD = int(os.environ.get("DISTGEMM_TEST_WORLD", "2"))
pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")]


def test_all_gather_matmul():
    run_ranks(tp_checks.check_all_gather_matmul, WORLD, "nccl")


def test_all_gather_matmul_fp8_scales():
    run_ranks(tp_checks.check_all_gather_matmul_fp8, WORLD, "nccl")


@pytest.mark.parametrize("split", ["default", "halves"])
def test_matmul_reduce_scatter(split):
    # "halves": every ring step of 256+ rows runs as two launches, as large shapes do
    env = {"DISTGEMM_RS_SPLIT_GFLOPS": "0"} if split == "halves" else None
    run_ranks(tp_checks.check_matmul_reduce_scatter, WORLD, "nccl", env=env)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_parallel_linear_autograd_matches_linear(sequence_parallel):
    run_ranks(tp_checks.check_parallel_mlp_autograd, WORLD, "nccl", sequence_parallel)


def test_cuda_graph_torch_compile_and_alternating_shapes():
    run_ranks(tp_checks.check_graph_compile_and_alternation, WORLD, "nccl")


def test_mismatched_shapes_are_reported():
    run_ranks(tp_checks.check_mismatched_shapes, WORLD, "nccl")


def test_peer_that_never_arrives_times_out():
    run_ranks(tp_checks.check_peer_timeout, WORLD, "nccl", env={"DISTGEMM_TIMEOUT_S": "3"}, timeout=300)
