"""The native tables of repeat calls (csrc/torch/repeat_calls.cpp, distgemm._repeat_calls): which
16-bit gemm, float8 gemm (per-tensor or row-wise scales) and grouped_mm calls a remembered entry
answers, what it runs, and what goes the full
path. Entries are remembered here directly, under a name of their own, so that last_backend()
tells a repeated call from the full path (which on CPU tensors records nothing)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import distgemm
from distgemm import _repeat_calls, autotune, dense

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
PROBE = "probe"


@pytest.fixture(autouse=True)
def empty_tables():
    _repeat_calls.clear()
    yield
    _repeat_calls.clear()


def bf16(*shape):
    return torch.randn(*shape).to(BF16)


def repeated(call):
    """call()'s result, and whether a remembered entry answered it."""
    autotune.LAST_RAN[0] = None
    out = call()
    return out, autotune.last_backend() == PROBE


def remember_dense(a, b, c=None, alpha=1.0, beta=0.0, out_dtype=BF16, config=-1):
    _repeat_calls.remember_gemm(a, b, c, alpha, beta, out_dtype, PROBE, config)


def fp8_operands(m=4, n=16, k=32):
    """float8 operands and per-tensor scales (the CPU's torch._scaled_mm takes no row-wise ones)."""
    a, b = (torch.randn(m, k) * 4).to(E4M3), (torch.randn(n, k) * 4).to(E4M3)
    return a, b, torch.tensor(0.5), torch.tensor(2.0)


def remember_scaled(a, b, sa, sb, c=None, alpha=1.0, beta=0.0, out_dtype=BF16, fast=False, config=-1,
                    kernel_dtype=None, name=PROBE):
    _repeat_calls.remember_scaled_gemm(a, b, c, alpha, beta, out_dtype, sa, sb, fast,
                                       out_dtype if kernel_dtype is None else kernel_dtype, fast, name, config)


def grouped_operands():
    x, w = bf16(16, 8), bf16(2, 8, 8)
    return x, w, torch.tensor([8, 16], dtype=torch.int32)


def remember_grouped(x, w, offs, out_dtype=None, trans_w=True, config=-1):
    _repeat_calls.remember_grouped_mm(x, w, offs, out_dtype, trans_w, BF16 if out_dtype is None else out_dtype,
                                      PROBE, config)


def test_a_repeated_call_runs_what_the_full_path_ran():
    a, b, c = bf16(4, 16), bf16(8, 16), bf16(8)
    remember_dense(a, b)  # cuBLAS: F.linear
    out, hit = repeated(lambda: distgemm.gemm(a, b))
    assert hit and torch.equal(out, F.linear(a, b))
    remember_dense(a, b, c, beta=1.0)  # cuBLAS with a bias: addmm
    out, hit = repeated(lambda: distgemm.gemm(a, b, c, beta=1.0))
    assert hit and torch.equal(out, torch.addmm(c, a, b.t()))
    remember_dense(a, b, alpha=2.0, out_dtype=torch.float32, config=0)  # our kernel (its CPU stand-in)
    out, hit = repeated(lambda: distgemm.gemm(a, b, alpha=2.0, out_dtype=torch.float32))
    assert hit and torch.equal(out, dense.ops.gemm(a, b, None, 2.0, 0.0, torch.float32, None, None, False, 0))
    x, w, offs = grouped_operands()
    remember_grouped(x, w, offs)  # torch._grouped_mm with w.mT
    out, hit = repeated(lambda: distgemm.grouped_mm(x, w, offs))
    assert hit and torch.equal(out, torch._grouped_mm(x, w.mT, offs=offs, out_dtype=BF16))
    w_kn = w.mT.contiguous()  # the dgrad's layout
    remember_grouped(x, w_kn, offs, trans_w=False)
    out, hit = repeated(lambda: distgemm.grouped_mm(x, w_kn, offs, trans_w=False))
    assert hit and torch.equal(out, torch._grouped_mm(x, w_kn, offs=offs, out_dtype=BF16))


def test_cublas_calls_leave_autocast_out_as_the_full_path_does():
    a, b = torch.randn(4, 16).half(), torch.randn(8, 16).half()
    remember_dense(a, b, out_dtype=torch.float16)
    with torch.autocast("cpu", dtype=BF16):
        out, hit = repeated(lambda: distgemm.gemm(a, b))
    assert hit and out.dtype == torch.float16 and torch.equal(out, F.linear(a, b))


