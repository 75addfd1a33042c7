"""What a repeated call may reuse: the repeat-call tables of the dense and grouped GEMMs key a call
by its signature, so a call that differs in anything that changes its answer (or what may run it)
must miss them, and a remembered runner must give what the full path gives. Through the public
ops on the fake sm_90 GPU of test_dispatch_paths_cpu (kernels and vendor calls as counted
plain-PyTorch stand-ins)."""

import pytest
import torch

import distgemm
from distgemm import autotune, dense, grouped
from tests.cpu import test_dispatch_paths_cpu as paths
from tests.cpu.test_dispatch_paths_cpu import BF16, E4M3, GEMM_BF16

gpu, grouped_gpu = paths.gpu, paths.grouped_gpu  # the fake sm_90 GPU's fixtures

REAL_LINEAR = torch.nn.functional.linear  # before the fixture's stand-in replaces it


def close(out, expected):
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-1)


def operands(m=32, n=48, k=64):
    return torch.randn(m, k).to(BF16), torch.randn(n, k).to(BF16)


# ---------------------------------------------------------------- dense, 16-bit


def offset_view(t, elems):
    """t's values in a view of the same shape and strides at `elems` elements into its storage."""
    buf = torch.zeros(t.numel() + elems, dtype=t.dtype)
    view = buf[elems:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("vary", ["values", "storage_offset", "transposed_b", "strided_a", "out_dtype", "alpha"])
def test_a_second_call_that_differs_gets_its_own_answer(gpu, vary):
    a, b = operands()
    gpu["times"][GEMM_BF16[1]] = 0.5
    distgemm.gemm(a, b)  # settles cutlass config 1 for this signature
    kwargs = {}
    a2, b2 = operands()
    if vary == "storage_offset":
        a2, b2 = offset_view(a2, 3), offset_view(b2, 5)
    elif vary == "transposed_b":
        b2 = b2.t().contiguous().t()
    elif vary == "strided_a":
        a2 = torch.cat([a2, a2], 1)[:, :64]
    elif vary == "out_dtype":
        kwargs["out_dtype"] = torch.float32
    elif vary == "alpha":
        kwargs["alpha"] = 3.0
    out = distgemm.gemm(a2, b2, **kwargs)
    assert out.dtype == kwargs.get("out_dtype", BF16)
    close(out, kwargs.get("alpha", 1.0) * (a2.float() @ b2.float().T))


@pytest.mark.parametrize("c_shape", [(32, 48), (48,), (1, 48), "expanded"])
def test_c_broadcast_shapes_and_dtypes_are_told_apart(gpu, c_shape):
    a, b = operands()
    gpu["times"]["cublas"] = 0.1
    bias = torch.randn(48).to(BF16)
    distgemm.gemm(a, b, bias, beta=1.0)  # a bias through addmm
    c = bias.expand(32, 48) if c_shape == "expanded" else torch.randn(c_shape)
    for dtype in (torch.float32, BF16):
        for beta in (1.0, 0.5):
            out = distgemm.gemm(a, b, c.to(dtype), beta=beta)
            close(out, dense.reference_gemm(a, b, c.to(dtype), 1.0, beta, torch.float32))
            if beta != 1.0:
                assert "cublas" not in gpu["ran"][-1:], "cuBLAS through PyTorch has no beta"


def test_requires_grad_after_a_settled_no_grad_call_records_autograd(gpu):
    a, b = operands()
    with torch.no_grad():
        distgemm.gemm(a, b)
    a.requires_grad_()
    out = distgemm.gemm(a, b)
    assert out.requires_grad
    out.float().sum().backward()
    close(a.grad, b.float().sum(0).expand(32, 64))


@pytest.mark.parametrize("with_c", [False, True])
def test_the_cublas_choice_gives_the_inputs_dtype_under_autocast(gpu, monkeypatch, with_c):
    # F.linear and addmm follow autocast (CUDA's and the CPU's alike), our kernel and gemm's
    # contract do not: under autocast to float16 a bfloat16 call whose choice is cuBLAS came back
    # float16, its products past 65504 inf, while one on our kernel stayed bfloat16.
    def vendor_linear(a, b, bias=None):
        gpu["run"]("cublas")
        return REAL_LINEAR(a, b, bias)
    monkeypatch.setattr(torch.nn.functional, "linear", vendor_linear)
    a, b = torch.full((32, 64), 100.0, dtype=BF16), torch.full((48, 64), 100.0, dtype=BF16)
    c = torch.ones(48, dtype=BF16) if with_c else None
    beta = 1.0 if with_c else 0.0
    gpu["times"]["cublas"] = 0.1
    expected = dense.reference_gemm(a, b, c, 1.0, beta, torch.float32)  # 640000 (+1)
    for autocast in (False, True, True):  # the choice's first call, its repeat through the table
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            out = distgemm.gemm(a, b, c, beta=beta)
        assert autotune.last_backend() == "cublas"
        assert out.dtype == BF16
        close(out, expected)


# ---------------------------------------------------------------- dense, float8


def fp8(m=32, n=48, k=64):
    a, b = operands(m, n, k)
    return a.to(E4M3), b.to(E4M3)


@pytest.mark.parametrize("first,second", [("tensor", "row"), ("row", "tensor"), ("row", "row_2d"),
                                          ("row", "row_strided")])
def test_scale_shapes_and_strides_are_told_apart(gpu, first, second):
    a, b = fp8()

    def scales(kind):
        if kind == "tensor":
            return torch.tensor([0.5]), torch.tensor([2.0])
        sa, sb = torch.rand(32) + 0.5, torch.rand(48) + 0.5
        if kind == "row_2d":
            return sa.reshape(32, 1), sb.reshape(1, 48)
        if kind == "row_strided":
            return torch.stack([sa, sa], 1)[:, 0], sb
        return sa, sb
    for kind, fast in ((first, False), (second, False), (second, True)):
        sa, sb = scales(kind)
        out = distgemm.gemm(a, b, scale_a=sa, scale_b=sb, use_fast_accum=fast)
        close(out, dense.reference_gemm(a, b, None, 1.0, 0.0, torch.float32, sa, sb))


def block(m=32, n=48, k=256):
    a, b = fp8(m, n, k)
    return a, b, torch.ones(m, k // 128), torch.ones((n + 127) // 128, k // 128)


def test_block_scaled_c_of_the_tp_ops_is_added_and_not_remembered_for_gemm(gpu):
    # The TP ops check c against their own shapes and hand it to gemm_unchecked with 128-block
    # scales; that path has no epilogue c. It dropped c and beta (all_gather_matmul and
    # matmul_reduce_scatter on one rank, or the collectives path), and remembered the runner under
    # the signature with c, so that distgemm.gemm's lookup, made before its checks, then returned
    # a @ b.T without c for the call it refuses.
    a, b, sa, sb = block()
    c = torch.full((48,), 100.0, dtype=BF16)
    out = dense.gemm_unchecked(a, b, c, 1.0, 1.0, BF16, sa, sb, False, 90)  # as tp.py calls it
    close(out, a.float() @ b.float().T + 100.0)
    with pytest.raises(ValueError, match="without c"):
        distgemm.gemm(a, b, c, beta=1.0, scale_a=sa, scale_b=sb)
    close(distgemm.gemm(a, b, scale_a=sa, scale_b=sb), a.float() @ b.float().T)  # c-less calls still repeat


# ---------------------------------------------------------------- grouped


def routed(tokens=100, n=64, k=32):
    x = torch.randn(tokens, k).to(BF16)
    w = torch.randn(4, n, k).to(BF16)
    return x, w, torch.tensor([10, 10, 60, 100], dtype=torch.int32)


def grouped_reference(x, w, offs, trans_w=True):
    n = w.shape[1] if trans_w else w.shape[2]
    return grouped.reference_grouped_mm(x, w, offs, torch.zeros(x.shape[0], n), False, trans_w)


def test_grouped_forced_backend_and_misaligned_views_miss_the_table(grouped_gpu):
    x, w, offs = routed()
    grouped_gpu["times"]["torch._grouped_mm"] = 0.1
    distgemm.grouped_mm(x, w, offs)
    assert grouped_gpu["ran"][-1] == "torch._grouped_mm"
    with distgemm.settings(grouped_backend="cutlass"):
        out = distgemm.grouped_mm(x, w, offs)
    assert grouped_gpu["ran"][-1][0] == "cutlass"
    close(out, grouped_reference(x, w, offs))
    x2 = offset_view(x, 1)  # 2 bytes in: the kernels and torch._grouped_mm need 16-byte aligned data
    out = distgemm.grouped_mm(x2, w, offs)
    close(out[:100], grouped_reference(x2, w, offs))


def test_grouped_trans_w_offs_and_out_dtype_are_told_apart(grouped_gpu):
    x, w, offs = routed(n=32)
    distgemm.grouped_mm(x, w, offs)
    out = distgemm.grouped_mm(x, w, offs, trans_w=False)  # w (G, N, K) = (G, K, N) when N == K
    close(out, grouped_reference(x, w, offs, trans_w=False))
    out = distgemm.grouped_mm(x, w, offs, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match="int32"):
        distgemm.grouped_mm(x, w, offs.long())
    with pytest.raises(ValueError, match="one end per group"):
        distgemm.grouped_mm(x, w, torch.tensor([50, 100], dtype=torch.int32))
