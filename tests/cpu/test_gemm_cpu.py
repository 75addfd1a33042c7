"""distgemm.gemm on CPU tensors: the reference path, argument checks, autograd wiring,
torch.compile tracing, and the core's tile heuristic (host code, no GPU)."""

import numpy as np
import pytest
import torch

import distgemm
from distgemm._library import ops
from tests.reference import assert_close, randn
from tests.reference import ref_gemm as manual

F16 = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", F16)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("c_kind", [None, "full", "bias"])
def test_reference_math(dtype, out_dtype, c_kind):
    m, n, k = 37, 24, 48
    a, b = randn(m, k, dtype=dtype, device="cpu"), randn(n, k, dtype=dtype, device="cpu")
    c = {None: None, "full": randn(m, n, dtype=dtype, device="cpu"),
         "bias": randn(n, dtype=dtype, device="cpu")}[c_kind]
    out = distgemm.gemm(a, b, c, alpha=0.5, beta=2.0, out_dtype=out_dtype)
    assert out.shape == (m, n) and out.dtype == (out_dtype or dtype)
    assert_close(out, manual(a, b, c, 0.5, 2.0))


@pytest.mark.parametrize("pair", [(torch.float8_e4m3fn, torch.float8_e4m3fn),
                                  (torch.float8_e4m3fn, torch.float8_e5m2),
                                  (torch.float8_e5m2, torch.float8_e4m3fn)])
@pytest.mark.parametrize("rowwise", [False, True])
def test_reference_fp8_scales(pair, rowwise):
    m, n, k = 16, 32, 64
    a, b = randn(m, k, dtype=pair[0], device="cpu"), randn(n, k, dtype=pair[1], device="cpu")
    sa = torch.rand(m if rowwise else 1) + 0.5
    sb = torch.rand(n if rowwise else 1) + 0.5
    out = distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert out.dtype == torch.bfloat16
    assert_close(out, manual(a, b, sa=sa, sb=sb), in_dtype=pair[0])


