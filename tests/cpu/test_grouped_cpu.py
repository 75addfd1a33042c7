"""Grouped GEMM API on CPU tensors: reference math, argument checks, backend selection,
autograd wiring, GroupedLinear and torch.compile tracing."""

import pytest
import torch

import distgemm
from distgemm.nn import GroupedLinear
from tests.reference import assert_close, grouped_loop, grouped_wgrad_loop


def split(tokens, groups, zero_groups=()):
    """Random cumulative ends summing to `tokens`, with the given groups empty."""
    weights = torch.rand(groups)
    for g in zero_groups:
        weights[g] = 0
    counts = (weights / weights.sum() * tokens).floor().long()
    counts[max(set(range(groups)) - set(zero_groups))] += tokens - counts.sum()
    return counts.cumsum(0).to(torch.int32)


@pytest.mark.parametrize("trans_w", [True, False])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_forward_and_dgrad_reference(trans_w, out_dtype):
    g, t, n, k = 5, 70, 24, 16
    offs = split(t, g, zero_groups=(1,))
    x = torch.randn(t, k).bfloat16()
    w = torch.randn(g, n, k).bfloat16() if trans_w else torch.randn(g, k, n).bfloat16()
    out = distgemm.grouped_mm(x, w, offs, trans_w=trans_w, out_dtype=out_dtype)
    assert out.shape == (t, n) and out.dtype == (out_dtype or torch.bfloat16)
    assert_close(out, grouped_loop(x, w, offs, trans_w))


def test_wgrad_reference_zero_groups_and_accumulate():
    g, t, n, k = 6, 50, 16, 24
    offs = split(t, g, zero_groups=(0, 3))
    dy, x = torch.randn(t, n).bfloat16(), torch.randn(t, k).bfloat16()
    out = distgemm.grouped_mm_wgrad(dy, x, offs)
    assert out.dtype == torch.float32 and out.shape == (g, n, k)
    assert torch.all(out[0] == 0) and torch.all(out[3] == 0)
    assert_close(out, grouped_wgrad_loop(dy, x, offs))
    main_grad = torch.randn(g, n, k)
    expected = main_grad.double() + grouped_wgrad_loop(dy, x, offs)
    distgemm.grouped_mm_wgrad(dy, x, offs, out=main_grad, accumulate=True)
    assert_close(main_grad, expected)


def test_out_and_accumulate_leave_tail_rows_untouched():
    g, t, n, k = 3, 40, 16, 16
    offs = torch.tensor([10, 10, 30], dtype=torch.int32)  # rows 30.. belong to nobody
    x, w = torch.randn(t, k).bfloat16(), torch.randn(g, n, k).bfloat16()
    out = torch.full((t, n), 7.0)
    distgemm.grouped_mm(x, w, offs, out=out, accumulate=True)
    assert torch.all(out[30:] == 7.0)
    assert_close(out[:30], 7.0 + grouped_loop(x, w, offs)[:30])


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda a: a.update(offs=a["offs"].long()), ValueError,
         r"offs must be a 1-D int32 tensor of cumulative group ends, got torch.int64 of shape \(3,\)"),
        (lambda a: a.update(offs=[5, 10, 20]), TypeError, "offs must be a 1-D int32 tensor .*got list"),
        (lambda a: a.update(offs=a["offs"][:2]), ValueError, r"offs must hold one end per group \(3\)"),
        (lambda a: a.update(w=torch.zeros(3, 8, 12).bfloat16()), ValueError, r"w must have shape \(G, N, K\) with K = x.shape\[1\] = 16"),
        (lambda a: a.update(w=torch.zeros(3, 8, 16).half()), ValueError, "w must have x's dtype"),
        (lambda a: a.update(x=torch.zeros(20, 16)), ValueError, "x must be bfloat16 or float16"),
        (lambda a: a.update(x=torch.zeros(20, 16, 1).bfloat16()), ValueError, "x must be 2-D"),
        (lambda a: a.update(accumulate=True), ValueError, "accumulate=True needs out"),
        (lambda a: a.update(out=torch.zeros(20, 9)), ValueError, r"out must be a torch.float32 tensor of shape \(20, 8\)"),
        (lambda a: a.update(out_dtype=torch.float16), ValueError, "out_dtype must be torch.bfloat16 or torch.float32"),
        (lambda a: a.update(offs=a["offs"].to("meta")), ValueError, "offs is on meta"),
    ],
)
def test_bad_arguments(mutate, error, match):
    args = dict(x=torch.zeros(20, 16).bfloat16(), w=torch.zeros(3, 8, 16).bfloat16(),
                offs=torch.tensor([5, 10, 20], dtype=torch.int32), out=None, accumulate=False,
                out_dtype=None)
    mutate(args)
    if args["out"] is not None and args["out_dtype"] is None:
        args["out_dtype"] = torch.float32
    with pytest.raises(error, match=match):
        distgemm.grouped_mm(args["x"], args["w"], args["offs"], out=args["out"],
                            accumulate=args["accumulate"], out_dtype=args["out_dtype"])