def test_every_key_field_that_differs_misses():
    a, b, c = bf16(4, 16), bf16(8, 16), bf16(8)
    remember_dense(a, b)
    assert _repeat_calls.gemm(a, b, None, 1.0, 0.0, None) is not None
    assert _repeat_calls.gemm(a, b, None, 1, 0, BF16) is not None  # 1 and 1.0, None and a's dtype: one key
    others = [
        (bf16(16, 4).T, b, None, 1.0, 0.0, None),  # strides
        (bf16(5, 16), b, None, 1.0, 0.0, None),  # shape
        (a.half(), b.half(), None, 1.0, 0.0, None),  # dtype
        (a.to("meta"), b.to("meta"), None, 1.0, 0.0, None),  # device
        (a, b, c, 1.0, 0.0, None),  # c
        (a, b, None, 2.0, 0.0, None),  # alpha
        (a, b, None, 1.0, 0.5, None),  # beta
        (a, b, None, 1.0, 0.0, torch.float32),  # out_dtype
        (a, b, None, True, 0.0, None),  # bool equals 1 but the checks refuse it
        (a, b, None, np.float64(1.0), 0.0, None),  # as NumPy's numbers
        (a, b, None, [1.0], 0.0, None),  # not a number at all
        ("a", b, None, 1.0, 0.0, None),  # not a tensor
    ]
    for args in others:
        assert _repeat_calls.gemm(*args) is None, args
    with distgemm.settings(autotune=False):  # other settings: autotuning off takes the full path
        assert _repeat_calls.gemm(a, b, None, 1.0, 0.0, None) is None
    with pytest.raises(TypeError, match="alpha must be a real number"):  # the full path's check
        distgemm.gemm(a, b, alpha=True)


def test_every_grouped_key_field_that_differs_misses():
    x, w, offs = grouped_operands()
    remember_grouped(x, w, offs)
    assert _repeat_calls.grouped_mm(x, w, offs, None, True) is not None
    storage = torch.empty(16 * 8 + 8, dtype=BF16)
    aligned, misaligned = storage[8:].view(16, 8).copy_(x), storage[1:129].view(16, 8).copy_(x)
    assert _repeat_calls.grouped_mm(aligned, w, offs, None, True) is not None  # another tensor, aligned alike
    others = [
        (misaligned, w, offs, None, True),  # 2 bytes off the kernels' 16-byte alignment
        (bf16(8, 16).T, w, offs, None, True),  # strides
        (x.half(), w.half(), offs, None, True),  # dtype
        (x, w, offs.long(), None, True),  # offs
        (x, w, offs, BF16, True),  # out_dtype passed (a key of its own, as the checks resolve it)
        (x, w, offs, None, 1.0),  # 1.0 equals True but the checks refuse it
        (x, w, offs, None, 1),
        (x, w.mT, offs, None, False),  # trans_w
    ]
    for args in others:
        assert _repeat_calls.grouped_mm(*args) is None, args
    with pytest.raises(TypeError, match="trans_w must be True or False"):
        distgemm.grouped_mm(x, w, offs, trans_w=1.0)


def test_the_key_holds_the_settings():
    # A remembered call must not outlive a change of the backend or of debug: equal settings are
    # one object, so that a block under other settings and the calls after it find their own.
    x, w, offs = grouped_operands()
    remember_grouped(x, w, offs)
    with distgemm.settings(grouped_backend="torch"):
        assert _repeat_calls.grouped_mm(x, w, offs, None, True) is None
        remember_grouped(x, w, offs)
        with distgemm.settings(debug=True):
            assert _repeat_calls.grouped_mm(x, w, offs, None, True) is None
    assert _repeat_calls.sizes() == (0, 2, 0)
    with distgemm.settings(grouped_backend="torch"):  # the same settings again: the same entry
        assert _repeat_calls.grouped_mm(x, w, offs, None, True) is not None


class _Logged(torch.Tensor):
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


class _Seen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_subclasses_and_torch_function_modes_take_the_full_path():
    a, b = bf16(4, 16), bf16(8, 16)
    remember_dense(a, b)
    logged = a.as_subclass(_Logged)
    _Logged.seen.clear()
    out, hit = repeated(lambda: distgemm.gemm(logged, b))
    assert not hit and _Logged.seen, "the subclass's __torch_function__ saw nothing"
    with _Seen() as mode:
        out, hit = repeated(lambda: distgemm.gemm(a, b))
    assert not hit and mode.seen, "the mode saw nothing"
    weight = torch.nn.Parameter(b, requires_grad=False)  # a Parameter is a plain tensor here
    assert repeated(lambda: distgemm.gemm(a, weight))[1]
    _repeat_calls.remember_gemm(logged, b, None, 1.0, 0.0, BF16, "subclass", -1)  # not remembered
    assert _repeat_calls.sizes() == (1, 0, 0)


