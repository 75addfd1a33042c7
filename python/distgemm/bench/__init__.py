"""Benchmark suites: `python -m distgemm.bench`."""

import os

# Every suite and probe runs with NVLink multicast off (NCCL, PyTorch symmetric memory,
# NVSHMEM): set here, in the package every `python -m distgemm.bench...` imports first.
for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_var] = _val
