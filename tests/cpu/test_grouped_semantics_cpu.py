"""grouped_mm / grouped_mm_wgrad (16-bit and FP8) against a plain per-expert loop: empty experts,
repeated ends, rows past offs[-1], odd sizes, strided views, out= / accumulate, gradients, and
the dispatch of an sm_90 GPU where it decides what runs (the `grouped_gpu` stand-ins)."""

import pytest
import torch

import distgemm
from distgemm import grouped, quantize_fp8
from distgemm._dispatch import GroupedPass
from distgemm.quantize import dequantize_fp8
from tests.reference import grouped_loop, grouped_wgrad_loop
from test_dispatch_paths_cpu import gpu, grouped_gpu  # noqa: F401  (fixtures)

BF16 = torch.bfloat16
_REAL_GROUPED_MM = torch._grouped_mm  # its meta function holds the CUDA op's stride checks
_GROUPED_MM_OP = grouped.ops.grouped_mm  # the op, with its autograd (the fixture replaces it)


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def close(actual, expected, tol=2e-2):
    actual, expected = actual.detach().double(), expected.detach().double()
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * max(1.0, expected.abs().max().item()))


ROUTINGS = [
    (37, [0, 10, 10, 25, 30]),  # empty first and middle experts, 7 rows past the end
    (9, [9]),  # G = 1
    (50, sorted(torch.randint(0, 51, (300,), generator=torch.Generator().manual_seed(1)).tolist())),  # G = 300
]


@pytest.mark.parametrize("t, ends", ROUTINGS)
@pytest.mark.parametrize("k, n", [(24, 20), (13, 7)])
def test_forward_and_wgrad_match_the_loop(t, ends, k, n):
    offs, g = i32(ends), len(ends)
    x, w, dy = torch.randn(t, k).to(BF16), torch.randn(g, n, k).to(BF16), torch.randn(t, n).to(BF16)
    for out_dtype in (None, torch.float32):
        y = distgemm.grouped_mm(x, w, offs, out_dtype=out_dtype)
        close(y[:ends[-1]], grouped_loop(x, w, offs)[:ends[-1]])
    close(distgemm.grouped_mm(x, w.transpose(1, 2).contiguous(), offs, trans_w=False)[:ends[-1]],
          grouped_loop(x, w, offs)[:ends[-1]])
    dw = distgemm.grouped_mm_wgrad(dy, x, offs)  # rows past offs[-1] ignored, empty experts zero
    assert dw.dtype == torch.float32
    close(dw, grouped_wgrad_loop(dy, x, offs), 1e-5)


def test_strided_views_and_float16():
    offs = i32([5, 5, 19])
    base = torch.randn(40, 48).to(BF16)
    x = base[:21, ::2]  # (21, 24), strided
    w_kn = torch.randn(3, 24, 16).to(BF16)
    close(distgemm.grouped_mm(x, w_kn.transpose(1, 2), offs)[:19], grouped_loop(x, w_kn.transpose(1, 2), offs)[:19])
    close(distgemm.grouped_mm(x.T.contiguous().T, w_kn, offs, trans_w=False)[:19], grouped_loop(x, w_kn, offs, False)[:19])
    x16, w16 = x.half(), w_kn.transpose(1, 2).half()
    y = distgemm.grouped_mm(x16, w16, offs)
    assert y.dtype == torch.float16
    close(y[:19], grouped_loop(x16, w16, offs)[:19], 5e-3)
    with pytest.raises(ValueError, match="out_dtype must be torch.bfloat16 or torch.float32"):
        distgemm.grouped_mm(x, w_kn.transpose(1, 2), offs, out_dtype=torch.float16)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_out_accumulate_and_overwrite_leave_the_tail(dtype):
    offs = i32([0, 10, 10, 25, 30])
    x, w = torch.randn(37, 24).to(BF16), torch.randn(5, 16, 24).to(BF16)
    expected = grouped_loop(x, w, offs)
    for accumulate in (False, True):
        out = torch.randn(37, 16).to(dtype)
        before = out.clone()
        assert distgemm.grouped_mm(x, w, offs, out=out, accumulate=accumulate) is out
        close(out[:30], expected[:30] + (before[:30].double() if accumulate else 0))
        assert torch.equal(out[30:], before[30:])
    main_grad = torch.randn(5, 16, 24)
    before = main_grad.clone()
    dy = torch.randn(37, 16).to(BF16)
    distgemm.grouped_mm_wgrad(dy, x, offs, out=main_grad, accumulate=True)
    close(main_grad, before.double() + grouped_wgrad_loop(dy, x, offs), 1e-5)
    assert torch.equal(main_grad[0], before[0]) and torch.equal(main_grad[2], before[2])  # empty: untouched


