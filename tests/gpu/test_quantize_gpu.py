"""FP8 quantization kernels on one GPU against the plain-PyTorch reference (run on the CPU),
bit for bit (data and scales), with their strides: every granularity, both FP8 dtypes, every
input dtype, odd shapes (rows and columns off multiples of 128, columns off multiples of 8,
which take the unvectorized path), misaligned inputs, 3-D weights, the transposed layout with and
without ragged group offsets (empty groups, out-of-range and decreasing ends), zero and NaN blocks,
non-contiguous input, CUDA-graph replay with new offsets, and torch.compile."""

import pytest
import torch

import distgemm
from distgemm.quantize import reference_quantize_fp8

pytestmark = pytest.mark.gpu
DEV = "cuda"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
INPUTS = [torch.bfloat16, torch.float16, torch.float32]


def randx(*shape, dtype=torch.bfloat16, device=DEV):
    """Values over several orders of magnitude, finite in float16."""
    x = torch.randn(*shape, device=device)
    if x.dim() >= 2 and x.shape[-1] > 1:
        x = x * torch.logspace(-2, 2, x.shape[-1], device=device)
    return x.to(dtype)


def ragged(rows, groups, zero=()):
    w = torch.rand(groups)
    for g in zero:
        w[g] = 0
    counts = (w / w.sum() * rows).floor().long()
    counts[max(set(range(groups)) - set(zero))] += rows - counts.sum()
    return counts.cumsum(0).to(torch.int32).to(DEV)


def strides(t):
    """t's strides where they mean something: dimensions of size 1 have none."""
    return tuple(st for st, n in zip(t.stride(), t.shape) if n > 1)


def check(x, granularity, dtype=torch.float8_e4m3fn, transpose=False, offs=None):
    """The kernel's (data, scale) equal the CPU reference's bits, shapes and strides."""
    data, scale = distgemm.quantize_fp8(x, granularity, dtype=dtype, transpose=transpose, offs=offs)
    torch.cuda.synchronize()
    rd, rs = reference_quantize_fp8(x.cpu().contiguous(), granularity, dtype, transpose,
                                    None if offs is None else offs.cpu())
    assert data.is_cuda and scale.is_cuda
    assert (data.shape, strides(data), data.dtype) == (rd.shape, strides(rd), rd.dtype)
    assert (scale.shape, strides(scale), scale.dtype) == (rs.shape, strides(rs), rs.dtype)
    got_d, want_d = data.cpu().view(torch.uint8), rd.view(torch.uint8)
    if not torch.equal(got_d, want_d):
        bad = (got_d != want_d).nonzero()
        raise AssertionError(f"{len(bad)} data bytes differ, first at {bad[0].tolist()}")
    got_s, want_s = scale.cpu().view(torch.int32), rs.view(torch.int32)
    if not torch.equal(got_s, want_s):
        bad = (got_s != want_s).nonzero()
        raise AssertionError(f"{len(bad)} scales differ, first at {bad[0].tolist()}")
    return data, scale


