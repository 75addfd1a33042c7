"""scripts/reliability/initcheck_tally.py: initcheck's reports grouped by the kernel that made
them, distgemm's own apart (the parser, on a log of the forms compute-sanitizer writes)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reliability" / "initcheck_tally.py"
spec = importlib.util.spec_from_file_location("initcheck_tally", SCRIPT)
initcheck_tally = importlib.util.module_from_spec(spec)
spec.loader.exec_module(initcheck_tally)

LOG = """========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 16 bytes
=========     at void distgemm::moe::(anonymous namespace)::act_kernel<(int)0, (fp8)0>(distgemm::moe::ActProblem, bool)+0x1a0
=========     by thread (3,0,0) in block (0,0,0)
=========     Address 0x7f0000000000
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at 0x2b0 in void cutlass::device_kernel<distgemm::gemm::Kernel<int>>(distgemm::gemm::Kernel<int>::Params)
=========     by thread (0,0,0) in block (1,0,0)
=========
========= Uninitialized __global__ memory read of size 16 bytes
=========     at void distgemm::moe::(anonymous namespace)::act_kernel<(int)1, (fp8)0>(distgemm::moe::ActProblem, bool)+0x1c0
=========
========= Uninitialized __global__ memory read of size 2 bytes
=========     at nvjet_sm90_tst_64x64+0x90
========= ERROR SUMMARY: 4 errors
"""


def test_reports_are_grouped_by_kernel_and_ours_are_apart():
    result = initcheck_tally.tally(LOG.splitlines(keepends=True))
    assert result["reports"] == 4 and result["distgemm_reports"] == 3
    by = {r["kernel"]: r for r in result["by_kernel"]}
    act = by["distgemm::moe::{anonymous}::act_kernel"]
    assert act["reports"] == 2 and act["read_sizes"] == {16: 2} and act["distgemm"]
    assert by["cutlass::device_kernel"]["distgemm"] and by["cutlass::device_kernel"]["reports"] == 1
    assert by["nvjet_sm90_tst_64x64"] == {"kernel": "nvjet_sm90_tst_64x64", "reports": 1, "distgemm": False,
                                           "read_sizes": {2: 1}, "example": "nvjet_sm90_tst_64x64"}


def test_an_empty_log_has_no_reports():
    assert initcheck_tally.tally(["========= ERROR SUMMARY: 0 errors\n"]) == {
        "reports": 0, "distgemm_reports": 0, "by_kernel": []}