def test_out_that_overlaps_an_input_or_is_strided_is_refused():
    offs = i32([4, 9])
    x, w = torch.randn(9, 16).to(BF16), torch.randn(2, 16, 16).to(BF16)
    with pytest.raises(ValueError, match="out must not overlap x"):
        distgemm.grouped_mm(x, w, offs, out=x)
    with pytest.raises(ValueError, match="out must not overlap w"):
        distgemm.grouped_mm(x, w, offs, out=w.view(-1, 16)[:9])
    with pytest.raises(ValueError, match="out must be contiguous"):
        distgemm.grouped_mm(x, w, offs, out=torch.empty(16, 9, dtype=BF16).T)
    buf = torch.randn(2 * 16 * 16).to(BF16)
    with pytest.raises(ValueError, match="out must not overlap dy"):
        distgemm.grouped_mm_wgrad(buf[:9 * 16].view(9, 16), x, offs, out=buf.view(2, 16, 16), out_dtype=BF16)


def test_out_with_autograd_is_refused():
    offs = i32([4, 9])
    x, w = torch.randn(9, 16).to(BF16), torch.randn(2, 8, 16).to(BF16).requires_grad_()
    out = torch.zeros(9, 8, dtype=BF16)
    with pytest.raises(ValueError, match="out= is not differentiable"):
        distgemm.grouped_mm(x, w, offs, out=out)
    with torch.no_grad():
        distgemm.grouped_mm(x, w, offs, out=out)
    close(out, grouped_loop(x, w, offs))


@pytest.mark.parametrize("trans_w", [True, False])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("grads", ["both", "w"])
def test_gradients_match_the_float64_loop(trans_w, out_dtype, grads):
    offs = i32([0, 10, 10, 25, 30])
    x = torch.randn(37, 24).to(BF16).requires_grad_(grads == "both")
    w = (torch.randn(5, 16, 24) if trans_w else torch.randn(5, 24, 16)).to(BF16).requires_grad_()
    y = distgemm.grouped_mm(x, w, offs, out_dtype=out_dtype, trans_w=trans_w)
    dy = torch.randn(37, 16).to(y.dtype)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    grouped_loop(x64, w64, offs, trans_w).backward(dy.to(BF16).double())  # the backward reads dy in x's dtype
    close(w.grad, w64.grad)
    if grads == "both":
        close(x.grad, x64.grad)
        assert not x.grad[30:].any()
    else:
        assert x.grad is None


def test_gpu_backward_on_the_routed_rows(grouped_gpu, monkeypatch):  # noqa: F811
    """The GPU ops' new outputs are uninitialized (NaN here) past offs[-1]: x's gradient there is
    not written (documented, as the forward's rows), the rest and w's gradient are the loop's."""
    # The op itself (its autograd is what runs the backward), and new outputs filled with NaN.
    monkeypatch.setattr(grouped.ops, "grouped_mm", _GROUPED_MM_OP)
    monkeypatch.setattr(GroupedPass, "destination", lambda self: self.out if self.out is not None else torch.full(
        self.shape, float("nan"), dtype=self.out_dtype))
    offs = i32([0, 10, 10, 25, 30])
    x = torch.randn(37, 24).to(BF16).requires_grad_()
    w = torch.randn(5, 16, 24).to(BF16).requires_grad_()
    with distgemm.settings(autotune=False):
        y = distgemm.grouped_mm(x, w, offs)
        y[:30].float().sum().backward()
    assert ("cutlass", -1) in grouped_gpu["ran"]  # the dgrad, through the dispatch
    assert torch.isfinite(x.grad[:30]).all() and torch.isfinite(w.grad).all()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    grouped_loop(x64, w64, offs)[:30].sum().backward()
    close(x.grad[:30], x64.grad[:30])
    close(w.grad, w64.grad)