SHAPES = [(1, 1), (7, 129), (128, 128), (300, 1000), (257, 4100), (513, 2048), (64, 20000)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", INPUTS, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128), (128, 128)], ids=str)
def test_equals_reference(granularity, in_dtype, dtype, shape):
    check(randx(*shape, dtype=in_dtype), granularity, dtype)


@pytest.mark.parametrize("shape", [(300, 70), (129, 3), (4096, 136), (1000, 1000), (1, 8), (2, 200)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", INPUTS, ids=["bf16", "fp16", "fp32"])
def test_transposed_equals_reference(in_dtype, dtype, shape):
    check(randx(*shape, dtype=in_dtype), (1, 128), dtype, transpose=True)


@pytest.mark.parametrize("batch, rows, cols", [(4, 300, 260), (2, 128, 256), (3, 1, 1), (8, 129, 7)])
@pytest.mark.parametrize("in_dtype", INPUTS, ids=["bf16", "fp16", "fp32"])
def test_weights_3d(in_dtype, batch, rows, cols):
    check(randx(batch, rows, cols, dtype=in_dtype), (128, 128))


GROUPED = {
    "random": (1000, 8, ()),
    "zero_groups": (777, 6, (0, 3, 5)),
    "one_group": (333, 1, ()),
    "many_small": (2000, 300, tuple(range(0, 300, 7))),
    "long": (8192, 4, (1,)),
}


@pytest.mark.parametrize("case", list(GROUPED))
@pytest.mark.parametrize("cols", [72, 1000, 2048])
@pytest.mark.parametrize("in_dtype", INPUTS, ids=["bf16", "fp16", "fp32"])
def test_grouped_transposed_equals_reference(case, cols, in_dtype):
    rows, groups, zero = GROUPED[case]
    for dtype in FP8:
        check(randx(rows, cols, dtype=in_dtype), (1, 128), dtype, transpose=True, offs=ragged(rows, groups, zero))


@pytest.mark.parametrize("offs", [[100, 50, 400, -7, 260], [0, 0, 0], [300], [2**31 - 1, 5], [-1, 128, 256]])
def test_grouped_bad_offsets_stay_in_bounds_and_match(offs):
    x = randx(300, 136)
    check(x, (1, 128), transpose=True, offs=torch.tensor(offs, dtype=torch.int32, device=DEV))


def test_grouped_no_rows():
    data, scale = check(torch.empty(0, 64, device=DEV, dtype=torch.bfloat16), (1, 128), transpose=True,
                        offs=torch.zeros(3, dtype=torch.int32, device=DEV))
    assert data.shape == (64, 384) and torch.all(scale == 1)


@pytest.mark.parametrize("granularity", ["tensor", "row", (1, 128), (128, 128)], ids=str)
def test_zero_blocks_and_empty_inputs(granularity):
    x = torch.zeros(300, 260, dtype=torch.bfloat16, device=DEV)
    x[200:, 200:] = torch.randn(100, 60, device=DEV).bfloat16()
    check(x, granularity)
    check(torch.zeros(0, 5, device=DEV), granularity)
    check(torch.zeros(5, 0, device=DEV), granularity)


def test_misaligned_inputs_take_the_scalar_path():
    for in_dtype in INPUTS:
        for shape in [(37, 256), (300, 1000)]:
            n = shape[0] * shape[1]
            x = randx(n + 1, dtype=in_dtype)[1:].view(*shape)  # contiguous, 2 or 4 bytes off 16
            assert x.is_contiguous() and x.data_ptr() % 16
            for g in ["tensor", "row", (1, 128), (128, 128)]:
                check(x, g)
            check(x, (1, 128), transpose=True)
            check(x, (1, 128), transpose=True, offs=ragged(shape[0], 3, (1,)))


def test_non_contiguous_input():
    base = randx(600, 520)
    for x in (base[::2], base[:, ::2], base.t()):
        for g in ["tensor", "row", (1, 128), (128, 128)]:
            check(x, g)
        check(x, (1, 128), transpose=True, offs=ragged(x.shape[0], 4, (2,)))


def test_large_tensor_and_rows_past_the_register_cache():
    check(randx(4099, 4097), "tensor")         # many CTAs reduce into one amax
    check(randx(3, 3_000_001), "row")           # rows read twice (beyond 8192 elements)
    check(randx(5, 9000, dtype=torch.float32), "row", torch.float8_e5m2)


def test_nan_poisons_its_block_only():
    x = randx(256, 256)
    x[3, 200] = float("nan")
    data, scale = distgemm.quantize_fp8(x, (1, 128))
    assert torch.isnan(scale[3, 1]) and torch.isnan(data[3, 128:].float()).all()
    assert torch.isfinite(scale[3, 0]) and torch.isfinite(scale[:3]).all() and torch.isfinite(scale[4:]).all()
    data, scale = distgemm.quantize_fp8(x, "tensor")
    assert torch.isnan(scale)


def test_cuda_graph_replay_with_new_offsets_and_inputs():
    rows, cols, groups = 2048, 512, 8
    x = randx(rows, cols)
    offs = ragged(rows, groups)
    distgemm.quantize_fp8(x, (1, 128), transpose=True, offs=offs)  # warm-up
    distgemm.quantize_fp8(x, "tensor")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        data, scale = distgemm.quantize_fp8(x, (1, 128), transpose=True, offs=offs)
        tdata, tscale = distgemm.quantize_fp8(x, "tensor")
    for step in range(4):
        offs.copy_(ragged(rows, groups, (step, step + 3)))
        x.copy_(randx(rows, cols) * (step + 1))
        graph.replay()
        torch.cuda.synchronize()
        rd, rs = reference_quantize_fp8(x.cpu(), (1, 128), torch.float8_e4m3fn, True, offs.cpu())
        assert torch.equal(data.cpu().view(torch.uint8), rd.view(torch.uint8))
        assert torch.equal(scale.cpu(), rs)
        rd, rs = reference_quantize_fp8(x.cpu(), "tensor")
        assert torch.equal(tdata.cpu().view(torch.uint8), rd.view(torch.uint8)) and torch.equal(tscale.cpu(), rs)


def test_torch_compile_fullgraph():
    x = randx(300, 520)
    offs = ragged(300, 4, (1,))

    def f(x, offs):
        a = distgemm.quantize_fp8(x * 2, (1, 128))
        b = distgemm.quantize_fp8(x, (1, 128), transpose=True, offs=offs)
        c = distgemm.quantize_fp8(x, (128, 128), dtype=torch.float8_e5m2)
        return [t.view(torch.uint8) if t.dtype != torch.float32 else t for pair in (a, b, c) for t in pair]

    compiled = torch.compile(f, fullgraph=True)
    for got, want in zip(compiled(x, offs), f(x, offs)):
        assert torch.equal(got, want)
