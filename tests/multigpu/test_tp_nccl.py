"""Tensor-parallel ops on several GPUs with NCCL (the fused backend, with each of its two
algorithms): each test spawns its ranks, DISTGEMM_TEST_WORLD of them (default 2; 4 and 8 on the
larger machines)."""

import os

import pytest
import torch

from tests import tp_checks
from tests.dist_helpers import run_ranks

WORLD = int(os.environ.get("DISTGEMM_TEST_WORLD", "2"))
pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")]


ALGOS = ["fused", "decomposed"]


def algo_env(algo, **extra):
    return {"DISTGEMM_TP_ALGO": algo, **extra}


# pieces: how many parts a chunk of the decomposed algorithm travels in (DISTGEMM_TP_PIECES, "3t":
# three tapered ones); they cut the test shapes unevenly (1000 rows into 256 + 256 + 256 + 232,
# 520 into 256 + 256 + 8)
@pytest.mark.parametrize("algo,pieces", [("fused", "auto"), ("decomposed", "auto"), ("decomposed", "4")])
def test_all_gather_matmul(algo, pieces):
    run_ranks(tp_checks.check_all_gather_matmul, WORLD, "nccl", env=algo_env(algo, DISTGEMM_TP_PIECES=pieces))


def test_all_gather_matmul_fp8_scales():
    # auto: float8 takes the fused algorithm; the decomposed one refuses it by name
    run_ranks(tp_checks.check_all_gather_matmul_fp8, WORLD, "nccl")


@pytest.mark.parametrize("algo,split", [("fused", "default"), ("fused", "halves"), ("decomposed", "default"),
                                        ("decomposed", "pieces3t"), ("decomposed", "pieces4")])
def test_matmul_reduce_scatter(algo, split):
    # "halves": every fused ring step of 256+ rows runs as two launches, as large shapes do
    extra = ({"DISTGEMM_RS_SPLIT_GFLOPS": "0"} if split == "halves" else
             {"DISTGEMM_TP_PIECES": split[len("pieces"):]} if split.startswith("pieces") else {})
    run_ranks(tp_checks.check_matmul_reduce_scatter, WORLD, "nccl", env=algo_env(algo, **extra))


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_parallel_linear_autograd_matches_linear(sequence_parallel, algo):
    run_ranks(tp_checks.check_parallel_mlp_autograd, WORLD, "nccl", sequence_parallel, env=algo_env(algo))


@pytest.mark.parametrize("algo", ALGOS)
def test_cuda_graph_torch_compile_and_alternating_shapes(algo):
    run_ranks(tp_checks.check_graph_compile_and_alternation, WORLD, "nccl", env=algo_env(algo))


def test_mismatched_shapes_are_reported():
    run_ranks(tp_checks.check_mismatched_shapes, WORLD, "nccl")


def test_collectives_path_on_every_rank():
    run_ranks(tp_checks.check_collectives_path_on_every_rank, WORLD, "nccl")


def test_fp8_block_scales():
    # the collectives path on a fused group: announced on the workspace first
    run_ranks(tp_checks.check_fp8_block_scales, WORLD, "nccl")


@pytest.mark.parametrize("algo", ALGOS)
def test_peer_that_never_arrives_times_out(algo):
    run_ranks(tp_checks.check_peer_timeout, WORLD, "nccl", env=algo_env(algo, DISTGEMM_TIMEOUT_S="3"), timeout=300)


@pytest.mark.parametrize("algo", ALGOS)
def test_empty_shards(algo):
    # no rows, no K (all-gather) or no N (reduce-scatter): beta * c, as on the collectives path
    run_ranks(tp_checks.check_empty_shards, WORLD, "nccl", env=algo_env(algo))
