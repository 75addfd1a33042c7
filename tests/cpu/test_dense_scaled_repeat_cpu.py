"""Repeated float8 calls with scales take their remembered entry (per-tensor or row-wise scales:
the native table's torch._scaled_mm, or ours on operands read in place; 128-block scales: the
Python table's runner) without the checks, like 16-bit ones: the key the full path remembers is
the key a repeated call looks up (out_dtype None, integer alpha, the caller's use_fast_accum), a
hit gives the full path's result, a call of another signature takes the full path, and an
unsettled choice is not remembered. On the CPU (whose torch._scaled_mm takes per-tensor
scales), with the GPU-only pieces (the kernels, the autotuner's timing) replaced."""

import pytest
import torch

import distgemm
from distgemm import _repeat_calls, autotune, dense
from distgemm._dispatch import configs

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def gpu_like(monkeypatch, use_settings):
    """dense's float8 path as on an sm_90 GPU: the autotuner keeps the vendor peer (or
    `calls["choose"]`); our kernel is its CPU stand-in; the checks are counted."""
    calls = {"checks": 0, "choose": None}
    use_settings(autotune=True)
    autotune.clear()
    monkeypatch.setattr(autotune, "_LOADED", True)
    monkeypatch.setattr(autotune, "may_time", lambda: True)
    def choose(key, candidates, prefer=None, device=None):
        chosen = calls["choose"] or prefer
        autotune.remember(key, chosen)
        return chosen
    monkeypatch.setattr(autotune, "choose", choose)
    monkeypatch.setattr(dense, "kernel_arch", lambda device: 90)
    monkeypatch.setattr(dense, "kernel_out_dtype", lambda a, b, out, arch, fast=False: (out, fast))
    monkeypatch.setattr(dense, "_candidates", lambda a, b, out, k_major, arch, fast:
                        configs(("tile",), dense._run_config) + (dense._SCALED_MM_CANDIDATE,))
    checks = dense.check_operands

    def counted_checks(*args, **kwargs):
        calls["checks"] += 1
        return checks(*args, **kwargs)
    monkeypatch.setattr(dense, "check_operands", counted_checks)
    yield calls
    autotune.clear()


def _operands(m=32, n=48, k=64, seed=0, row_wise=False):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 4).to(E4M3)
    b = (torch.randn(n, k, generator=g) * 4).to(E4M3)
    if row_wise:
        return a, b, torch.rand(m, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5
    return a, b, torch.rand((), generator=g) + 0.5, torch.rand(1, generator=g) + 0.5


def test_a_repeated_call_takes_the_remembered_vendor_call(gpu_like):
    a, b, sa, sb = _operands()
    first = distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert gpu_like["checks"] == 1 and _repeat_calls.sizes() == (0, 0, 1) and not dense._REPEAT_CALLS
    autotune.record("cutlass")
    again = distgemm.gemm(a, b, scale_a=sa, scale_b=sb, alpha=1, out_dtype=torch.bfloat16)  # the same key
    assert gpu_like["checks"] == 1, "the repeated call went through the checks"
    assert torch.equal(first, again)  # bit for bit
    assert autotune.last_backend() == dense._SCALED_MM
    sa2 = sa * 2  # other values, the same signature: the new scales are read
    torch.testing.assert_close(distgemm.gemm(a, b, scale_a=sa2, scale_b=sb).float(), 2 * first.float(),
                               rtol=1e-2, atol=1e-2)
    assert gpu_like["checks"] == 1
    c = torch.randn(48).to(torch.bfloat16)  # a bias, with use_fast_accum
    first = distgemm.gemm(a, b, c, beta=1.0, scale_a=sa, scale_b=sb, use_fast_accum=True)
    again = distgemm.gemm(a, b, c, beta=1.0, scale_a=sa, scale_b=sb, use_fast_accum=True)
    assert gpu_like["checks"] == 2 and torch.equal(first, again)


@pytest.mark.parametrize("kernel_dtype", [None, torch.float32])
def test_a_repeated_call_of_our_configuration_runs_it_in_place(gpu_like, monkeypatch, kernel_dtype):
    if kernel_dtype is not None:  # the kernel writes float32, cast to the caller's bfloat16
        monkeypatch.setattr(dense, "kernel_out_dtype", lambda a, b, out, arch, fast=False: (kernel_dtype, fast))
    gpu_like["choose"] = autotune.CUTLASS_PREFIX + "tile"
    a, b, sa, sb = _operands(row_wise=True)
    c = torch.randn(32, 48).to(kernel_dtype or torch.bfloat16)  # read in place: in the kernel's dtype
    first = distgemm.gemm(a, b, c, alpha=2.0, beta=0.5, scale_a=sa, scale_b=sb)
    assert _repeat_calls.sizes() == (0, 0, 1) and not dense._REPEAT_CALLS
    autotune.record("cutlass")
    again = distgemm.gemm(a, b, c, alpha=2.0, beta=0.5, scale_a=sa, scale_b=sb)
    assert gpu_like["checks"] == 1 and torch.equal(first, again)
    assert again.dtype == torch.bfloat16 and autotune.last_backend() == "cutlass:tile"
    # Operands our kernel cannot read in place (K padded) take the full path each time.
    a5, b5 = (torch.randn(32, 60) * 4).to(E4M3), (torch.randn(48, 60) * 4).to(E4M3)
    distgemm.gemm(a5, b5, scale_a=sa, scale_b=sb)
    distgemm.gemm(a5, b5, scale_a=sa, scale_b=sb)
    assert gpu_like["checks"] == 3 and _repeat_calls.sizes() == (0, 0, 1)


def test_another_signature_takes_the_full_path(gpu_like):
    a, b, sa, sb = _operands()
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    checks = gpu_like["checks"]
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb, use_fast_accum=True)
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    a2, b2, sa2, sb2 = _operands(m=16)
    distgemm.gemm(a2, b2, scale_a=sa2, scale_b=sb2)
    assert gpu_like["checks"] == checks + 3
    with pytest.raises(ValueError, match="scale_a must hold 1 value"):  # a bad scale is still named
        distgemm.gemm(a, b, scale_a=torch.ones(3), scale_b=sb)