def test_autograd_takes_the_full_path():
    a, b, c = bf16(4, 16), bf16(8, 16), bf16(8)
    remember_dense(a, b)
    remember_dense(a, b, c, beta=1.0)
    x, w, offs = grouped_operands()
    remember_grouped(x, w, offs)
    leaf, bias, xg = a.clone().requires_grad_(), c.clone().requires_grad_(), x.clone().requires_grad_()
    assert _repeat_calls.gemm(leaf, b, None, 1.0, 0.0, None) is None
    assert _repeat_calls.gemm(a, b, bias, 1.0, 1.0, None) is None
    assert _repeat_calls.grouped_mm(xg, w, offs, None, True) is None
    out, hit = repeated(lambda: distgemm.gemm(leaf, b))
    assert out.requires_grad and hit  # the full path records autograd; its forward (grad mode off) repeats
    with torch.no_grad():
        assert _repeat_calls.gemm(leaf, b, None, 1.0, 0.0, None) is not None
        assert _repeat_calls.grouped_mm(xg, w, offs, None, True) is not None


def test_last_backend_reports_the_repeated_call():
    a, b = bf16(4, 16), bf16(8, 16)
    _repeat_calls.remember_gemm(a, b, None, 1.0, 0.0, BF16, "cublas", -1)
    x, w, offs = grouped_operands()
    _repeat_calls.remember_grouped_mm(x, w, offs, None, True, BF16, "torch._grouped_mm", -1)
    distgemm.gemm(a, b)
    assert autotune.last_backend() == "cublas"
    autotune.record("cutlass")  # a full-path call in between
    distgemm.grouped_mm(x, w, offs)
    assert autotune.last_backend() == "torch._grouped_mm"
    distgemm.gemm(a, b)
    assert autotune.last_backend() == "cublas"


def test_an_error_of_the_remembered_call_is_torchs_exception():
    x, w, offs = grouped_operands()
    remember_grouped(x, w, offs, config=0)  # our kernel's op has no CPU kernel
    autotune.LAST_RAN[0] = "before"
    with pytest.raises(NotImplementedError, match="grouped_mm_out"):
        _repeat_calls.grouped_mm(x, w, offs, None, True)
    assert autotune.last_backend() == "before"
    with pytest.raises(TypeError, match="takes 6 arguments"):
        _repeat_calls.gemm(x, w)


def test_autotune_clear_empties_the_tables():
    a, b = bf16(4, 16), bf16(8, 16)
    remember_dense(a, b)
    remember_grouped(*grouped_operands())
    remember_scaled(*fp8_operands())
    assert _repeat_calls.sizes() == (1, 1, 1)
    autotune.clear()
    assert _repeat_calls.sizes() == (0, 0, 0) and _repeat_calls.gemm(a, b, None, 1.0, 0.0, None) is None


def test_a_table_starts_again_beyond_its_limit():
    b = bf16(8, 16)
    for m in range(1, _repeat_calls.LIMIT + 2):  # one key more than it holds
        remember_dense(torch.empty(m, 16, dtype=BF16), b)
        assert _repeat_calls.sizes()[0] <= _repeat_calls.LIMIT
    assert _repeat_calls.sizes()[0] == 1
    assert _repeat_calls.gemm(torch.empty(_repeat_calls.LIMIT + 1, 16, dtype=BF16), b, None, 1.0, 0.0, None) is not None
    remember_dense(torch.empty(_repeat_calls.LIMIT + 1, 16, dtype=BF16), b)  # a key it holds: replaced, kept
    assert _repeat_calls.sizes()[0] == 1


def test_a_repeated_scaled_call_runs_what_the_full_path_ran():
    a, b, sa, sb = fp8_operands()
    remember_scaled(a, b, sa, sb)  # torch._scaled_mm, per-tensor scales
    out, hit = repeated(lambda: distgemm.gemm(a, b, scale_a=sa, scale_b=sb))
    assert hit and torch.equal(out, torch._scaled_mm(a, b.t(), sa, sb, out_dtype=BF16))
    c, one = torch.randn(16), torch.tensor([0.5])  # a bias in float32 (cast), a 1-element scale (0-D)
    remember_scaled(a, b, one, sb, c=c, beta=1.0, out_dtype=torch.float16, fast=True)
    out, hit = repeated(lambda: distgemm.gemm(a, b, c, beta=1.0, out_dtype=torch.float16, scale_a=one, scale_b=sb,
                                              use_fast_accum=True))
    expected = torch._scaled_mm(a, b.t(), one.reshape(()), sb, bias=c.half(), out_dtype=torch.float16,
                                use_fast_accum=True)
    assert hit and torch.equal(out, expected)
    # Our kernel (its CPU stand-in): row-wise scales as the kernels read them, c, alpha and beta,
    # the kernel's float32 cast to bfloat16.
    rows_a, rows_b, full_c = torch.rand(4, 1) + 0.5, torch.rand(16) + 0.5, bf16(4, 16)
    remember_scaled(a, b, rows_a, rows_b, c=full_c, alpha=2.0, beta=0.5, config=0, kernel_dtype=torch.float32)
    out, hit = repeated(lambda: distgemm.gemm(a, b, full_c, alpha=2.0, beta=0.5, scale_a=rows_a, scale_b=rows_b))
    expected = dense.ops.gemm(a, b, full_c, 2.0, 0.5, torch.float32, rows_a.reshape(-1), rows_b, False, 0).to(BF16)
    assert hit and out.dtype == BF16 and torch.equal(out, expected)
    assert _repeat_calls.sizes() == (0, 0, 3)


