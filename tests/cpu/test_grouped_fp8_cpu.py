"""FP8 grouped GEMMs on the CPU: the reference path (dequantize, FP32 matmul per expert)
against an independent per-element computation, the layouts the kernels read, and every
argument error naming what is wrong."""

import pytest
import torch

import distgemm
from distgemm.grouped_fp8 import dequantize_blocks, padded_columns

E4M3 = torch.float8_e4m3fn


def fp8(*shape):
    return (torch.randn(*shape) * 3).to(E4M3)


def offs_of(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def test_dequantize_blocks_is_a_blockwise_product():
    data = fp8(130, 260)
    scale = torch.rand(2, 3) + 0.5
    got = dequantize_blocks(data, scale, 128, 128)
    for r, c in ((0, 0), (127, 255), (128, 0), (129, 259), (5, 130)):
        assert got[r, c] == data[r, c].float() * scale[r // 128, c // 128]


def test_block_forward_reference_matches_a_plain_loop():
    counts, n, k = [3, 0, 5], 130, 200
    x, w = fp8(8, k), fp8(3, n, k)
    sx = torch.rand(8, 2) + 0.5
    sw = torch.rand(3, 2, 2) + 0.5
    out = distgemm.grouped_mm(x, w, offs_of(counts), scale_x=sx, scale_w=sw)
    assert out.dtype == torch.bfloat16 and out.shape == (8, n)
    rows = [0, 0, 0, 2, 2, 2, 2, 2]
    for t in (0, 2, 3, 7):
        g = rows[t]
        for j in (0, 127, 128, 129):
            ref = sum(float(x[t, kk]) * float(sx[t, kk // 128]) * float(w[g, j, kk]) *
                      float(sw[g, j // 128, kk // 128]) for kk in range(k))
            assert abs(float(out[t, j]) - ref) <= abs(ref) * 2 ** -7 + 1e-3


def test_row_forward_and_dgrad_reference():
    counts, n, k = [4, 2], 16, 32
    x, w = fp8(6, k), fp8(2, n, k)
    sx, sw = torch.rand(6) + 0.5, torch.rand(2, n) + 0.5
    out = distgemm.grouped_mm(x, w, offs_of(counts), scale_x=sx, scale_w=sw)
    ref = torch.cat([(x[:4].float() * sx[:4, None]) @ (w[0].float() * sw[0][:, None]).T,
                     (x[4:].float() * sx[4:, None]) @ (w[1].float() * sw[1][:, None]).T])
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-3)
    # dgrad form: w given (G, K, N) with row scales per output column N.
    w_kn = fp8(2, k, n)
    out = distgemm.grouped_mm(x, w_kn, offs_of(counts), scale_x=sx, scale_w=sw, trans_w=False)
    ref = torch.cat([(x[:4].float() * sx[:4, None]) @ (w_kn[0].float() * sw[0][None, :]),
                     (x[4:].float() * sx[4:, None]) @ (w_kn[1].float() * sw[1][None, :])])
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-3)


def test_padded_columns_never_overlap():
    torch.manual_seed(1)
    for _ in range(50):
        g = int(torch.randint(1, 20, ()))
        counts = torch.randint(0, 400, (g,)).tolist()
        t = sum(counts)
        cols = padded_columns(offs_of(counts), t)
        tp = 128 * ((t + 127) // 128 + g)
        end = 0
        for col, c in cols:
            assert col % 128 == 0 and col >= end
            end = col + (c + 127) // 128 * 128
        assert end <= tp


def test_wgrad_reference_from_the_padded_layout():
    counts, n, k = [130, 0, 7], 8, 12
    g, t = 3, 137
    tp = 128 * ((t + 127) // 128 + g)
    dy_t, x_t = torch.zeros(n, tp).to(E4M3), torch.zeros(k, tp).to(E4M3)
    dys, xs = [fp8(c, n) for c in counts], [fp8(c, k) for c in counts]
    for (col, c), a, b in zip(padded_columns(offs_of(counts), t), dys, xs):
        dy_t[:, col:col + c], x_t[:, col:col + c] = a.t(), b.t()
    s_dy, s_x = (torch.rand(tp // 128, n) + 0.5).t(), (torch.rand(tp // 128, k) + 0.5).t()
    main_grad = torch.ones(g, n, k)
    out = distgemm.grouped_mm_wgrad(dy_t, x_t, offs_of(counts), scale_dy=s_dy, scale_x=s_x,
                                    out=main_grad, accumulate=True)
    assert out is main_grad
    assert torch.equal(out[1], torch.ones(n, k)), "the empty expert's main_grad changed"
    col = 0
    a = dequantize_blocks(dy_t, s_dy, 1, 128)[:, col:col + 130]
    b = dequantize_blocks(x_t, s_x, 1, 128)[:, col:col + 130]
    torch.testing.assert_close(out[0], 1 + a @ b.T, rtol=1e-5, atol=1e-4)


def test_e5m2_gradients_against_e4m3():
    """The hybrid recipe: an e5m2 dy against e4m3 weights (dgrad, w given (G, K, N) here as
    the K-major operand's transpose) and against e4m3 activations (wgrad)."""
    counts, n, k = [4, 2], 16, 32
    dy = (torch.randn(6, n) * 3).to(torch.float8_e5m2)
    w = fp8(2, n, k)  # the forward's (G, N, K) weights: dx = dy @ w[g]
    s_dy, s_w = torch.rand(6) + 0.5, torch.rand(2, k) + 0.5
    dx = distgemm.grouped_mm(dy, w, offs_of(counts), scale_x=s_dy, scale_w=s_w, trans_w=False)
    ref = torch.cat([(dy[:4].float() * s_dy[:4, None]) @ (w[0].float() * s_w[0][None, :]),
                     (dy[4:].float() * s_dy[4:, None]) @ (w[1].float() * s_w[1][None, :])])
    torch.testing.assert_close(dx.float(), ref, rtol=2 ** -7, atol=1e-3)
    g, t = 2, 6
    tp = 128 * ((t + 127) // 128 + g)
    dy_t = torch.zeros(n, tp).to(torch.float8_e5m2)
    x_t = torch.zeros(k, tp).to(E4M3)
    xs = fp8(t, k)
    for (col, c), (s, e) in zip(padded_columns(offs_of(counts), t), [(0, 4), (4, 6)]):
        dy_t[:, col:col + c], x_t[:, col:col + c] = dy[s:e].t(), xs[s:e].t()
    sd, sx = (torch.rand(tp // 128, n) + 0.5).t(), (torch.rand(tp // 128, k) + 0.5).t()
    out = distgemm.grouped_mm_wgrad(dy_t, x_t, offs_of(counts), scale_dy=sd, scale_x=sx)
    a, b = dequantize_blocks(dy_t, sd, 1, 128), dequantize_blocks(x_t, sx, 1, 128)
    for e, (col, c) in enumerate(padded_columns(offs_of(counts), t)):
        torch.testing.assert_close(out[e], a[:, col:col + c] @ b[:, col:col + c].T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="float8_e5m2 dy \\(a gradient\\) with a float8_e4m3fn x"):
        distgemm.grouped_mm_wgrad(dy_t, x_t.view(torch.uint8).view(torch.float8_e5m2), offs_of(counts),
                                  scale_dy=sd, scale_x=sx)


@pytest.mark.parametrize("bad, match", [
    (dict(scale_x=None), "needs scale_x and scale_w"),
    (dict(scale_x=torch.ones(8, 3)), r"scale_x must be \(T, ceil\(K/128\)\)"),
    (dict(scale_w=torch.ones(2, 2, 3)), r"scale_w must be \(G, ceil\(N/128\), ceil\(K/128\)\)"),
    (dict(scale_w=torch.ones(2, 5)), r"scale_w must be \(G, N\)"),
    (dict(scale_x=torch.ones(8, 2, dtype=torch.float16)), "float32"),
    (dict(out_dtype=torch.float16), "write bfloat16"),
    (dict(accumulate=True), "accumulate=True needs out"),
    (dict(offs=torch.tensor([8], dtype=torch.int32)), "one end per group"),
])
def test_forward_errors_name_the_argument(bad, match):
    args = dict(x=fp8(8, 256), w=fp8(2, 130, 256), offs=offs_of([4, 4]),
                scale_x=torch.ones(8, 2), scale_w=torch.ones(2, 2, 2))
    if "scale_w" in bad and bad["scale_w"] is not None and bad["scale_w"].dim() == 2:
        args["scale_x"] = torch.ones(8)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        distgemm.grouped_mm(args.pop("x"), args.pop("w"), args.pop("offs"), **args)


def test_fp8_pairs_and_bf16_refuses_scales():
    x5 = torch.randn(8, 32).to(torch.float8_e5m2)
    w5 = torch.randn(2, 16, 32).to(torch.float8_e5m2)
    for x, w in ((x5, w5), (fp8(8, 32), w5)):  # b (the weight or activation) must be e4m3
        with pytest.raises(ValueError, match="float8_e5m2 x \\(a gradient\\) with a float8_e4m3fn w"):
            distgemm.grouped_mm(x, w, offs_of([4, 4]), scale_x=torch.ones(8), scale_w=torch.ones(2, 16))
    with pytest.raises(ValueError, match="float8 inputs only"):
        distgemm.grouped_mm(torch.randn(8, 32).bfloat16(), torch.randn(2, 16, 32).bfloat16(),
                            offs_of([4, 4]), scale_x=torch.ones(8), scale_w=torch.ones(2, 16))


def test_wgrad_errors_name_the_layout():
    offs = offs_of([100, 28])
    tp = 128 * (1 + 2)
    dy_t, x_t = fp8(16, tp), fp8(32, tp)
    s_dy, s_x = torch.ones(tp // 128, 16).t(), torch.ones(tp // 128, 32).t()
    with pytest.raises(ValueError, match="padded layout"):
        distgemm.grouped_mm_wgrad(dy_t[:, :200], x_t[:, :200], offs, scale_dy=s_dy, scale_x=s_x)
    with pytest.raises(ValueError, match="scale_dy must be"):
        distgemm.grouped_mm_wgrad(dy_t, x_t, offs, scale_dy=s_dy[:, :1], scale_x=s_x)
    with pytest.raises(ValueError, match="needs scale_dy"):
        distgemm.grouped_mm_wgrad(dy_t, x_t, offs)
    with pytest.raises(ValueError, match="float32"):
        distgemm.grouped_mm_wgrad(dy_t, x_t, offs, scale_dy=s_dy, scale_x=s_x,
                                  out_dtype=torch.bfloat16)


def test_wgrad_refuses_operands_quantized_without_offs():
    # T a multiple of 128 and T >= 128 G: the unpadded (N, T) layout passes every shape check,
    # but its tokens run past what a padded layout of that width holds (Tp - 128 G).
    counts, n, k = [300, 212], 16, 32
    offs, t = offs_of(counts), sum(counts)
    dy, x = torch.randn(t, n), torch.randn(t, k)
    dy_t, s_dy = distgemm.quantize_fp8(dy, (1, 128), transpose=True)
    x_t, s_x = distgemm.quantize_fp8(x, (1, 128), transpose=True)
    assert dy_t.shape == (n, t)
    with pytest.raises(ValueError, match=r"offs\[-1\] = 512 is past the 256 tokens the padded layout .*"
                                         r"quantize_fp8\(\.\.\., transpose=True, offs=offs\)"):
        distgemm.grouped_mm_wgrad(dy_t, x_t, offs, scale_dy=s_dy, scale_x=s_x)
    dy_t, s_dy = distgemm.quantize_fp8(dy, (1, 128), transpose=True, offs=offs)
    x_t, s_x = distgemm.quantize_fp8(x, (1, 128), transpose=True, offs=offs)
    out = distgemm.grouped_mm_wgrad(dy_t, x_t, offs, scale_dy=s_dy, scale_x=s_x)
    ref = torch.stack([dy[:300].T @ x[:300], dy[300:].T @ x[300:]])
    torch.testing.assert_close(out, ref, rtol=0.15, atol=2.0)


@pytest.mark.parametrize("offs", [[300, 200], [-4, 512], [300, 513]])
def test_fp8_forward_checks_cpu_offsets(offs):
    x, w = fp8(512, 128), fp8(2, 16, 128)
    sx, sw = torch.ones(512), torch.ones(2, 16)
    with pytest.raises(ValueError, match="offs"):
        distgemm.grouped_mm(x, w, torch.tensor(offs, dtype=torch.int32), scale_x=sx, scale_w=sw)


def test_dense_gemm_with_block_scales():
    m, n, k = 5, 130, 260
    a, b = fp8(m, k), fp8(n, k)
    sa, sb = torch.rand(m, 3) + 0.5, torch.rand(2, 3) + 0.5
    out = distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    ref = dequantize_blocks(a, sa, 1, 128) @ dequantize_blocks(b, sb, 128, 128).T
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-3)
    with pytest.raises(ValueError, match="128-block scales give bfloat16 out without c"):
        distgemm.gemm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="scale_b must be a float32 tensor"):
        distgemm.gemm(a, b, scale_a=sa, scale_b=sb.to(torch.bfloat16))


@pytest.mark.parametrize("m, nb, kb", [(5, 3, 7), (256, 2, 4), (1, 1, 1)])
def test_cublas_block_scale_layouts(m, nb, kb):
    """The scales the block-scaled dense gemm hands F.scaled_mm: a's M-major with the same
    values, b's (K blocks padded to 4 with ones, N/128) K-block-major."""
    from distgemm._torch_block_scaled import cublas_scale_a, cublas_scale_b

    sa = torch.rand(m, kb) + 0.5
    ca = cublas_scale_a(sa)
    assert torch.equal(ca, sa) and ca.stride() == (1, m)
    assert cublas_scale_a(ca).data_ptr() == ca.data_ptr(), "an M-major scale was copied again"
    if m > 2:  # a row slice of an M-major tensor has strides (1, m), not (1, m - 1)
        rows = cublas_scale_a(ca[1:])
        assert torch.equal(rows, sa[1:]) and rows.stride() == (1, m - 1)
    sb = torch.rand(nb, kb) + 0.5
    cb = cublas_scale_b(sb)
    kp = -(-kb // 4) * 4
    assert cb.shape == (kp, nb) and cb.stride() == (1, kp)
    assert torch.equal(cb[:kb], sb.t()) and torch.all(cb[kb:] == 1)
    assert (cb.data_ptr() == sb.data_ptr()) == (kb % 4 == 0), "a copy only to pad the K blocks"
