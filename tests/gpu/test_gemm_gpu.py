"""distgemm.gemm on one GPU against the FP32/FP64 reference: shapes, dtypes, every
compiled tile configuration, fallbacks, autograd, CUDA graphs and torch.compile."""

import pytest
import torch

import distgemm
from distgemm._library import device_arch, ops
from tests.reference import assert_close, randn
from tests.reference import ref_gemm as reference

pytestmark = pytest.mark.gpu
DEV = "cuda"

SHAPES = [  # (M, N, K): tile multiples, ragged M/N, M = 1, K = 16, tall, wide
    (256, 512, 128), (1, 4096, 4096), (17, 136, 16), (1000, 1032, 520), (4096, 256, 64),
    (64, 8192, 1024), (2048, 2048, 4096), (129, 257, 8192),
]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_fp32", [False, True])
def test_16bit_shapes(m, n, k, dtype, out_fp32):
    a, b = randn(m, k, dtype=dtype, device=DEV), randn(n, k, dtype=dtype, device=DEV)
    out_dtype = torch.float32 if out_fp32 else dtype
    out = distgemm.gemm(a, b, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert_close(out, reference(a, b), dtype)


@pytest.mark.parametrize("c_kind", ["full", "bias", "bias_2d", "expanded"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_c_alpha_beta(c_kind, out_dtype):
    m, n, k = 300, 520, 256
    a, b = randn(m, k, dtype=torch.bfloat16, device=DEV), randn(n, k, dtype=torch.bfloat16, device=DEV)
    bias = randn(n, dtype=torch.bfloat16, device=DEV)
    c = {"full": randn(m, n, dtype=out_dtype, device=DEV), "bias": bias, "bias_2d": bias[None],
         "expanded": bias.expand(m, n)}[c_kind]
    out = distgemm.gemm(a, b, c, alpha=-0.5, beta=1.25, out_dtype=out_dtype)
    assert_close(out, reference(a, b, c.expand(m, n), -0.5, 1.25))


@pytest.mark.parametrize("c_kind", ["full", "bias"])
def test_beta_zero_does_not_read_c(c_kind):
    # As BLAS and the epilogue's source load: beta = 0 leaves c out, NaN included, on our kernel
    # (autotuning off: the tile heuristic's) and as the dispatch picks.
    m, n, k = 300, 520, 256
    a, b = randn(m, k, dtype=torch.bfloat16, device=DEV), randn(n, k, dtype=torch.bfloat16, device=DEV)
    c = torch.full((m, n) if c_kind == "full" else (n,), float("nan"), dtype=torch.bfloat16, device=DEV)
    want = reference(a, b)
    with distgemm.settings(autotune=False):
        assert_close(distgemm.gemm(a, b, c, beta=0.0), want)
    assert_close(distgemm.gemm(a, b, c, alpha=2.0, beta=0.0), reference(a, b, None, 2.0))


FP8_PAIRS = [(torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e4m3fn, torch.float8_e5m2),
             (torch.float8_e5m2, torch.float8_e4m3fn)]


@pytest.mark.parametrize("pair", FP8_PAIRS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scales", ["none", "tensor", "rowwise", "mixed"])
@pytest.mark.parametrize("m,n,k", [(1, 256, 128), (200, 1040, 512), (2048, 4096, 1024)])
def test_fp8(pair, out_dtype, scales, m, n, k):
    a, b = randn(m, k, dtype=pair[0], device=DEV), randn(n, k, dtype=pair[1], device=DEV)
    c = randn(n, dtype=out_dtype, device=DEV)
    if scales == "none":  # FP8 GEMMs take their scales explicitly
        with pytest.raises(ValueError, match="scale_a"):
            distgemm.gemm(a, b, c, alpha=0.5, beta=1.0, out_dtype=out_dtype)
        return
    sa = torch.rand(m if scales == "rowwise" else 1, device=DEV) + 0.5
    sb = torch.rand(n if scales in ("rowwise", "mixed") else 1, device=DEV) + 0.5
    out = distgemm.gemm(a, b, c, alpha=0.5, beta=1.0, out_dtype=out_dtype, scale_a=sa, scale_b=sb)
    assert_close(out, reference(a, b, c, 0.5, 1.0, sa, sb), pair[0])


@pytest.mark.parametrize("fast", [False, True])
def test_fp8_matches_scaled_mm(fast):
    m, n, k = 1024, 2048, 4096
    a = randn(m, k, dtype=torch.float8_e4m3fn, device=DEV)
    b = randn(n, k, dtype=torch.float8_e4m3fn, device=DEV)
    sa, sb = torch.tensor(0.8, device=DEV), torch.tensor(1.3, device=DEV)
    ours = distgemm.gemm(a, b, scale_a=sa, scale_b=sb, use_fast_accum=fast)
    theirs = torch._scaled_mm(a, b.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    assert_close(ours, theirs.float(), torch.float8_e4m3fn)
    assert_close(ours, reference(a, b, sa=sa, sb=sb), torch.float8_e4m3fn)


EVERY_CONFIG = [(torch.bfloat16, torch.bfloat16, True, False), (torch.float16, torch.float16, True, False),
                (torch.bfloat16, torch.float32, True, False), (torch.float16, torch.float32, True, False),
                (torch.bfloat16, torch.bfloat16, False, False), (torch.float16, torch.float16, False, False),
                (torch.float8_e4m3fn, torch.bfloat16, True, False), (torch.float8_e4m3fn, torch.bfloat16, True, True),
                (torch.float8_e4m3fn, torch.float32, True, False)]


@pytest.mark.parametrize("dtype,out_dtype,b_k_major,fast", EVERY_CONFIG)
def test_every_config(dtype, out_dtype, b_k_major, fast):
    arch = device_arch(torch.device(DEV))
    names = ops.gemm_configs(dtype, dtype, out_dtype, b_k_major, arch, fast)
    assert names, "no kernel compiled for this combination"
    m, n, k = 333, 392, 704
    a = randn(m, k, dtype=dtype, device=DEV)
    b = randn(n, k, dtype=dtype, device=DEV) if b_k_major else randn(k, n, dtype=dtype, device=DEV).T
    c = randn(m, n, dtype=out_dtype, device=DEV)
    for config, name in enumerate(names):
        for swizzle in (1, 2):
            # A new alpha each call: an element a kernel leaves unwritten cannot pass by holding
            # the previous call's (equal) result in recycled memory.
            alpha = 1.5 + 0.25 * (2 * config + swizzle)
            out = ops.gemm(a, b, c, alpha, 0.5, out_dtype, None, None, fast, config, swizzle)
            try:
                assert_close(out, reference(a, b, c, alpha, 0.5), dtype)
            except AssertionError as e:
                raise AssertionError(f"config {name} swizzle {swizzle}: {e}") from None


def test_fp8_b_must_be_k_major():
    a = randn(64, 64, dtype=torch.float8_e4m3fn, device=DEV)
    b = randn(64, 64, dtype=torch.float8_e4m3fn, device=DEV).T
    with pytest.raises(ValueError, match="float8 b must be K-major"):
        ops.gemm(a, b, None, 1.0, 0.0, torch.bfloat16, None, None, False)
    # The public op copies it into a K-major operand instead.
    one = torch.ones(1, device=DEV)
    assert_close(distgemm.gemm(a, b, scale_a=one, scale_b=one), reference(a, b), torch.float8_e4m3fn)


@pytest.mark.parametrize("case", ["k_unaligned", "n_unaligned", "a_transposed", "b_strided",
                                  "misaligned_offset", "n_major_unaligned"])
def test_fallback_layouts(case):
    dt = torch.bfloat16
    m, n, k = 96, 80, 64
    if case == "k_unaligned":
        a, b = randn(m, 20, dtype=dt, device=DEV), randn(n, 20, dtype=dt, device=DEV)
    elif case == "n_unaligned":
        a, b = randn(m, k, dtype=dt, device=DEV), randn(33, k, dtype=dt, device=DEV)
    elif case == "a_transposed":
        a, b = randn(k, m, dtype=dt, device=DEV).T, randn(n, k, dtype=dt, device=DEV)
    elif case == "b_strided":
        a, b = randn(m, k, dtype=dt, device=DEV), randn(n, 2 * k, dtype=dt, device=DEV)[:, ::2]
    elif case == "misaligned_offset":
        a = randn(m * k + 1, dtype=dt, device=DEV)[1:].view(m, k)
        b = randn(n, k, dtype=dt, device=DEV)
    else:
        a, b = randn(m, k, dtype=dt, device=DEV), randn(k, 36, dtype=dt, device=DEV).T
    out = distgemm.gemm(a, b)
    assert out.is_contiguous()
    assert_close(out, reference(a, b))


def test_misaligned_views_of_b_and_c():
    b = randn(64 * 64 + 3, dtype=torch.bfloat16, device=DEV)[3:].view(64, 64)
    c = randn(64 * 64 + 1, dtype=torch.bfloat16, device=DEV)[1:].view(64, 64)
    a = randn(64, 64, dtype=torch.bfloat16, device=DEV)
    assert_close(distgemm.gemm(a, b, c, beta=1.0), reference(a, b, c, 1.0, 1.0))


@pytest.mark.parametrize("c_kind", ["full", "bias"])
def test_autograd_matches_linear(c_kind):
    m, n, k = 512, 384, 256
    x = randn(m, k, dtype=torch.bfloat16, device=DEV).requires_grad_()
    w = randn(n, k, dtype=torch.bfloat16, device=DEV, scale=0.05).requires_grad_()
    c = randn(*((m, n) if c_kind == "full" else (n,)), dtype=torch.bfloat16, device=DEV).requires_grad_()
    out = distgemm.gemm(x, w, c, alpha=1.0, beta=1.0)
    grad = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
    out.backward(grad)
    xr, wr, cr = (t.detach().float().requires_grad_() for t in (x, w, c))
    (xr @ wr.T + cr).backward(grad.float())
    for ours, ref in ((x.grad, xr.grad), (w.grad, wr.grad), (c.grad, cr.grad)):
        assert_close(ours, ref)


def test_cuda_graph_capture_and_replay():
    m, n, k = 512, 1024, 256
    a = randn(m, k, dtype=torch.bfloat16, device=DEV)
    b = randn(n, k, dtype=torch.bfloat16, device=DEV)
    c = randn(n, dtype=torch.bfloat16, device=DEV)
    distgemm.gemm(a, b, c, beta=1.0)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = distgemm.gemm(a, b, c, beta=1.0)
    for _ in range(3):
        a.copy_(randn(m, k, dtype=torch.bfloat16, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(a, b, c, 1.0, 1.0))


def test_torch_compile_inductor():
    def f(x, w, bias):
        return torch.nn.functional.gelu(distgemm.gemm(x, w, bias, beta=1.0)) * 2

    x = randn(256, 512, dtype=torch.bfloat16, device=DEV)
    w = randn(1024, 512, dtype=torch.bfloat16, device=DEV)
    bias = randn(1024, dtype=torch.bfloat16, device=DEV)
    compiled = torch.compile(f, fullgraph=True)
    assert_close(compiled(x, w, bias), f(x, w, bias).float())


@pytest.mark.parametrize("n, k", [(256, 16384), (4096, 16384), (384, 16272)])
def test_fp8_block_scales_whose_count_equals_n(n, k):
    """scale_b (N/128, ceil(K/128) = 128) holds N values: still 128 x 128 block scales, run by the
    autotuner's choice (our grouped kernel or F.scaled_mm), not refused or read row-wise."""
    from distgemm.quantize import dequantize_fp8

    m = 256
    a8, sa = distgemm.quantize_fp8(torch.randn(m, k, device=DEV), (1, 128))
    b8, sb = distgemm.quantize_fp8(torch.randn(n, k, device=DEV), (128, 128))
    out = distgemm.gemm(a8, b8, scale_a=sa, scale_b=sb)
    ref = dequantize_fp8(a8, sa, (1, 128)).double() @ dequantize_fp8(b8, sb, (128, 128)).double().T
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert_close(out, ref, in_dtype=torch.float8_e4m3fn)
