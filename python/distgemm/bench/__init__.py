"""Benchmark suites: `python -m distgemm.bench`."""

from distgemm import _settings

# Every suite and probe runs with NVLink multicast off (NCCL, PyTorch symmetric memory,
# NVSHMEM): set here, in the package every `python -m distgemm.bench...` imports first.
_settings.set_environment(_settings.MULTICAST_OFF)
