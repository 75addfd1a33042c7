"""FP8 quantization on CPU tensors: the plain-PyTorch reference's semantics (scales, rounding
bound, zero and NaN blocks), every layout and its strides, the grouped padded layout, argument
errors, the fake kernel's shapes and strides, and torch.compile tracing."""

import numpy as np
import pytest
import torch

import distgemm
from distgemm.quantize import FP8_MAX, dequantize_fp8, group_spans, reference_quantize_fp8

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
MIN_SUBNORMAL = {torch.float8_e4m3fn: 2.0 ** -9, torch.float8_e5m2: 2.0 ** -16}
INPUTS = [torch.bfloat16, torch.float16, torch.float32]


def randx(*shape, dtype=torch.bfloat16, spread=True):
    """Values over several orders of magnitude (rows and columns scaled apart), finite in float16."""
    x = torch.randn(*shape)
    if spread and x.dim() >= 2:
        x = x * torch.logspace(-2, 2, x.shape[-1])
        x = x * torch.logspace(-1.5, 1.5, x.shape[-2]).unsqueeze(-1)
    return x.to(dtype)


def assert_rounding_bound(x, data, scale, granularity, transpose=False):
    """|dequant - x| <= half an FP8 ulp of x / scale, times the scale (nearest rounding)."""
    dt = data.dtype
    xt = (x.float().t() if transpose else x.float())
    deq = dequantize_fp8(data, scale, granularity, transpose=transpose)
    assert deq.shape == xt.shape
    err = (deq - xt).abs()
    s = dequantize_fp8(torch.ones_like(data, dtype=torch.float32).to(dt), scale, granularity, transpose=transpose)
    v = xt.abs() / s
    half_ulp = torch.maximum(v * 2.0 ** -(MANTISSA[dt] + 1), torch.full_like(v, MIN_SUBNORMAL[dt] / 2))
    bound = s * half_ulp * (1 + 1e-6) + xt.abs() * 1e-6
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3e}"


def scale_reference(amax, dtype):
    s = amax.float() / FP8_MAX[dtype]
    return torch.where(s == 0, torch.ones_like(s), s)


# ---------------------------------------------------------------- values and bounds


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", INPUTS)
@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128), (128, 128)])
def test_round_trip_within_half_ulp(granularity, in_dtype, dtype):
    x = randx(300, 520, dtype=in_dtype)
    data, scale = distgemm.quantize_fp8(x, granularity, dtype=dtype)
    assert data.dtype == dtype and data.shape == x.shape and data.is_contiguous()
    assert scale.dtype == torch.float32
    assert_rounding_bound(x, data, scale, granularity)
    # every block reaches the FP8 range's end: its amax maps to +-fp8_max
    assert data.float().abs().max().item() == FP8_MAX[dtype]


