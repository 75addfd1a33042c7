"""Shared test setup: GPU markers, and the NVLink-multicast-off environment for every
process the tests start (NVLS objects can take shared GPU hosts down)."""

import contextlib
import os
import tempfile

for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_var] = _val

# The dense GEMM's autotuning choices go to a file of this run, not the user's cache.
os.environ.setdefault("DISTGEMM_AUTOTUNE_CACHE",
                      os.path.join(tempfile.mkdtemp(prefix="distgemm-tests-"), "autotune.json"))

import pytest
import torch


def _kernel_gpus() -> int:
    if not torch.cuda.is_available():
        return 0
    import distgemm

    return sum(distgemm.has_kernels(torch.device("cuda", i)) for i in range(torch.cuda.device_count()))


KERNEL_GPUS = _kernel_gpus()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU of compute capability 9.0 or 10.0")
    skip_multi = pytest.mark.skip(reason="needs two CUDA GPUs of compute capability 9.0 or 10.0")
    for item in items:
        if "gpu" in item.keywords and KERNEL_GPUS < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and KERNEL_GPUS < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def use_settings():
    """use_settings(**overrides): distgemm.settings changed from there to the end of the test
    (None: back to the default)."""
    import distgemm

    with contextlib.ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(distgemm.settings(**overrides))


@pytest.fixture
def autotune_cache(tmp_path, monkeypatch, use_settings):
    """Autotuning on, with a cache file of this test's own (the choices in memory forgotten
    before and after, the remembered repeat calls with them); yields the file's path."""
    from distgemm import autotune

    path = tmp_path / "autotune.json"
    use_settings(autotune_cache=str(path), autotune=True)  # one stack of changes with the test's own
    autotune.clear()
    monkeypatch.setattr(autotune, "_LOADED", False)
    yield path
    autotune.clear()
