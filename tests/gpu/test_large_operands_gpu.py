"""Operands of more than 2^31 elements: the row and pointer arithmetic of the grouped GEMMs
(bf16 and FP8, forward, dgrad, wgrad) and of the dense GEMM must not wrap at 32 bits. x is
(2^21 + 320, 1024): 2^31 + 327,680 elements, so the last expert's rows sit past element 2^31,
and the group boundaries fall inside 128-row tiles. Results are checked on sampled rows (around
every group boundary, around element 2^31, the first and the last rows) against FP64, and the
wgrads in full against FP32 cuBLAS. Every compiled grouped configuration runs (the autotuner may
pick any of them), then the public op. ~20 GB of device memory, seconds on an H200."""

import pytest
import torch

import distgemm
from distgemm._library import device_arch, ops
from distgemm.grouped_fp8 import dequantize_blocks

pytestmark = pytest.mark.gpu
DEV = "cuda"
E4M3 = torch.float8_e4m3fn
T, K, N = 2 ** 21 + 320, 1024, 256
ENDS = [2 ** 20 - 5, 2 ** 21 + 7, T]  # three experts; the last one wholly past element 2^31
COUNTS = [ENDS[0], ENDS[1] - ENDS[0], ENDS[2] - ENDS[1]]


def _sample_rows():
    rows = set(range(0, 300)) | set(range(T - 300, T))
    for r in ENDS[:-1] + [2 ** 31 // K]:
        rows |= set(range(r - 200, r + 200))
    return torch.tensor(sorted(rows))


ROWS_HOST = _sample_rows()  # moved to the GPU by each test (collection runs without one)


def _group_of(rows):
    return torch.bucketize(rows, torch.tensor(ENDS, device=DEV), right=True)


@pytest.fixture(scope="module")
def operands():
    torch.manual_seed(0)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    offs = torch.tensor(ENDS, dtype=torch.int32, device=DEV)
    yield x, offs
    del x
    torch.cuda.empty_cache()


def _check_rows(rows, out_rows, ref_rows, terms, what):
    """|out - ref| <= 2^-8 |ref| + 2^-10 * sum|terms| (bf16 output rounding, the tensor cores'
    partial sums), elementwise on the sampled rows."""
    err = (out_rows.double() - ref_rows).abs()
    limit = ref_rows.abs() * 2.0 ** -8 + terms * 2.0 ** -10 + 1e-30
    bad = err > limit
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {bad.numel()} sampled elements wrong; rows "
                                 f"{rows[bad.any(1)][:8].tolist()}")


def _per_row_reference(x_rows, w_all, groups):
    """x_rows (R, K) float64 against their experts' (N, K) float64 weights, w_all (G, N, K):
    (result, sum of |terms|)."""
    ref = torch.empty(x_rows.shape[0], w_all.shape[1], dtype=torch.float64, device=DEV)
    terms = torch.empty_like(ref)
    for g in range(w_all.shape[0]):
        mine = groups == g
        ref[mine] = x_rows[mine] @ w_all[g].T
        terms[mine] = x_rows[mine].abs() @ w_all[g].abs().T
    return ref, terms


def _configs(kind, in_dtype, out_dtype, scale_mode=None):
    arch = device_arch(torch.device(DEV))
    args = (kind, in_dtype, out_dtype, arch) + (() if scale_mode is None else (scale_mode,))
    return list(enumerate(ops.grouped_configs(*args))) + [(-1, "public op")]


def _wgrad_references(ref_of):
    """ref_of(g, start, count) for each expert, computed once."""
    starts = [0] + ENDS[:-1]
    return [ref_of(g, s, c) for g, (s, c) in enumerate(zip(starts, COUNTS))]


def _check_wgrad(dw, refs, what, limit):
    """Norm-wise relative error per expert below limit (a row read from the wrong place costs
    O(1))."""
    for g, ref_g in enumerate(refs):
        err = float((dw[g] - ref_g).norm() / ref_g.norm())
        assert err < limit, f"{what}, expert {g}: relative error {err:.2e} (limit {limit:.0e})"