BAD_OFFS = [([5, 3, 20], "offs must be non-negative and non-decreasing, got \\[5, 3, 20\\]"),
            ([5, 10, 21], r"offs\[-1\] = 21 is past the 20 rows"),
            ([-1, 10, 20], "offs must be non-negative")]


@pytest.mark.parametrize("offs, match", BAD_OFFS)
@pytest.mark.parametrize("debug", ["0", "1"])
def test_bad_offsets_on_cpu_raise_with_or_without_debug(offs, match, debug):
    # On CPU tensors the host reads offs anyway, so the check costs nothing and always runs.
    x, w = torch.zeros(20, 16).bfloat16(), torch.zeros(3, 8, 16).bfloat16()
    dy = torch.zeros(20, 8).bfloat16()
    with distgemm.settings(debug=debug):
        with pytest.raises(ValueError, match=match):
            distgemm.grouped_mm(x, w, torch.tensor(offs, dtype=torch.int32))
        with pytest.raises(ValueError, match=match):
            distgemm.grouped_mm_wgrad(dy, x, torch.tensor(offs, dtype=torch.int32))


@pytest.mark.parametrize("offs, match", BAD_OFFS)
def test_the_registered_cpu_ops_check_offsets_too(offs, match):
    x, w = torch.zeros(20, 16).bfloat16(), torch.zeros(3, 8, 16).bfloat16()
    with pytest.raises(ValueError, match=match):
        torch.ops.distgemm.grouped_mm(x, w, torch.tensor(offs, dtype=torch.int32), torch.bfloat16, True)
    with pytest.raises(ValueError, match=match):
        torch.ops.distgemm.grouped_mm_wgrad(torch.zeros(20, 8).bfloat16(), x,
                                            torch.tensor(offs, dtype=torch.int32), torch.float32)


def test_offsets_that_end_early_are_valid():
    x, w = torch.randn(20, 16).bfloat16(), torch.randn(3, 8, 16).bfloat16()
    offs = torch.tensor([5, 5, 12], dtype=torch.int32)  # an empty group, rows 12.. unused
    out = distgemm.grouped_mm(x, w, offs)
    assert_close(out[:12], grouped_loop(x, w, offs)[:12])


def test_backend_env(monkeypatch):
    x, w, offs = torch.randn(8, 16).bfloat16(), torch.randn(2, 8, 16).bfloat16(), torch.tensor([4, 8], dtype=torch.int32)
    monkeypatch.setenv("DISTGEMM_GROUPED_BACKEND", "fastest")
    with pytest.raises(ValueError, match="DISTGEMM_GROUPED_BACKEND must be one of"):
        distgemm.reload_settings()
    with pytest.raises(ValueError, match="distgemm.settings: grouped_backend must be one of"):
        with distgemm.settings(grouped_backend="fastest"):
            pass
    monkeypatch.setenv("DISTGEMM_GROUPED_BACKEND", "cutlass")
    distgemm.reload_settings()
    try:
        distgemm._library.warn_once.cache_clear()
        with pytest.warns(RuntimeWarning, match="backend 'cutlass' unavailable"):
            out = distgemm.grouped_mm(x, w, offs)
        assert_close(out, grouped_loop(x, w, offs))
    finally:
        monkeypatch.undo()
        distgemm.reload_settings()