def _strict_torch(fake):
    """The stand-in for torch._grouped_mm, after the real op's stride checks (on meta copies)."""
    def run(a, b, offs=None, out_dtype=None):
        meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (a, b, offs)]
        _REAL_GROUPED_MM(meta[0], meta[1], offs=meta[2], out_dtype=out_dtype)
        return fake(a, b, offs=offs, out_dtype=out_dtype)
    return run


def test_gpu_unaligned_sizes_and_strided_views_never_reach_torch_grouped_mm_unchecked(grouped_gpu,  # noqa: F811
                                                                                      monkeypatch):
    monkeypatch.setattr(torch, "_grouped_mm", _strict_torch(torch._grouped_mm))
    offs = i32([5, 5, 19])
    for k, n in ((20, 24), (24, 20), (12, 12)):  # cutlass and cuBLAS need 16-byte rows: the loop runs
        x, w, dy = torch.randn(21, k).to(BF16), torch.randn(3, n, k).to(BF16), torch.randn(21, n).to(BF16)
        close(distgemm.grouped_mm(x, w, offs)[:19], grouped_loop(x, w, offs)[:19])
        close(distgemm.grouped_mm(dy, w, offs, trans_w=False)[:19], grouped_loop(dy, w, offs, False)[:19])
        close(distgemm.grouped_mm_wgrad(dy, x, offs), grouped_wgrad_loop(dy, x, offs), 1e-5)
    x, w = torch.randn(21, 48).to(BF16)[:, ::2], torch.randn(3, 16, 48).to(BF16)[:, :, ::2]
    with distgemm.settings(grouped_backend="torch"):
        close(distgemm.grouped_mm(x, w, offs)[:19], grouped_loop(x, w, offs)[:19])
        dy = torch.randn(21, 32).to(BF16)[:, ::2]
        close(distgemm.grouped_mm_wgrad(dy, x, offs, out_dtype=BF16), grouped_wgrad_loop(dy, x, offs))
    assert "torch._grouped_mm" in grouped_gpu["ran"]


# ---------------------------------------------------------------- FP8