@pytest.mark.parametrize("dtype", FP8)
def test_scales_are_block_amax_over_fp8_max(dtype):
    x = randx(260, 300, dtype=torch.float32)
    a = x.abs()
    _, s = distgemm.quantize_fp8(x, "tensor", dtype=dtype)
    assert s.dim() == 0 and torch.equal(s, scale_reference(a.max(), dtype))
    _, s = distgemm.quantize_fp8(x, "row", dtype=dtype)
    assert torch.equal(s, scale_reference(a.amax(1), dtype))
    _, s = distgemm.quantize_fp8(x, (1, 128), dtype=dtype)
    for j in range(3):
        assert torch.equal(s[:, j], scale_reference(a[:, 128 * j:128 * (j + 1)].amax(1), dtype))
    _, s = distgemm.quantize_fp8(x, (128, 128), dtype=dtype)
    for i in range(3):
        for j in range(3):
            blk = a[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            assert s[i, j] == scale_reference(blk.max(), dtype)


def test_data_is_x_divided_by_scale_rounded_to_nearest_even():
    # x / scale lands exactly between two e4m3 values: 1.0625 is halfway from 1.0 to 1.125.
    x = torch.tensor([[448.0, 1.0625, 1.1875, -1.0625, 0.0]])
    data, scale = distgemm.quantize_fp8(x, "row")
    assert scale.item() == 1.0
    assert data.float().tolist() == [[448.0, 1.0, 1.25, -1.0, 0.0]]


def test_reference_divides_exactly():
    """The bit-exact contract with the kernel rests on a true float32 division (not x * (1/s))."""
    x = torch.randn(1 << 16) * 100
    for s in (3.0 / 448, 0.1, 7.77e-3, 1e-30):
        want = x.numpy() / np.float32(s)
        got = torch.div(x, torch.tensor(s)).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_saturates_instead_of_nan():
    # The scale's rounding can put amax / scale a hair above fp8_max: saturated, never NaN.
    for dtype in FP8:
        x = torch.tensor([[1.0, 3.0 ** 20, -(3.0 ** 20), 7.0]])
        data, _ = distgemm.quantize_fp8(x, "tensor", dtype=dtype)
        assert torch.isfinite(data.float()).all()
        assert data.float().abs().max().item() == FP8_MAX[dtype]


@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128), (128, 128)])
def test_zero_blocks_get_scale_one_and_zero_data(granularity):
    x = torch.zeros(200, 260, dtype=torch.bfloat16)
    x[130:, 140:] = torch.randn(70, 120).bfloat16()
    data, scale = distgemm.quantize_fp8(x, granularity)
    assert torch.all(data.float()[:130, :128] == 0)
    if granularity == (1, 128):
        assert torch.all(scale[:130] == 1) and torch.all(scale[130:, 1:] != 1)
    if granularity == (128, 128):
        assert scale[0].tolist() == [1.0, 1.0, 1.0] and scale[1, 0].item() == 1.0
    if granularity == "row":
        assert torch.all(scale[:130] == 1)
    d, s = distgemm.quantize_fp8(torch.zeros(3, 5), granularity)
    assert torch.all(s == 1) and torch.all(d.float() == 0)


def test_underflowing_scale_is_one():
    x = torch.tensor([[1e-44, -3e-45, 0.0]])  # amax / 448 underflows to 0 in float32
    data, scale = distgemm.quantize_fp8(x, "row")
    assert scale.item() == 1.0 and torch.all(data.float() == 0)


def test_nan_poisons_its_block_only():
    x = torch.randn(4, 256)
    x[1, 5] = float("nan")
    data, scale = distgemm.quantize_fp8(x, (1, 128))
    assert torch.isnan(scale[1, 0]) and torch.isnan(data[1, :128].float()).all()
    assert torch.isfinite(scale[[0, 2, 3]]).all() and torch.isfinite(scale[1, 1])
    assert torch.isfinite(data[1, 128:].float()).all()


def test_negative_zero_keeps_its_sign():
    data, _ = distgemm.quantize_fp8(torch.tensor([[-0.0, 1.0]]), "row")
    assert data.view(torch.uint8)[0, 0].item() == 0x80


# ---------------------------------------------------------------- layouts


@pytest.mark.parametrize("rows, cols", [(1, 1), (7, 129), (128, 128), (300, 1000), (5, 0), (0, 7)])
def test_1x128_layout_is_blockwise_1x128(rows, cols):
    x = torch.randn(rows, cols)
    data, scale = distgemm.quantize_fp8(x, (1, 128))
    nb = (cols + 127) // 128
    assert data.shape == (rows, cols) and scale.shape == (rows, nb)
    assert scale.stride() == (1, rows)  # stored (ceil(C/128), R): DeepGEMM / BlockWise1x128
    for j in range(nb):
        d, s = distgemm.quantize_fp8(x[:, 128 * j:128 * (j + 1)].contiguous(), "row")
        assert torch.equal(scale[:, j], s)
        assert torch.equal(data[:, 128 * j:128 * (j + 1)].view(torch.uint8), d.view(torch.uint8))