def test_autograd_through_the_op():
    g, t, n, k = 4, 33, 16, 24
    offs = split(t, g, zero_groups=(2,))
    x = torch.randn(t, k).bfloat16().requires_grad_()
    w = torch.randn(g, n, k).bfloat16().requires_grad_()
    y = distgemm.grouped_mm(x, w, offs)
    dy = torch.randn(t, n).bfloat16()
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    grouped_loop(x64, w64, offs).backward(dy.double())
    assert_close(x.grad, x64.grad)
    assert_close(w.grad, w64.grad)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_matches_linear_loop(bias):
    g, t, din, dout = 4, 37, 16, 24
    offs = split(t, g, zero_groups=(1,))
    layer = GroupedLinear(g, din, dout, bias=bias, dtype=torch.bfloat16)
    refs = [torch.nn.Linear(din, dout, bias=bias, dtype=torch.float64) for _ in range(g)]
    with torch.no_grad():
        for e, lin in enumerate(refs):
            lin.weight.copy_(layer.weight[e])
            if bias:
                lin.bias.copy_(layer.bias[e])
    x = torch.randn(t, din).bfloat16().requires_grad_()
    y = layer(x, offs)
    x64 = x.detach().double().requires_grad_()
    pieces, start = [], 0
    for e, end in enumerate(offs.tolist()):
        pieces.append(refs[e](x64[start:end]))
        start = end
    ref = torch.cat(pieces)
    assert_close(y, ref)
    dy = torch.randn(t, dout).bfloat16()
    y.backward(dy)
    ref.backward(dy.double())
    assert_close(x.grad, x64.grad)
    assert_close(layer.weight.grad, torch.stack([lin.weight.grad for lin in refs]))
    if bias:
        assert_close(layer.bias.grad, torch.stack([lin.bias.grad for lin in refs]))


def test_grouped_linear_fused_wgrad_accumulation():
    g, t, din, dout = 3, 30, 16, 8
    offs = split(t, g)
    layer = GroupedLinear(g, din, dout, fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match="needs weight.main_grad"):
        layer(torch.randn(t, din).bfloat16(), offs)
    for bad, what in ((torch.ones(3), r"torch.float32 \(3,\)"), (torch.ones(g, dout, din).bfloat16(), "torch.bfloat16"),
                      ("grad", "str")):
        layer.weight.main_grad = bad
        with pytest.raises(ValueError, match=f"GroupedLinear: weight.main_grad must be a contiguous float32 "
                                             f"tensor of shape \\({g}, {dout}, {din}\\) on cpu, got {what}"):
            layer(torch.randn(t, din).bfloat16(), offs)
    layer.weight.main_grad = torch.ones(g, dout, din)
    layer.weight.grad_added_to_main_grad = False
    x, dy = torch.randn(t, din).bfloat16(), torch.randn(t, dout).bfloat16()
    layer(x, offs).backward(dy)
    assert layer.weight.grad_added_to_main_grad is True
    assert_close(layer.weight.main_grad, 1.0 + grouped_wgrad_loop(dy, x, offs))


def test_torch_compile_traces_grouped_mm():
    x, w = torch.randn(16, 16).bfloat16(), torch.randn(2, 8, 16).bfloat16()
    offs = torch.tensor([6, 16], dtype=torch.int32)
    f = lambda x, w, offs: distgemm.grouped_mm(x, w, offs).relu()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, w, offs), f(x, w, offs))


@pytest.mark.parametrize("kind", [-1, 3, 7, 2**31 - 1])
def test_grouped_configs_of_unknown_kinds_are_empty(kind):
    from distgemm._library import ops

    # The core compares the raw kind and dtypes before using them as enums: no kernel, no crash.
    assert ops.grouped_configs(kind, torch.bfloat16, torch.bfloat16, 90) == []
    assert ops.grouped_configs(0, torch.bfloat16, torch.bfloat16, -1) == []


