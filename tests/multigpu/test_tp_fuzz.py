"""Randomized tensor-parallel cases at 2 ranks with NCCL against the FP64 reference of every
rank's output (the case generator and checks: tests/tp_fuzz_checks.py).

DISTGEMM_FUZZ_EXAMPLES cases (default 40), the same on every rank (seed DISTGEMM_FUZZ_SEED,
default 1234); DISTGEMM_FUZZ_TIME_S caps the wall time of the loop; DISTGEMM_FUZZ_REPORT=<path>
gets one JSON line per op ("tp.all_gather_matmul", ...). Each wait on a peer is bounded by
DISTGEMM_TIMEOUT_S=20 here, and the whole run by run_ranks' timeout.
"""

import os

import pytest
import torch

from tests import tp_fuzz_checks
from tests.dist_helpers import run_ranks
from tests.fuzz_helpers import fuzz_examples, fuzz_time_cap

WORLD = 2
pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")]


def test_tp_ops_fuzz():
    n_cases, cap = fuzz_examples(40), fuzz_time_cap()
    seed = int(os.environ.get("DISTGEMM_FUZZ_SEED", "1234"))
    # bounded: the loop's cap (or ~0.5 s a case) plus start-up and one timed-out wait
    limit = (cap if cap is not None else 0.5 * n_cases) + 120
    run_ranks(tp_fuzz_checks.fuzz, WORLD, "nccl", n_cases, seed, cap,
              env={"DISTGEMM_TIMEOUT_S": os.environ.get("DISTGEMM_FUZZ_TP_TIMEOUT_S", "20")}, timeout=limit)