def test_nothing_is_remembered_without_autotuning_or_under_a_choice_not_made(gpu_like, use_settings, monkeypatch):
    a, b, sa, sb = _operands()
    use_settings(autotune=False)
    monkeypatch.setattr(dense.ops, "gemm", lambda a, b, c, alpha, beta, out, sa, sb, fast, *cfg:
                        dense.reference_gemm(a, b, c, alpha, beta, out, sa, sb), raising=False)
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert not dense._REPEAT_CALLS and _repeat_calls.sizes() == (0, 0, 0)
    use_settings(autotune=True)
    monkeypatch.setattr(autotune, "may_time", lambda: False)  # graph capture of an untimed shape
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert not dense._REPEAT_CALLS and _repeat_calls.sizes() == (0, 0, 0)


def test_block_scaled_calls_remember_their_choice(gpu_like, monkeypatch):
    m, n, k = 32, 256, 256
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(m, k, generator=g) * 4).to(E4M3)
    b = (torch.randn(n, k, generator=g) * 4).to(E4M3)
    sa = torch.rand(m, k // 128, generator=g) + 0.5
    sb = torch.rand(n // 128, k // 128, generator=g) + 0.5
    peer_calls = []

    def block_peer(a, b, scale_a, scale_b):
        from distgemm.grouped_fp8 import dequantize_blocks

        peer_calls.append(1)
        return (dequantize_blocks(a, scale_a, 1, 128) @ dequantize_blocks(b, scale_b, 128, 128).T).bfloat16()
    monkeypatch.setattr(dense, "_block_peer", block_peer)
    monkeypatch.setattr(dense, "_block_peer_why_not", lambda call: None)
    first = distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    checks = gpu_like["checks"]
    again = distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert gpu_like["checks"] == checks and len(peer_calls) == 2  # the call, the repeated call
    assert dense._REPEAT_CALLS and _repeat_calls.sizes() == (0, 0, 0)  # the Python table
    assert torch.equal(first, again)
    assert autotune.last_backend() == dense._TORCH_BLOCK
    half = distgemm.gemm(a, b, scale_a=sa, scale_b=sb, alpha=0.5)  # alpha is part of the key
    torch.testing.assert_close(half.float(), 0.5 * first.float(), rtol=1e-2, atol=1e-2)
