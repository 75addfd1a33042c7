"""cuBLAS's block-scaled FP8 GEMM through PyTorch (DeepSeek-V3 scaling: a per 1 x 128, b per
128 x 128), with the scales put in the layouts it takes. The dense block-scaled ``gemm`` times
it against our kernel; the FP8 benchmark's per-expert loop calls it."""

from __future__ import annotations

import torch


def _round_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def cublas_scale_a(scale: torch.Tensor) -> torch.Tensor:
    """1 x 128 scales of a's rows (M, K/128), any strides -> strides (1, M), the outer-dim-major
    layout BlockWise1x128 takes."""
    # Exactly (1, M): a row slice of an M-major tensor keeps the whole tensor's stride.
    if scale.stride() == (1, scale.shape[0]):
        return scale
    return scale.t().contiguous().t()


def cublas_scale_b(scale_nk: torch.Tensor) -> torch.Tensor:
    """128 x 128 scales of b as (N/128, K/128) blocks, any strides -> the
    (round_up(K/128, 4), N/128) tensor with strides (1, round_up(K/128, 4)) that
    BlockWise128x128 takes for b (K, N) (the K blocks padded to 4 with ones)."""
    nb, kb = scale_nk.shape
    if kb % 4 == 0 and scale_nk.stride() == (kb, 1):  # already in that layout, as its transpose
        return scale_nk.t()
    buf = torch.ones((nb, _round_up(kb, 4)), dtype=torch.float32, device=scale_nk.device)
    buf[:, :kb] = scale_nk
    return buf.t()


def scaled_mm_block(a, b_kn, scale_a, scale_b) -> torch.Tensor:
    """F.scaled_mm (torch._scaled_mm_v2): a (M, K) row-major, b_kn (K, N) column-major, scales
    from cublas_scale_a / cublas_scale_b; bfloat16 out."""
    from torch.nn.functional import ScalingType, scaled_mm

    return scaled_mm(a, b_kn, scale_a, ScalingType.BlockWise1x128, scale_b, ScalingType.BlockWise128x128,
                     output_dtype=torch.bfloat16)


def scaled_mm_block_v1(a, b_kn, scale_a, scale_b) -> torch.Tensor:
    """torch._scaled_mm, which infers the same recipe from the scale shapes (as long as K/128 is
    a multiple of 4, where cublas_scale_b adds no padding)."""
    return torch._scaled_mm(a, b_kn, scale_a, scale_b, out_dtype=torch.bfloat16)
