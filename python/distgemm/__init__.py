"""distgemm: CUTLASS GEMMs for tensor-parallel and Mixture-of-Experts training in PyTorch."""

from ._library import KERNEL_ARCHS, cmake_prefix_path, has_kernels
from ._settings import Settings, reload_settings, settings
from ._settings import current as current_settings
from .dense import gemm
from .grouped import grouped_mm, grouped_mm_wgrad
from .quantize import quantize_fp8
from .tp import all_gather_matmul, check_errors, dist_matmul, matmul_reduce_scatter, recover
from . import tp
from . import moe, nn

__all__ = [
    "gemm", "grouped_mm", "grouped_mm_wgrad", "quantize_fp8", "all_gather_matmul", "matmul_reduce_scatter",
    "dist_matmul", "check_errors", "recover", "nn", "moe", "tp", "has_kernels", "KERNEL_ARCHS", "cmake_prefix_path",
    "settings", "current_settings", "reload_settings", "Settings",
]
__version__ = "0.2.0"
