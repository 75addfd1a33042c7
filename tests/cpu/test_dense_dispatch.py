"""Which kernel a dense call runs (host-side choices, no GPU needed): the fuzz findings
stay fixed."""

import torch

import distgemm
from distgemm.dense import _flat, kernel_out_dtype

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_mixed_fp8_fp16_output_never_goes_through_bf16():
    # Only bf16 output is built for the mixed pairs: fp16 output computed in bf16 and cast loses
    # precision (4-ulp errors seen on the GPU), so there is no kernel for it (the reference runs).
    for a, b in ((E5M2, E4M3), (E4M3, E5M2)):
        dtype, _ = kernel_out_dtype(a, b, torch.float16, 90, False)
        assert dtype in (None, torch.float16, torch.float32)
        assert kernel_out_dtype(a, b, torch.bfloat16, 90, False) == (torch.bfloat16, False)


def test_fast_accumulation_falls_back_to_promoted_kernels():
    # e4m3 x e5m2 has no fast-accumulation kernel: the promoted one runs rather than an error
    assert kernel_out_dtype(E4M3, E5M2, torch.bfloat16, 90, True) == (torch.bfloat16, False)
    assert kernel_out_dtype(E4M3, E4M3, torch.bfloat16, 90, True) == (torch.bfloat16, True)


def test_scales_are_handed_over_aligned():
    base = torch.arange(40, dtype=torch.float32)
    for offset in range(4):
        view = base[offset:offset + 33]
        flat = _flat(view)
        assert flat.data_ptr() % 16 == 0 and torch.equal(flat, view)


def test_beta_zero_does_not_read_c():
    # as BLAS and the kernels' epilogue: beta = 0 leaves c out, NaN and all
    a, b = torch.randn(8, 16).bfloat16(), torch.randn(4, 16).bfloat16()
    for c in (torch.full((8, 4), float("nan")).bfloat16(), torch.full((4,), float("nan")).bfloat16()):
        out = distgemm.gemm(a, b, c, beta=0.0)
        assert torch.isfinite(out).all()
        assert torch.equal(out, distgemm.gemm(a, b))