def test_row_wise_scales_take_torch_scaled_mms_forms():
    # The CPU's torch._scaled_mm refuses row-wise scales: the forms are seen on the way in.
    a, b, _, _ = fp8_operands()
    rows_a, one = torch.rand(4) + 0.5, torch.tensor([2.0])
    remember_scaled(a, b, rows_a, one)
    seen = []

    class Forms(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_mm.default:
                seen.append((args[2].shape, args[2].is_contiguous(), args[3].shape, args[3].is_contiguous()))
                return torch.zeros(4, 16, dtype=BF16)
            return func(*args, **(kwargs or {}))
    with Forms():
        assert _repeat_calls.scaled_gemm(a, b, None, 1.0, 0.0, None, rows_a, one, False) is not None
    assert seen == [((4, 1), True, (1, 16), True)]


def test_every_scaled_key_field_that_differs_misses():
    a, b, sa, sb = fp8_operands()
    remember_scaled(a, b, sa, sb)
    assert _repeat_calls.scaled_gemm(a, b, None, 1.0, 0.0, None, sa, sb, False) is not None
    assert _repeat_calls.scaled_gemm(a, b, None, 1, 0, BF16, sa, sb, False) is not None  # None is bfloat16
    others = [
        (a, b, None, 1.0, 0.0, None, sa.reshape(1), sb, False),  # scale shape
        (a, b, None, 1.0, 0.0, None, sa, torch.rand(16), False),  # row-wise
        (a, b, None, 1.0, 0.0, None, sa.double(), sb, False),  # scale dtype
        (a, b, None, 1.0, 0.0, None, sa, sb.to("meta"), False),  # scale device
        (a, b, None, 1.0, 0.0, None, sa, sb, True),  # use_fast_accum
        (a, b, None, 1.0, 0.0, None, sa, sb, 0),  # 0 equals False but the checks refuse it
        (a, b, None, 1.0, 0.0, torch.float32, sa, sb, False),  # out_dtype
        (a, b, None, 1.0, 0.0, torch.float16, sa, sb, False),
        (a.view(torch.float8_e5m2), b, None, 1.0, 0.0, None, sa, sb, False),  # dtype
        ((torch.randn(32, 4) * 4).to(E4M3).T, b, None, 1.0, 0.0, None, sa, sb, False),  # strides
        (a, b, bf16(16), 1.0, 0.0, None, sa, sb, False),  # c
        (a, b, None, 2.0, 0.0, None, sa, sb, False),  # alpha
        (a, b, None, 1.0, 0.5, None, sa, sb, False),  # beta
        (a, b, None, True, 0.0, None, sa, sb, False),  # bool alpha
        (a, b, None, 1.0, 0.0, None, sa, 2.0, False),  # not a tensor
    ]
    for args in others:
        assert _repeat_calls.scaled_gemm(*args) is None, args
    with distgemm.settings(autotune=False):
        assert _repeat_calls.scaled_gemm(a, b, None, 1.0, 0.0, None, sa, sb, False) is None
    with _Seen() as mode:
        out, hit = repeated(lambda: distgemm.gemm(a, b, scale_a=sa, scale_b=sb))
    assert not hit and mode.seen
    leaf = sa.clone().requires_grad_()  # float8 has no autograd, but the check is the same for every table
    assert _repeat_calls.scaled_gemm(a, b, None, 1.0, 0.0, None, leaf, sb, False) is None
    with torch.no_grad():
        remember_scaled(a, b, leaf, sb)
        assert _repeat_calls.scaled_gemm(a, b, None, 1.0, 0.0, None, leaf, sb, False) is not None
    with pytest.raises(TypeError, match="takes 9 arguments"):
        _repeat_calls.scaled_gemm(a, b)


def test_last_backend_reports_the_repeated_scaled_call():
    a, b, sa, sb = fp8_operands()
    remember_scaled(a, b, sa, sb, name=dense._SCALED_MM)
    remember_scaled(a, b, sa, sb, out_dtype=torch.float32, config=0, name="cutlass:tile")
    autotune.record("cutlass")
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert autotune.last_backend() == "torch._scaled_mm"
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert autotune.last_backend() == "cutlass:tile"