@pytest.mark.parametrize("grad_dtype, band", [(torch.float8_e4m3fn, 0.08), (torch.float8_e5m2, 0.16)])
def test_grouped_linear_fp8_gradients_on_the_reference_path(grad_dtype, band):
    """GroupedLinear(fp8="block") end to end on the CPU reference: dx and dw within FP8's
    rounding of the bf16 layer's, e5m2 gradients (2 mantissa bits) included."""
    counts = [100, 0, 156]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    torch.manual_seed(0)
    ref = GroupedLinear(3, 128, 256)
    fp8 = GroupedLinear(3, 128, 256, fp8="block", fp8_grad_dtype=grad_dtype)
    fp8.load_state_dict(ref.state_dict())
    x, dy = torch.randn(256, 128).bfloat16(), torch.randn(256, 256).bfloat16()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(x1, offs).backward(dy)
    fp8(x2, offs).backward(dy)
    for name, a, b in (("dx", x2.grad, x1.grad), ("dw", fp8.weight.grad, ref.weight.grad)):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < band, f"{name}: relative error {rel:.3f} with {grad_dtype} gradients"
    assert torch.all(fp8.weight.grad[1] == 0), "an expert without tokens got a gradient"
    with pytest.raises(ValueError, match="fp8_grad_dtype must be"):
        GroupedLinear(3, 128, 256, fp8="block", fp8_grad_dtype=torch.bfloat16)


@pytest.mark.parametrize("call, name", [
    (lambda v: distgemm.grouped_mm(torch.zeros(4, 8).bfloat16(), torch.zeros(2, 8, 8).bfloat16(),
                                   torch.tensor([2, 4], dtype=torch.int32), accumulate=v), "accumulate"),
    (lambda v: distgemm.grouped_mm(torch.zeros(4, 8).bfloat16(), torch.zeros(2, 8, 8).bfloat16(),
                                   torch.tensor([2, 4], dtype=torch.int32), trans_w=v), "trans_w"),
    (lambda v: distgemm.grouped_mm_wgrad(torch.zeros(4, 8).bfloat16(), torch.zeros(4, 8).bfloat16(),
                                         torch.tensor([2, 4], dtype=torch.int32), accumulate=v), "accumulate"),
    (lambda v: distgemm.gemm(torch.zeros(4, 8).bfloat16(), torch.zeros(4, 8).bfloat16(), use_fast_accum=v),
     "use_fast_accum"),
])
@pytest.mark.parametrize("value", [torch.ones(3), "yes", 2, None])
def test_a_flag_that_is_not_a_bool_is_named(call, name, value):
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        call(value)


def test_out_that_is_not_a_tensor_is_named():
    x, w, offs = torch.zeros(4, 8).bfloat16(), torch.zeros(2, 8, 8).bfloat16(), torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="out must be a torch.Tensor or None, got int"):
        distgemm.grouped_mm(x, w, offs, out=3)
    with pytest.raises(TypeError, match="out must be a torch.Tensor or None, got list"):
        distgemm.grouped_mm_wgrad(x, x, offs, out=[1])


@pytest.mark.parametrize("call", [
    lambda out: distgemm.grouped_mm(torch.zeros(4, 8).bfloat16(), torch.zeros(2, 8, 8).bfloat16(),
                                    torch.tensor([2, 4], dtype=torch.int32), out=out),
    lambda out: distgemm.grouped_mm_wgrad(torch.zeros(4, 8).bfloat16(), torch.zeros(4, 8).bfloat16(),
                                          torch.tensor([2, 4], dtype=torch.int32), out=out.reshape(1, 4, 8).expand(2, 4, 8).contiguous()),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_an_out_of_another_dtype_is_named_as_out(call, dtype):
    with pytest.raises(ValueError, match=r"out must be torch.bfloat16 or torch.float32, got torch\.float"):
        call(torch.zeros(4, 8, dtype=dtype))