def test_bf16_grouped_forward_dgrad_and_wgrad(operands):
    x, offs = operands
    rows = ROWS_HOST.to(DEV)
    assert x.numel() > 2 ** 31
    bf = torch.bfloat16
    w = torch.randn(3, N, K, device=DEV, dtype=bf) * 0.05
    # dgrad: x as dy (T, 1024) against w2 (G, 1024, 256): dx_g = dy_g @ w2_g
    w2 = torch.randn(3, K, N, device=DEV, dtype=bf) * 0.05
    groups = _group_of(rows)
    xr = x[rows].double()
    for kind, weight, w_rows in ((0, w, w.double()), (1, w2, w2.double().transpose(1, 2))):
        ref, terms = _per_row_reference(xr, w_rows, groups)
        for config, name in _configs(kind, bf, bf):
            y = (distgemm.grouped_mm(x, weight, offs, trans_w=kind == 0) if config < 0
                 else ops.grouped_mm(x, weight, offs, bf, kind == 0, 0, config))
            _check_rows(rows, y[rows], ref, terms, f"bf16 {'forward' if kind == 0 else 'dgrad'} {name}")
            del y
    # wgrad: out_g = y_g^T @ x_g, each expert's reduction over ~10^6 tokens; FP32 cuBLAS reference
    dy = distgemm.grouped_mm(x, w, offs)
    refs = _wgrad_references(lambda g, s, c: dy[s:s + c].float().T @ x[s:s + c].float())
    # One FP32 accumulator per output tile runs over each expert's ~10^6 tokens (no split-K):
    # 1.2e-3 measured on the H200 where cuBLAS's bmm reads 0.7-1.3e-4 (README, Limits).
    for config, name in _configs(2, bf, torch.float32):
        dw = (distgemm.grouped_mm_wgrad(dy, x, offs) if config < 0
              else ops.grouped_mm_wgrad(dy, x, offs, torch.float32, 0, config))
        _check_wgrad(dw, refs, f"bf16 wgrad {name}", 5e-3)


def test_fp8_grouped_forward_and_wgrad(operands):
    x, offs = operands
    rows = ROWS_HOST.to(DEV)
    x8, sx = distgemm.quantize_fp8(x, (1, 128))  # sx (T, 8), T-major: the kernel's layout
    assert x8.numel() > 2 ** 31
    w = torch.randn(3, N, K, device=DEV, dtype=torch.bfloat16)
    w8, sw = distgemm.quantize_fp8(w, (128, 128))
    groups = _group_of(rows)
    # block scales; then row-wise ones on the same data
    sx_row, sw_row = sx[:, 0].contiguous(), sw[:, :, 0].repeat_interleave(128, 1)[:, :N].contiguous()
    modes = {
        2: (sx, sw, sw.transpose(1, 2).contiguous(),
            dequantize_blocks(x8[rows], sx[rows], 1, 128).double(), dequantize_blocks(w8, sw, 128, 128).double()),
        1: (sx_row, sw_row, sw_row, x8[rows].double() * sx_row[rows].double().unsqueeze(1),
            w8.double() * sw_row.double().unsqueeze(2)),
    }
    for mode, (scale_x, scale_w, scale_w_kernel, xd, wd) in modes.items():
        ref, terms = _per_row_reference(xd, wd, groups)
        for config, name in _configs(0, E4M3, torch.bfloat16, mode):
            y = (distgemm.grouped_mm(x8, w8, offs, scale_x=scale_x, scale_w=scale_w) if config < 0
                 else ops.grouped_mm_fp8(x8, w8, offs, scale_x, scale_w_kernel, mode, torch.bfloat16, config))
            _check_rows(rows, y[rows], ref, terms, f"FP8 {'block' if mode == 2 else 'row-wise'} forward {name}")
            del y
    del x8, sx
    # wgrad: dy (T, 256) and x quantized transposed per expert; x_t (1024, Tp) > 2^31 elements
    dy = (torch.randn(T, N, device=DEV) * 0.1).to(torch.bfloat16)
    dy_t, sdy_t = distgemm.quantize_fp8(dy, (1, 128), transpose=True, offs=offs)
    x_t, sx_t = distgemm.quantize_fp8(x, (1, 128), transpose=True, offs=offs)
    assert x_t.numel() > 2 ** 31

    def reference(g, s, c):
        col = 128 * (g + s // 128)  # the expert's first column in the padded layout (128-aligned)
        blocks = slice(col // 128, (col + c + 127) // 128)
        return (dequantize_blocks(dy_t[:, col:col + c], sdy_t[:, blocks], 1, 128)
                @ dequantize_blocks(x_t[:, col:col + c], sx_t[:, blocks], 1, 128).T)

    refs = _wgrad_references(reference)
    out = torch.empty(3, N, K, device=DEV)
    for config, name in _configs(2, E4M3, torch.float32, 2):
        if config < 0:
            dw = distgemm.grouped_mm_wgrad(dy_t, x_t, offs, scale_dy=sdy_t, scale_x=sx_t)
        else:
            ops.grouped_mm_wgrad_fp8_out(dy_t, x_t, offs, sdy_t.t(), sx_t.t(), out, False, config)
            dw = out
        _check_wgrad(dw, refs, f"FP8 wgrad {name}", 1e-3)  # promoted to FP32 every 128 tokens


def test_dense_gemm(operands):
    x, _ = operands
    rows = ROWS_HOST.to(DEV)
    b = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.05
    out = distgemm.gemm(x, b)
    ref, terms = _per_row_reference(x[rows].double(), b.double().unsqueeze(0), torch.zeros_like(rows))
    _check_rows(rows, out[rows], ref, terms, "bf16 dense")