@pytest.mark.parametrize("batch", [None, 1, 3])
def test_128x128_layout_and_batches(batch):
    shape = (300, 260) if batch is None else (batch, 300, 260)
    x = randx(*shape)
    data, scale = distgemm.quantize_fp8(x, (128, 128))
    assert data.shape == x.shape
    assert scale.shape == shape[:-2] + (3, 3) and scale.is_contiguous()
    if batch is not None:  # blocks never straddle two matrices
        for b in range(batch):
            d, s = distgemm.quantize_fp8(x[b], (128, 128))
            assert torch.equal(scale[b], s) and torch.equal(data[b].view(torch.uint8), d.view(torch.uint8))
    assert_rounding_bound(x, data, scale, (128, 128))


@pytest.mark.parametrize("rows, cols", [(1, 1), (300, 70), (256, 128), (129, 3), (0, 5), (5, 0)])
def test_transposed_equals_quantizing_x_t(rows, cols):
    x = randx(rows, cols)
    data, scale = distgemm.quantize_fp8(x, (1, 128), transpose=True)
    ref_d, ref_s = distgemm.quantize_fp8(x.t().contiguous(), (1, 128))
    nb = (rows + 127) // 128
    assert data.shape == (cols, rows) and data.is_contiguous()
    assert scale.shape == (cols, nb) and scale.stride() == (1, cols)
    assert torch.equal(data.view(torch.uint8), ref_d.view(torch.uint8)) and torch.equal(scale, ref_s)
    if rows and cols:
        assert_rounding_bound(x, data, scale, (1, 128), transpose=True)


def test_non_contiguous_input_is_quantized_as_its_values():
    base = randx(260, 600)
    x = base[:, ::2]
    assert not x.is_contiguous()
    for g in ["tensor", "row", (1, 128), (128, 128)]:
        d1, s1 = distgemm.quantize_fp8(x, g)
        d2, s2 = distgemm.quantize_fp8(x.contiguous(), g)
        assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)
    d1, s1 = distgemm.quantize_fp8(x.t(), (1, 128), transpose=True)
    d2, s2 = distgemm.quantize_fp8(x.t().contiguous(), (1, 128), transpose=True)
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)


# ---------------------------------------------------------------- grouped, padded


def ragged(rows, groups, zero=(), generator=None):
    """Cumulative int32 ends of `groups` random group sizes summing to rows, `zero` empty."""
    w = torch.rand(groups, generator=generator)
    for g in zero:
        w[g] = 0
    counts = (w / w.sum() * rows).floor().long()
    counts[max(set(range(groups)) - set(zero))] += rows - counts.sum()
    return counts.cumsum(0).to(torch.int32)