def test_k_zero_gives_beta_c():
    a, b = torch.empty(5, 0, dtype=torch.bfloat16), torch.empty(3, 0, dtype=torch.bfloat16)
    c = torch.ones(5, 3, dtype=torch.bfloat16)
    out = distgemm.gemm(a, b, c, beta=3.0)
    assert torch.equal(out, torch.full((5, 3), 3.0, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(a=torch.zeros(4, 8, dtype=torch.float32)), ValueError, "a must be bfloat16"),
        (dict(a=torch.zeros(4, 8, 2, dtype=torch.bfloat16)), ValueError, "a must be 2-D"),
        (dict(b=torch.zeros(4, 16, dtype=torch.bfloat16)), ValueError, r"b must have shape \(N, K\) with K = a.shape\[1\] = 8"),
        (dict(b=torch.zeros(4, 8, dtype=torch.float16)), ValueError, "b must have a's dtype"),
        (dict(c=torch.zeros(3, 3, dtype=torch.bfloat16)), ValueError, r"c must have shape \(M, N\) = \(4, 6\)"),
        (dict(c=torch.zeros(4, 6, dtype=torch.int32)), ValueError, "c must be a floating-point"),
        (dict(out_dtype=torch.float16), ValueError, "out_dtype must be torch.bfloat16 or torch.float32"),
        (dict(scale_a=torch.ones(1)), ValueError, "scale_a applies to float8 inputs only"),
        (dict(a=[[1.0]]), TypeError, "a must be a torch.Tensor"),
        (dict(a=torch.zeros(4, 8, dtype=torch.float8_e5m2), b=torch.zeros(6, 8, dtype=torch.float8_e5m2)),
         ValueError, "float8_e5m2 x float8_e5m2 is not supported"),
        (dict(a=torch.zeros(4, 8, dtype=torch.float8_e4m3fn), b=torch.zeros(6, 8, dtype=torch.bfloat16)),
         ValueError, "b must be float8 too"),
        (dict(a=torch.zeros(4, 8, dtype=torch.float8_e4m3fn), b=torch.zeros(6, 8, dtype=torch.float8_e4m3fn),
              scale_a=torch.ones(3)), ValueError, r"scale_a must hold 1 value \(per tensor\) or M = 4"),
        (dict(a=torch.zeros(4, 8, dtype=torch.float8_e4m3fn), b=torch.zeros(6, 8, dtype=torch.float8_e4m3fn),
              scale_b=torch.ones(6, dtype=torch.float16)), ValueError, "scale_b must be a float32 tensor"),
        (dict(a=torch.zeros(4, 8, dtype=torch.float8_e4m3fn), b=torch.zeros(6, 8, dtype=torch.float8_e4m3fn),
              out_dtype=torch.float8_e4m3fn), ValueError, "out_dtype must be bfloat16, float16 or float32"),
        (dict(b=torch.zeros(6, 8, dtype=torch.bfloat16, device="meta")), ValueError, "b is on meta but a is on cpu"),
        (dict(alpha="2"), TypeError, "alpha must be a real number .*got str '2'"),
        (dict(alpha=None), TypeError, "alpha must be a real number .*got NoneType"),
        (dict(beta=[1.0]), TypeError, "beta must be a real number .*got list"),
        (dict(alpha=True), TypeError, "alpha must be a real number .*got bool"),
        (dict(a=torch.zeros(4, 8, dtype=torch.float8_e4m3fn), b=torch.zeros(6, 8, dtype=torch.float8_e4m3fn)),
         ValueError, "float8 inputs need scale_a and scale_b.*scale_a and scale_b not given"),
        (dict(a=torch.zeros(4, 8, dtype=torch.float8_e4m3fn), b=torch.zeros(6, 8, dtype=torch.float8_e4m3fn),
              scale_a=torch.ones(1)), ValueError, "float8 inputs need scale_a and scale_b.*; scale_b not given"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = dict(a=torch.zeros(4, 8, dtype=torch.bfloat16), b=torch.zeros(6, 8, dtype=torch.bfloat16),
                c=None)
    args.update(kwargs)
    a, b, c = args.pop("a"), args.pop("b"), args.pop("c")
    with pytest.raises(error, match=match):
        distgemm.gemm(a, b, c, **args)


def test_alpha_and_beta_take_any_real_number():
    a, b = randn(4, 8, dtype=torch.bfloat16, device="cpu"), randn(6, 8, dtype=torch.bfloat16, device="cpu")
    c = randn(4, 6, dtype=torch.bfloat16, device="cpu")
    out = distgemm.gemm(a, b, c, alpha=2, beta=np.float32(0.5))
    assert_close(out, manual(a, b, c, 2.0, 0.5))


@pytest.mark.parametrize("c_kind", ["full", "bias"])
def test_autograd_matches_reference(c_kind):
    m, n, k = 12, 16, 24
    a = randn(m, k, dtype=torch.bfloat16, device="cpu").requires_grad_()
    b = randn(n, k, dtype=torch.bfloat16, device="cpu").requires_grad_()
    c = randn(*((m, n) if c_kind == "full" else (n,)), dtype=torch.bfloat16, device="cpu").requires_grad_()
    out = distgemm.gemm(a, b, c, alpha=0.75, beta=1.5, out_dtype=torch.float32)
    grad = torch.randn(m, n)
    out.backward(grad)

    a64, b64, c64 = (t.detach().double().requires_grad_() for t in (a, b, c))
    (0.75 * a64 @ b64.T + 1.5 * c64).backward(grad.double())
    for ours, ref in ((a.grad, a64.grad), (b.grad, b64.grad), (c.grad, c64.grad)):
        assert ours.dtype == torch.bfloat16
        assert_close(ours, ref)


def test_torch_compile_fullgraph_traces_the_op():
    def f(a, b, c):
        return torch.relu(distgemm.gemm(a, b, c, beta=1.0))

    a, b = randn(8, 16, dtype=torch.bfloat16, device="cpu"), randn(32, 16, dtype=torch.bfloat16, device="cpu")
    c = randn(32, dtype=torch.bfloat16, device="cpu")
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(a, b, c), f(a, b, c))


def test_heuristic_prefers_small_tiles_for_small_m():
    names = ops.gemm_configs(torch.bfloat16, torch.bfloat16, torch.bfloat16, True, 90)
    assert "coop_128x256_c2x1" in names and "pingpong_64x128_c1x1" in names
    pick = lambda m, n, k: names[ops.gemm_select_config(m, n, k, torch.bfloat16, torch.bfloat16,
                                                        torch.bfloat16, True, 90, 132)]
    assert pick(1, 4096, 4096) == "pingpong_64x128_c1x1"
    assert pick(8192, 8192, 8192).startswith("coop_")
    # Unsupported combinations have no kernels rather than a wrong one.
    assert ops.gemm_configs(torch.float8_e5m2, torch.float8_e5m2, torch.bfloat16, True, 90) == []
    assert ops.gemm_select_config(64, 64, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16, True, 80, 108) == -1


@pytest.mark.parametrize("m,n,k", [(2**31, 64, 64), (64, 2**40, 64), (64, 64, 2**62), (0, 64, 64), (-1, 64, 64),
                                   (64, 64, 60), (-(2**63), 64, 64)])
def test_heuristic_query_refuses_what_the_checks_refuse(m, n, k):
    # The core's size checks run first (checked int64 arithmetic): -1, never a crash or a pick.
    bf = torch.bfloat16
    assert ops.gemm_select_config(m, n, k, bf, bf, bf, True, 90, 132) == -1


@pytest.mark.parametrize("sm_count", [0, -1, 1, 2**31 - 1])
def test_heuristic_query_extreme_sizes_and_sm_counts(sm_count):
    bf = torch.bfloat16
    names = ops.gemm_configs(bf, bf, bf, True, 90)
    for m, n, k in [(2**31 - 8, 2**31 - 8, 8), (1, 2**31 - 8, 2**31 - 8), (8, 8, 8)]:
        assert 0 <= ops.gemm_select_config(m, n, k, bf, bf, bf, True, 90, sm_count) < len(names)


@pytest.mark.parametrize("n, k", [(256, 16384), (4096, 16384), (384, 16300), (200, 300)])
def test_block_scales_whose_count_equals_n_are_block_scales(n, k):
    """scale_b (ceil(N/128), ceil(K/128)) holds N values whenever N is a multiple of 128 and
    ceil(K/128) = 128: still 128 x 128 blocks, not one scale per row of b."""
    from distgemm.quantize import dequantize_fp8

    m = 3
    a8, sa = distgemm.quantize_fp8(torch.randn(m, k), (1, 128))
    b8, sb = distgemm.quantize_fp8(torch.randn(n, k), (128, 128))
    out = distgemm.gemm(a8, b8, scale_a=sa, scale_b=sb)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = dequantize_fp8(a8, sa, (1, 128)).double() @ dequantize_fp8(b8, sb, (128, 128)).double().T
    assert_close(out, ref, in_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("scale_a, scale_b, named", [
    ((64, 4), (4, 3), r"scale_b must be \(ceil\(N/128\), ceil\(K/128\)\) = \(3, 4\)"),   # b's scales transposed
    ((64, 4), (1, 3, 4), r"scale_b must be \(ceil\(N/128\), ceil\(K/128\)\) = \(3, 4\)"),
    ((64, 4), (1,), r"scale_b must be \(ceil\(N/128\), ceil\(K/128\)\) = \(3, 4\)"),
    ((4, 64), (3, 4), r"scale_a must be \(M, ceil\(K/128\)\) = \(64, 4\)"),               # a's scales transposed
])
def test_block_scales_of_a_wrong_shape_name_the_wrong_one(scale_a, scale_b, named):
    a = torch.randn(64, 512).to(torch.float8_e4m3fn)
    b = torch.randn(384, 512).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="distgemm.gemm: 128-block scales: " + named):
        distgemm.gemm(a, b, scale_a=torch.ones(scale_a), scale_b=torch.ones(scale_b))


def test_block_scales_name_an_e5m2_b():
    a = torch.randn(64, 512).to(torch.float8_e4m3fn)
    b = torch.randn(384, 512).to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="distgemm.gemm: 128-block scales take a float8_e4m3fn b"):
        distgemm.gemm(a, b, scale_a=torch.ones(64, 4), scale_b=torch.ones(3, 4))
