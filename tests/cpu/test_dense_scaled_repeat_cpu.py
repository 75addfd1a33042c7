"""Repeated float8 calls with scales take their remembered runner (the vendor call, or ours on
operands read in place) without the checks, like 16-bit ones: the key the full path remembers is
the key a repeated call looks up (out_dtype None, integer alpha, the caller's use_fast_accum), a
call of another signature takes the full path, and an unsettled choice is not remembered. On the
CPU, with the GPU-only pieces (the kernels, the autotuner's timing, torch._scaled_mm)
replaced."""

import pytest
import torch

import distgemm
from distgemm import autotune, dense
from distgemm._dispatch import configs

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def gpu_like(monkeypatch, use_settings):
    """dense's float8 path as on an sm_90 GPU: the vendor peer is a counted plain-PyTorch product;
    the autotuner keeps whatever it is offered first (the peer); the checks are counted."""
    calls = {"peer": 0, "checks": 0}
    use_settings(autotune=True)
    autotune.clear()
    monkeypatch.setattr(autotune, "_LOADED", True)
    monkeypatch.setattr(autotune, "may_time", lambda: True)
    monkeypatch.setattr(autotune, "choose", lambda key, candidates, prefer=None, device=None:
                        autotune.remember(key, prefer) or prefer)
    monkeypatch.setattr(dense, "kernel_arch", lambda device: 90)
    monkeypatch.setattr(dense, "kernel_out_dtype", lambda a, b, out, arch, fast=False: (out, fast))
    monkeypatch.setattr(dense, "_candidates", lambda a, b, out, k_major, arch, fast:
                        configs(("tile",), dense._run_config) + (dense._SCALED_MM_CANDIDATE,))

    def peer_runner(call):
        alpha, beta, out_dtype = call.alpha, call.beta, call.out_dtype

        def run(a, b, c, scale_a, scale_b):
            calls["peer"] += 1
            return dense.reference_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b)
        return run
    monkeypatch.setattr(dense, "_scaled_mm_runner", peer_runner)
    checks = dense.check_operands

    def counted_checks(*args, **kwargs):
        calls["checks"] += 1
        return checks(*args, **kwargs)
    monkeypatch.setattr(dense, "check_operands", counted_checks)
    yield calls
    autotune.clear()


def _operands(m=32, n=48, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 4).to(E4M3)
    b = (torch.randn(n, k, generator=g) * 4).to(E4M3)
    return a, b, torch.rand(m, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5


def test_a_repeated_call_takes_the_remembered_vendor_runner(gpu_like):
    a, b, sa, sb = _operands()
    first = distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert gpu_like == {"peer": 1, "checks": 1}  # the call (the autotuner's timing is replaced)
    again = distgemm.gemm(a, b, scale_a=sa, scale_b=sb, alpha=1, out_dtype=torch.bfloat16)  # the same key
    assert gpu_like == {"peer": 2, "checks": 1}, "the repeated call went through the checks"
    assert torch.equal(first, again)
    sa2 = sa * 2  # other values, the same signature: the new scales are read
    torch.testing.assert_close(distgemm.gemm(a, b, scale_a=sa2, scale_b=sb).float(), 2 * first.float(),
                               rtol=1e-2, atol=1e-2)
    assert autotune.last_backend() == dense._SCALED_MM


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
    assert not dense._REPEAT_CALLS
    use_settings(autotune=True)
    monkeypatch.setattr(autotune, "may_time", lambda: False)  # graph capture of an untimed shape
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert not dense._REPEAT_CALLS


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
    assert torch.equal(first, again)
    assert autotune.last_backend() == dense._TORCH_BLOCK
    half = distgemm.gemm(a, b, scale_a=sa, scale_b=sb, alpha=0.5)  # alpha is part of the key
    torch.testing.assert_close(half.float(), 0.5 * first.float(), rtol=1e-2, atol=1e-2)