def check_grouped(x, offs, dtype=torch.float8_e4m3fn):
    rows, cols = x.shape
    g = offs.numel()
    data, scale = distgemm.quantize_fp8(x, (1, 128), dtype=dtype, transpose=True, offs=offs)
    rp = 128 * ((rows + 127) // 128 + g)
    assert data.shape == (cols, rp) and data.is_contiguous() and data.dtype == dtype
    assert scale.shape == (cols, rp // 128) and scale.stride() == (1, cols)
    written = torch.zeros(rp, dtype=torch.bool)
    spans = group_spans(offs, rows)
    for (start, end, first), nxt in zip(spans, spans[1:] + [(None, None, rp // 128)]):
        n = end - start
        assert first + (n + 127) // 128 <= nxt[2]  # groups never overlap
        if n == 0:
            continue
        d, s = distgemm.quantize_fp8(x[start:end], (1, 128), dtype=dtype, transpose=True)
        cols_g = slice(128 * first, 128 * first + n)
        assert torch.equal(data[:, cols_g].view(torch.uint8), d.view(torch.uint8))
        assert torch.equal(scale[:, first:first + s.shape[1]], s)
        written[cols_g] = True
        assert_rounding_bound(x[start:end], data[:, cols_g], s, (1, 128), transpose=True)
    assert torch.all(data[:, ~written].view(torch.uint8) == 0)  # padding and empty groups: zeros
    used = written.reshape(-1, 128).any(1)
    assert torch.all(scale[:, ~used] == 1)
    return data, scale


@pytest.mark.parametrize("rows, groups, zero", [
    (1000, 8, ()), (777, 6, (0, 3, 5)), (128, 1, ()), (300, 4, (1, 2)), (4096, 3, (0, 1)),
    (0, 3, (0, 1, 2)), (50, 64, tuple(range(0, 64, 3))),
])
def test_grouped_padded_layout(rows, groups, zero):
    x = randx(rows, 72)
    offs = ragged(rows, groups, zero) if rows else torch.zeros(groups, dtype=torch.int32)
    check_grouped(x, offs)


def test_grouped_multiples_of_128_and_e5m2():
    x = randx(512, 40)
    check_grouped(x, torch.tensor([128, 256, 256, 512], dtype=torch.int32), torch.float8_e5m2)


def test_grouped_clamps_and_treats_decreasing_offsets_as_empty_groups():
    x = randx(300, 16)
    offs = torch.tensor([100, 50, 400, -7, 260], dtype=torch.int32)
    assert group_spans(offs, 300) == [(0, 100, 0), (100, 100, 1), (100, 300, 2), (300, 300, 5), (300, 300, 6)]
    check_grouped(x, offs)
    # the rows past the last end belong to no group
    data, _ = check_grouped(x, torch.tensor([10, 20], dtype=torch.int32))
    assert torch.all(data[:, 128 + 10 + 10:].view(torch.uint8) == 0)


def test_grouped_layout_is_what_the_reference_loop_writes():
    x = randx(333, 24)
    offs = ragged(333, 5, (2,))
    data, scale = distgemm.quantize_fp8(x, (1, 128), transpose=True, offs=offs)
    rd, rs = reference_quantize_fp8(x, (1, 128), transpose=True, offs=offs)
    assert torch.equal(data.view(torch.uint8), rd.view(torch.uint8)) and torch.equal(scale, rs)


# ---------------------------------------------------------------- errors


def bad_call(**overrides):
    args = dict(x=torch.randn(8, 16), granularity=(1, 128), dtype=torch.float8_e4m3fn, transpose=False,
                offs=None)
    args.update(overrides)
    x, g = args.pop("x"), args.pop("granularity")
    return distgemm.quantize_fp8(x, g, **args)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(x=[[1.0]]), TypeError, "x must be a torch.Tensor"),
    (dict(x=torch.randn(4, 4).double()), ValueError, "x must be bfloat16, float16 or float32"),
    (dict(x=torch.ones(4, 4, dtype=torch.int32)), ValueError, "x must be bfloat16, float16 or float32"),
    (dict(granularity="block"), ValueError, "granularity must be 'tensor', 'row', \\(1, 128\\) or \\(128, 128\\)"),
    (dict(granularity=(128, 1)), ValueError, "granularity must be"),
    (dict(granularity=128), TypeError, "granularity must be"),
    (dict(granularity=(True, 128)), TypeError, "granularity must be"),
    (dict(dtype=torch.bfloat16), ValueError, "dtype must be torch.float8_e4m3fn or torch.float8_e5m2"),
    (dict(dtype="e4m3"), TypeError, "dtype must be a torch.dtype"),
    (dict(transpose=1), TypeError, "transpose must be a bool"),
    (dict(x=torch.randn(16)), ValueError, "x must be 2-D"),
    (dict(x=torch.randn(2, 8, 16)), ValueError, r"3-D only with \(128, 128\)"),
    (dict(x=torch.randn(2, 2, 8, 16), granularity=(128, 128)), ValueError, "x must be 2-D .* or 3-D"),
    (dict(granularity="row", transpose=True), ValueError, r"transpose=True needs granularity \(1, 128\)"),
    (dict(offs=torch.tensor([8], dtype=torch.int32)), ValueError, "offs applies to transpose=True only"),
    (dict(transpose=True, offs=[8]), TypeError, "offs must be a torch.Tensor"),
    (dict(transpose=True, offs=torch.tensor([8])), ValueError, "offs must be a 1-D int32 tensor"),
    (dict(transpose=True, offs=torch.tensor([[8]], dtype=torch.int32)), ValueError, "offs must be a 1-D int32"),
    (dict(transpose=True, offs=torch.zeros(0, dtype=torch.int32)), ValueError, "at least one group end"),
    (dict(transpose=True, offs=torch.tensor([8], dtype=torch.int32, device="meta")), ValueError,
     "offs is on meta but x is on cpu"),
])
def test_bad_arguments_raise_naming_the_argument(overrides, error, match):
    with pytest.raises(error, match=match):
        bad_call(**overrides)


@pytest.mark.parametrize("code", [-1, 4, 2**40])
def test_op_called_directly_checks_its_arguments(code):
    with pytest.raises(ValueError, match="granularity must be 0 \\(tensor\\)"):
        torch.ops.distgemm.quantize_fp8(torch.randn(4, 4), code, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="transpose=True needs granularity"):
        torch.ops.distgemm.quantize_fp8(torch.randn(4, 4), 3, torch.float8_e4m3fn, True)


# ---------------------------------------------------------------- fake kernel, compile


CASES = [
    (dict(granularity="tensor"), (37, 300)),
    (dict(granularity="row"), (37, 300)),
    (dict(granularity=(1, 128)), (37, 300)),
    (dict(granularity=(128, 128)), (37, 300)),
    (dict(granularity=(128, 128)), (3, 37, 300)),
    (dict(granularity=(1, 128), transpose=True), (37, 300)),
    (dict(granularity=(1, 128), transpose=True, offs=[5, 5, 30]), (37, 300)),
]


@pytest.mark.parametrize("case, shape", CASES)
def test_fake_kernel_matches_shapes_and_strides(case, shape):
    case = dict(case)
    offs = case.pop("offs", None)
    g = case.pop("granularity")
    x = torch.randn(*shape)
    o = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    real = distgemm.quantize_fp8(x, g, offs=o, **case)
    meta = distgemm.quantize_fp8(x.to("meta"), g, offs=None if o is None else o.to("meta"), **case)
    for r, m in zip(real, meta):
        assert m.device.type == "meta"
        assert (r.shape, r.stride(), r.dtype) == (m.shape, m.stride(), m.dtype)


@pytest.mark.parametrize("case, shape", CASES)
def test_torch_compile_traces_quantize(case, shape):
    case = dict(case)
    offs = case.pop("offs", None)
    g = case.pop("granularity")
    x = torch.randn(*shape)
    o = None if offs is None else torch.tensor(offs, dtype=torch.int32)

    def f(x, o):
        data, scale = distgemm.quantize_fp8(x * 2, g, offs=o, **case)
        return data.float(), scale * 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(x, o), f(x, o)):
        assert torch.equal(a, b)


def test_not_differentiable_but_accepts_inputs_that_require_grad():
    x = torch.randn(8, 128, requires_grad=True)
    data, scale = distgemm.quantize_fp8(x, (1, 128))
    assert not data.requires_grad and not scale.requires_grad


@pytest.mark.parametrize("shape, quantized_as, read_as", [
    ((128, 256), (128, 128), (1, 128)),   # (1, 2) block scales broadcast over every row
    ((256, 256), (1, 128), (128, 128)),   # (256, 2) scales cut to the blocks' rows
    ((128, 256), "row", "tensor"),        # 128 row scales against 256 columns
    ((4, 384), (1, 128), "row"),
])
def test_dequantize_refuses_scales_of_another_granularity(shape, quantized_as, read_as):
    data, scale = distgemm.quantize_fp8(randx(*shape), quantized_as)
    with pytest.raises(ValueError, match="dequantize_fp8: scale must have shape"):
        dequantize_fp8(data, scale, read_as)


@pytest.mark.parametrize("shape, granularity, kwargs", [
    ((37, 300), "tensor", {}), ((37, 300), "row", {}), ((37, 300), (1, 128), {}),
    ((37, 300), (128, 128), {}), ((3, 37, 300), (128, 128), {}), ((37, 300), (1, 128), dict(transpose=True)),
])
def test_dequantize_takes_each_layout_quantize_gives(shape, granularity, kwargs):
    x = randx(*shape)
    data, scale = distgemm.quantize_fp8(x, granularity, **kwargs)
    assert_rounding_bound(x, data, scale, granularity, **kwargs)