@pytest.mark.parametrize("t, ends, k, n", [(37, [0, 10, 10, 30], 200, 136), (129, [129, 129], 256, 16)])
@pytest.mark.parametrize("x_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_forward_dgrad_and_wgrad_match_the_dequantized_loop(t, ends, k, n, x_dtype):
    offs, g = i32(ends), len(ends)
    x, w, dy = torch.randn(t, k), torch.randn(g, n, k), torch.randn(t, n)
    x8, sx = quantize_fp8(x, (1, 128), dtype=x_dtype)
    w8, sw = quantize_fp8(w, (128, 128))
    xd, wd = dequantize_fp8(x8, sx, (1, 128)), dequantize_fp8(w8, sw, (128, 128))
    end = ends[-1]
    expected = grouped_loop(xd, wd, offs)[:end]
    close(distgemm.grouped_mm(x8, w8, offs, scale_x=sx, scale_w=sw)[:end], expected)
    # the dgrad form: w stored (G, K, N) with its own block scales, and its (G, N, K) view
    wt8, swt = quantize_fp8(w.transpose(1, 2).contiguous(), (128, 128))
    expected_t = grouped_loop(xd, dequantize_fp8(wt8, swt, (128, 128)), offs, False)[:end]
    close(distgemm.grouped_mm(x8, wt8, offs, scale_x=sx, scale_w=swt, trans_w=False)[:end], expected_t)
    close(distgemm.grouped_mm(x8, wt8.transpose(1, 2), offs, scale_x=sx, scale_w=swt.transpose(1, 2))[:end],
          expected_t)
    # row-wise
    x8r, sxr = quantize_fp8(x, "row", dtype=x_dtype)
    w8r, swr = quantize_fp8(w.reshape(g * n, k), "row")
    w8r, swr = w8r.reshape(g, n, k), swr.reshape(g, n)
    close(distgemm.grouped_mm(x8r, w8r, offs, scale_x=sxr, scale_w=swr)[:end],
          grouped_loop(x8r.float() * sxr[:, None], w8r.float() * swr[..., None], offs)[:end])
    # wgrad on the padded transposed operands: each expert's tokens quantized on their own
    dy_t, sdy = quantize_fp8(dy, (1, 128), transpose=True, offs=offs, dtype=x_dtype)
    x_t, sxt = quantize_fp8(x, (1, 128), transpose=True, offs=offs)
    dw = distgemm.grouped_mm_wgrad(dy_t, x_t, offs, scale_dy=sdy, scale_x=sxt)
    start = 0
    for e, stop in enumerate(ends):
        if stop == start:
            assert not dw[e].any()
            continue
        d8, ds = quantize_fp8(dy[start:stop], (1, 128), transpose=True, dtype=x_dtype)
        a8, as_ = quantize_fp8(x[start:stop], (1, 128), transpose=True)
        col = 128 * (e + start // 128)
        assert torch.equal(dy_t[:, col:col + stop - start].view(torch.uint8), d8.view(torch.uint8))
        assert not dy_t[:, col + stop - start:col + 128 * ds.shape[1]].view(torch.uint8).any()
        ref = dequantize_fp8(d8, ds, (1, 128)).double() @ dequantize_fp8(a8, as_, (1, 128)).double().T
        close(dw[e], ref, 1e-5)
        start = stop


def test_fp8_malformed_scales_name_the_argument():
    offs = i32([20, 64])
    x8, sx = quantize_fp8(torch.randn(64, 256), (1, 128))
    w8, sw = quantize_fp8(torch.randn(2, 128, 256), (128, 128))
    cases = [
        (dict(scale_x=sx[:, :1], scale_w=sw), r"scale_x must be \(T, ceil\(K/128\)\) = \(64, 2\)"),
        (dict(scale_x=sx, scale_w=sw.transpose(1, 2)), r"scale_w must be \(G, ceil\(N/128\), ceil\(K/128\)\)"),
        (dict(scale_x=sx, scale_w=sw[0]), r"scale_w must be \(G, N\) = \(2, 128\)"),  # a block scale_w without G
        (dict(scale_x=sx, scale_w=sw.bfloat16()), "scale_w must be torch.float32"),
        (dict(scale_x=torch.ones(64), scale_w=torch.ones(128, 2)), r"scale_w must be \(G, N\)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            distgemm.grouped_mm(x8, w8, offs, **kwargs)
    with pytest.raises(ValueError, match="float8_e5m2 x"):
        distgemm.grouped_mm(x8, w8.to(torch.float8_e5m2), offs, scale_x=sx, scale_w=sw)
    out = torch.empty(64, 128, dtype=BF16)
    with pytest.raises(ValueError, match="out must not overlap x"):
        distgemm.grouped_mm(x8, w8, offs, scale_x=sx, scale_w=sw, out=x8.view(BF16).view(64, 128))
    distgemm.grouped_mm(x8, w8, offs, scale_x=sx, scale_w=sw, out=out)
    dy_t, sdy = quantize_fp8(torch.randn(64, 128), (1, 128), transpose=True, offs=offs)
    x_t, sxt = quantize_fp8(torch.randn(64, 256), (1, 128), transpose=True, offs=offs)
    with pytest.raises(ValueError, match=r"scale_dy must be \(128, Tp/128\)"):
        distgemm.grouped_mm_wgrad(dy_t, x_t, offs, scale_dy=sdy.T, scale_x=sxt)
    plain_t, plain_s = quantize_fp8(torch.randn(64, 128), (1, 128), transpose=True)  # no offs: unpadded
    with pytest.raises(ValueError, match="padded layout of quantize_fp8 with offs"):
        distgemm.grouped_mm_wgrad(plain_t, x_t[:, :64], offs, scale_dy=plain_s, scale_x=sxt[:, :1])


def test_wgrad_takes_its_dtype_from_out():
    # out's dtype is the result's unless out_dtype says otherwise; without out, FP32
    offs = i32([0, 10, 10, 25, 30])
    dy, x = torch.randn(30, 16).to(BF16), torch.randn(30, 24).to(BF16)
    ref = distgemm.grouped_mm_wgrad(dy, x, offs)
    assert ref.dtype == torch.float32
    out = torch.zeros(5, 16, 24, dtype=BF16)
    assert distgemm.grouped_mm_wgrad(dy, x, offs, out=out) is out
    assert torch.equal(out, ref.to(BF16))
    with pytest.raises(ValueError, match="out"):
        distgemm.grouped_mm_wgrad(dy, x, offs, out=out, out_dtype=torch.float32)
