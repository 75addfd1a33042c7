"""Loads the compiled ops and answers what this build and device can run."""

from __future__ import annotations

import functools
import os
import warnings

import torch

_LIB_PATH = os.path.join(os.path.dirname(__file__), "_C.so")
# For C++ projects: cmake -DCMAKE_PREFIX_PATH=<this> finds the installed package's
# distgemmConfig.cmake (find_package(distgemm) -> distgemm::core).
cmake_prefix_path = os.path.join(os.path.dirname(__file__), "lib", "cmake")

if not os.path.exists(_LIB_PATH):
    raise ImportError(
        f"distgemm's compiled library is missing ({_LIB_PATH}): install the package with "
        "`pip install --no-build-isolation .` from the repository root"
    )
torch.ops.load_library(_LIB_PATH)
ops = torch.ops.distgemm


def _check_build() -> None:
    """The Python package, the binding (_C.so) and the core library must come from one build: a
    stale library would take other arguments than the code calling it."""
    try:
        from ._build_info import BUILD_ID
    except ImportError:
        BUILD_ID = None
    binding, core = ops.build_ids() if hasattr(ops, "build_ids") else ("(unknown: older build)", "?")
    if not (BUILD_ID == binding == core):
        raise ImportError(
            f"distgemm: stale compiled library: the package at {os.path.dirname(__file__)} is build {BUILD_ID}, "
            f"its _C.so build {binding} and libdistgemm_core.so build {core}; reinstall with "
            "`pip install --no-build-isolation .` from the repository root")


_check_build()

# Compute capabilities (major * 10 + minor) that distgemm has kernels for.
KERNEL_ARCHS = (90, 100)


@functools.lru_cache(maxsize=None)
def device_arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def has_kernels(device: torch.device) -> bool:
    """True when `device` is a GPU that distgemm's CUTLASS kernels run on."""
    return device.type == "cuda" and device_arch(device) in KERNEL_ARCHS


def kernel_arch(device: torch.device) -> int:
    """The compute capability distgemm's kernels run `device` as (90, 100), 0 where none run
    (a CPU tensor, another GPU)."""
    return device_arch(device) if has_kernels(device) else 0


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def is_aligned16(*tensors) -> bool:
    """Whether every tensor's data is 16-byte aligned (the kernels' TMA descriptors need it).
    True while torch.compile traces (no data pointers then; the op checks them at run time)."""
    return torch.compiler.is_compiling() or all(t.data_ptr() % 16 == 0 for t in tensors)


def aligned16(t):
    """t, or a copy of it where its data is not 16-byte aligned (a view at an odd offset)."""
    return t if t is None or is_aligned16(t) else t.clone()
