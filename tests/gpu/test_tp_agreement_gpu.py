"""The tensor-parallel agreement through the torch binding on one GPU: two ranks' workspaces in
this process, each rank on its own stream (as tests/cpp/test_tp_loopback.cpp does through the C
API), so that the op the collectives fallback calls on a fused group (tp_agree_elsewhere)
marshals its arguments into the core's checks and agreement. The NCCL path across GPUs, with
one rank on each path: tests/multigpu/test_tp_faults.py."""

import pytest
import torch

import distgemm
from distgemm._library import ops

pytestmark = pytest.mark.gpu

_AG, _RS = 1, 2  # dg_tp_kind
WORLD = 2


def _workspaces(nbytes: int) -> list:
    """One zeroed workspace per rank (each rank's flags start at zero)."""
    return [torch.zeros(nbytes, dtype=torch.uint8, device="cuda") for _ in range(WORLD)]


def _announce(kind, shards, n, workspaces, timeout_s=30.0, ranks=range(WORLD)):
    """Every rank in `ranks` announces that it runs the call elsewhere, on its own stream; then
    the device's error word (0, or reason << 24 | op << 16 | peer + 1)."""
    ptrs = [w.data_ptr() for w in workspaces]
    streams = [torch.cuda.Stream() for _ in range(WORLD)]
    for r in ranks:
        a = shards[r]
        out_rows = a.shape[0] * WORLD if kind == _AG else a.shape[0] // WORLD
        with torch.cuda.stream(streams[r]):
            ops.tp_agree_elsewhere(kind, a, out_rows, n, torch.bfloat16, None, r, WORLD, ptrs,
                                   workspaces[0].numel(), timeout_s)
    torch.cuda.synchronize()
    return ops.tp_error(torch.cuda.current_device())


@pytest.fixture
def clean_error_word():
    device = torch.cuda.current_device()
    ops.tp_clear_error(device)
    yield device
    ops.tp_clear_error(device)


@pytest.mark.parametrize("kind", [_AG, _RS])
def test_ranks_that_all_run_elsewhere_agree_and_differences_are_named(kind, clean_error_word):
    need = ops.tp_workspace_size(_AG, 1, 8, 8, torch.bfloat16, torch.bfloat16, WORLD)
    a = torch.randn(128, 64, dtype=torch.bfloat16, device="cuda")
    assert _announce(kind, [a, a], 256, _workspaces(need)) == 0
    # rows that differ (all-gather: a shard; reduce-scatter: the rows of a)
    word = _announce(kind, [a, a[:64]], 256, _workspaces(need))
    assert word >> 24 == 3, f"expected 'another number of rows', error word {word:#x}"
    assert word & 0xFF0000 == kind << 16
    with pytest.raises(ValueError, match="the ranks disagree"):
        distgemm.check_errors()
    ops.tp_clear_error(clean_error_word)
    # another dtype on one rank (both dtypes are compared where the call runs elsewhere)
    word = _announce(kind, [a, a.half()], 256, _workspaces(need))
    assert word >> 24 == 5, f"expected 'other dtypes', error word {word:#x}"


def test_a_rank_announcing_alone_times_out_within_its_bound(clean_error_word):
    need = ops.tp_workspace_size(_AG, 1, 8, 8, torch.bfloat16, torch.bfloat16, WORLD)
    a = torch.randn(16, 64, dtype=torch.bfloat16, device="cuda")
    word = _announce(_AG, [a, a], 64, _workspaces(need), timeout_s=1.0, ranks=[0])
    assert word >> 24 == 0 and word & 0xFFFF == 2, f"expected a timeout on rank 1, error word {word:#x}"
    with pytest.raises(TimeoutError, match="never arrived"):
        distgemm.check_errors()


@pytest.mark.parametrize("settings, match", [
    ([float("nan"), 0, 0, 0], "tp setting algo"), ([0, float("inf"), 0, 0], "tp setting pieces"),
    ([0, 1e300, 0, 0], "tp setting pieces"), ([0, 0, float("nan"), 0], "tp setting tapered"),
    ([0, 0, 0, float("nan")], "tp setting rs_split_gflops"), ([7, 0, 0, 0], "tp setting algo"),
    ([0, 0, 0], "must be 4 values"),
])
def test_the_ops_refuse_settings_that_do_not_convert_to_int(settings, match, clean_error_word):
    # The op's float[] settings are checked before their cast to int (NaN, inf and huge values
    # convert with undefined behaviour), on every rank's call, before anything is enqueued.
    need = ops.tp_workspace_size(_AG, 128, 64, 256, torch.bfloat16, torch.bfloat16, WORLD)
    ws = _workspaces(need)
    ptrs = [w.data_ptr() for w in ws]
    a = torch.randn(128, 64, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(256, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=match):
        ops.tp_all_gather_gemm(a, b, None, 1.0, 0.0, torch.bfloat16, None, None, False, 0, WORLD, ptrs, need,
                               30.0, False, settings)
    with pytest.raises(ValueError, match=match):
        ops.tp_gemm_reduce_scatter(a, b, None, 1.0, 0.0, torch.bfloat16, None, None, False, 0, WORLD, ptrs,
                                   need, 30.0, settings)
    with pytest.raises(ValueError, match="rank 5 is out of range"):
        ops.tp_all_gather_gemm(a, b, None, 1.0, 0.0, torch.bfloat16, None, None, False, 5, WORLD, ptrs, need,
                               30.0, False, [0, 0, 0, 0])
    assert ops.tp_error(clean_error_word) == 0


@pytest.mark.parametrize("world", [0, -2, 2**32 + 2])
def test_the_ops_refuse_a_world_that_is_not_a_group_size(world, clean_error_word):
    # Checked first: the reduce-scatter divides a's rows by world (0 trapped the process), the
    # all-gather multiplies by it to size out.
    a = torch.randn(128, 64, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(256, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="world must be a positive group size"):
        ops.tp_gemm_reduce_scatter(a, b, None, 1.0, 0.0, torch.bfloat16, None, None, False, 0, world, [], 0, 30.0,
                                   [0, 0, 0, 0])
    with pytest.raises(ValueError, match="world must be a positive group size"):
        ops.tp_all_gather_gemm(a, b, None, 1.0, 0.0, torch.bfloat16, None, None, False, 0, world, [], 0, 30.0,
                               False, [0, 0, 0, 0])
    assert ops.tp_error(clean_error_word) == 0
