"""distgemm: CUTLASS GEMMs for tensor-parallel and Mixture-of-Experts training in PyTorch."""

from ._library import KERNEL_ARCHS, has_kernels
from .gemm import gemm

__all__ = ["gemm", "has_kernels", "KERNEL_ARCHS"]
__version__ = "0.1.0"
