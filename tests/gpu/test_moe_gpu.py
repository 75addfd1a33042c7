"""The MoE expert MLP on one GPU: the fused activation + quantization kernel against the unfused
path (bit for bit), the weight kernel against quantize_fp8, and GroupedMLP / grouped_mlp
against an FP32 per-expert reference in bf16 and both FP8 recipes: odd token counts,
experts without tokens, 1 to 256 experts, biases, fused wgrad accumulation, CUDA-graph replay
with new routing and updated weights, torch.compile.

Bounds (norm-wise relative error against the FP32 reference): bf16 rounds h, the activation
and y once each (2^-8 each): 0.02. FP8 e4m3 keeps 3 mantissa bits: one rounding is off by at
most 2^-4 of the value and about 2^-4 / sqrt(3) = 3.6% on average; the output goes through four
quantized operands (x, fc1's weight, the activation, fc2's weight), whose independent errors
add in quadrature to about 7%: 0.10. A gradient goes through four more (the output gradient,
the transposed weights, the activation's gradient): 0.15; e5m2 gradients keep 2 bits: 0.25.
"""

import pytest
import torch

import distgemm
from distgemm import moe
from distgemm.nn import GroupedLinear, GroupedMLP
from tests.moe_reference import expert_mlp_reference, rel
from tests.reference import make_offs, random_counts

pytestmark = pytest.mark.gpu
DEV = "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OUT_BAND = {None: 0.02, "block": 0.10, "row": 0.10}
GRAD_BAND = {None: 0.03, "block": 0.15, "row": 0.15}


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t


# ---------------------------------------------------------------- the fused kernel


@pytest.mark.parametrize("kind, backward", [("identity", False), ("swiglu", False), ("gelu", False),
                                            ("swiglu", True), ("gelu", True)])
@pytest.mark.parametrize("counts, inner", [([300, 0, 129, 1], 256), ([0, 77], 200), ([1000], 136), ([5, 0, 0], 8)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_activation_kernel_matches_the_unfused_path_bit_for_bit(kind, backward, counts, inner, dtype):
    torch.manual_seed(0)
    offs = make_offs(counts)
    t = sum(counts)
    width = 2 * inner if kind == "swiglu" else inner
    x = (torch.randn(t, width, device=DEV) * 3).bfloat16()
    dy = (torch.randn(t, inner, device=DEV)).bfloat16() if backward else None
    rows = not (kind == "swiglu" and backward and inner % 128)
    out = moe.activation(x, kind, dy=dy, offs=offs, bf16=True, fp8_rows=rows, fp8_transposed=True, fp8_dtype=dtype)
    # The bf16 values: the FP32 formula rounded once (erf / exp may differ by an ulp of FP32).
    ref = moe._reference_values(x.cpu(), moe._BACKWARD[kind] if backward else moe._FORWARD[kind],
                                None if dy is None else dy.cpu(), inner)
    assert out.y.shape == ref.shape
    diff = (out.y.float().cpu() - ref.float()).abs()
    assert float((diff > ref.float().abs() * 2 ** -7 + 1e-30).float().mean()) == 0, "bf16 values off by > 1 ulp"
    # Every FP8 form is quantize_fp8 of the kernel's own bf16 values, bit for bit.
    if rows:
        r8, rs = distgemm.quantize_fp8(out.y, (1, 128), dtype=dtype)
        assert torch.equal(_bits(out.y_fp8), _bits(r8)) and torch.equal(out.y_scale, rs)
        assert out.y_scale.stride() == rs.stride()
    t8, ts = distgemm.quantize_fp8(out.y, (1, 128), dtype=dtype, transpose=True, offs=offs)
    assert torch.equal(_bits(out.yt_fp8), _bits(t8)) and torch.equal(out.yt_scale, ts)
    assert out.yt_scale.stride() == ts.stride()
    # Each form alone gives the same bits as all together.
    alone = moe.activation(x, kind, dy=dy, offs=offs, bf16=False, fp8_rows=False, fp8_transposed=True, fp8_dtype=dtype)
    assert alone.y is None and alone.y_fp8 is None and torch.equal(_bits(alone.yt_fp8), _bits(t8))


@pytest.mark.parametrize("kind, backward", [("identity", False), ("swiglu", True)])
@pytest.mark.parametrize("counts, inner", [
    ([20000, 0, 13333, 7001], 1024),             # more tiles than CTAs: each CTA walks several
    ([(g * 7) % 5 for g in range(1500)], 136),   # more experts than the ends held in shared memory
])
def test_activation_kernel_on_many_tiles_matches_the_unfused_path(kind, backward, counts, inner):
    torch.manual_seed(2)
    offs = make_offs(counts)
    t = sum(counts)
    x = torch.randn(t, 2 * inner if kind == "swiglu" else inner, device=DEV).bfloat16()
    dy = torch.randn(t, inner, device=DEV).bfloat16() if backward else None
    out = moe.activation(x, kind, dy=dy, offs=offs, bf16=True, fp8_rows=True, fp8_transposed=True)
    r8, rs = distgemm.quantize_fp8(out.y, (1, 128))
    assert torch.equal(_bits(out.y_fp8), _bits(r8)) and torch.equal(out.y_scale, rs)
    t8, ts = distgemm.quantize_fp8(out.y, (1, 128), transpose=True, offs=offs)
    assert torch.equal(_bits(out.yt_fp8), _bits(t8)) and torch.equal(out.yt_scale, ts)
    if kind == "identity":
        assert torch.equal(out.y, x)


def _two_bytes_past_16(t):
    """A contiguous copy of t whose data starts 2 bytes past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    out = buf[1:1 + t.numel()].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 == 2 and out.is_contiguous()
    return out


@pytest.mark.parametrize("kind, backward", [("identity", False), ("swiglu", False), ("gelu", False),
                                            ("swiglu", True), ("gelu", True)])
@pytest.mark.parametrize("inner", [136, 100])
def test_activation_kernel_on_unaligned_inputs_matches_the_aligned_path(kind, backward, inner):
    """x (and dy) 2 bytes past a 16-byte boundary, or a width not a multiple of 8, take the
    one-shot kernel (element loads) rather than the pipelined one: the same bits as the
    pipelined kernel on aligned copies (inner 136), every FP8 form quantize_fp8's of the bf16
    values, and the rows past offs[-1] in y and y_fp8 but not in the transposed copy."""
    torch.manual_seed(3)
    offs = make_offs([300, 0, 129])
    t = 300 + 129 + 5  # 5 rows past offs[-1]
    width = 2 * inner if kind == "swiglu" else inner
    x = (torch.randn(t, width, device=DEV) * 3).bfloat16()
    dy = torch.randn(t, inner, device=DEV).bfloat16() if backward else None
    rows = not (kind == "swiglu" and backward and inner % 128)
    kw = dict(offs=offs, bf16=True, fp8_rows=rows, fp8_transposed=True)
    aligned = moe.activation(x, kind, dy=dy, **kw)
    out = moe.activation(_two_bytes_past_16(x), kind, dy=None if dy is None else _two_bytes_past_16(dy), **kw)
    for got, want in zip(out, aligned):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(_bits(got), _bits(want))
    ref = moe._reference_values(x.cpu(), moe._BACKWARD[kind] if backward else moe._FORWARD[kind],
                                None if dy is None else dy.cpu(), inner)
    diff = (out.y.float().cpu() - ref.float()).abs()
    assert float((diff > ref.float().abs() * 2 ** -7 + 1e-30).float().mean()) == 0, "bf16 values off by > 1 ulp"
    if rows:
        r8, rs = distgemm.quantize_fp8(out.y, (1, 128))
        assert torch.equal(_bits(out.y_fp8), _bits(r8)) and torch.equal(out.y_scale, rs)
    t8, ts = distgemm.quantize_fp8(out.y, (1, 128), transpose=True, offs=offs)
    assert torch.equal(_bits(out.yt_fp8), _bits(t8)) and torch.equal(out.yt_scale, ts)


def test_activation_kernel_zero_fills_the_padding():
    counts = [130, 0, 7]  # T = 137, padded blocks: expert 0 from 0, expert 2 from 2 + 130 // 128 = 3
    offs = make_offs(counts)
    x = torch.randn(sum(counts), 2 * 256, device=DEV).bfloat16()
    out = moe.activation(x, "swiglu", offs=offs, bf16=True, fp8_rows=True, fp8_transposed=True)
    assert out.yt_fp8.shape == (256, 128 * (2 + 3))
    used = torch.zeros(out.yt_fp8.shape[1], dtype=torch.bool)
    used[0:130] = True
    used[384:391] = True
    assert torch.all(out.yt_fp8.view(torch.uint8).cpu()[:, ~used] == 0)
    blocks_used = torch.tensor([True, True, False, True, False])
    assert torch.all(out.yt_scale.cpu()[:, ~blocks_used] == 1)


def test_weight_kernel_matches_quantize_fp8():
    torch.manual_seed(1)
    # (8, 1024, 2048): more blocks than CTAs; 144 rows: a transposed row ends mid-vector.
    for shape in [(3, 256, 384), (2, 200, 72), (1, 1, 130), (8, 1024, 2048), (2, 144, 256)]:
        w = torch.randn(*shape, device=DEV).bfloat16()
        w8, sw, wt8, swt = moe.quantize_weight(w, "block")
        r8, rs = distgemm.quantize_fp8(w, (128, 128))
        assert torch.equal(_bits(w8), _bits(r8)) and torch.equal(sw, rs) and swt is sw
        assert torch.equal(_bits(wt8), _bits(r8.transpose(1, 2).contiguous()))


@pytest.mark.parametrize("w_dtype, offset", [(torch.float32, False), (torch.float16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_weight_kernel_on_other_inputs_matches_quantize_fp8(w_dtype, offset, dtype):
    """float32 and float16 weights, and bf16 ones 2 bytes past a 16-byte boundary, take the
    one-shot weight kernel: both copies quantize_fp8's (128, 128) bits, also with the dgrad
    copy alone; 144 rows: the transposed rows' vector stores end mid-block, 200: element stores."""
    torch.manual_seed(4)
    for shape in [(3, 256, 384), (2, 200, 72), (2, 144, 256), (1, 1, 130)]:
        w = (torch.randn(*shape, device=DEV) * 5).to(w_dtype)
        if offset:
            w = _two_bytes_past_16(w)
        w8, sw, wt8, swt = moe.quantize_weight(w, "block", dtype=dtype)
        r8, rs = distgemm.quantize_fp8(w.contiguous(), (128, 128), dtype=dtype)
        assert torch.equal(_bits(w8), _bits(r8)) and torch.equal(sw, rs) and swt is sw
        assert torch.equal(_bits(wt8), _bits(r8.transpose(1, 2).contiguous()))
        _, _, wt8_alone, swt_alone = moe.quantize_weight(w, "block", copies="dgrad", dtype=dtype)
        assert torch.equal(_bits(wt8_alone), _bits(wt8)) and torch.equal(swt_alone, rs)


def _same_bits(a, b):
    """Equal shapes and bits (FP32 scales by their bits, so that NaN scales compare)."""
    view = {torch.float32: torch.int32}
    return a.shape == b.shape and torch.equal(_bits(a).view(view.get(a.dtype, _bits(a).dtype)),
                                              _bits(b).view(view.get(b.dtype, _bits(b).dtype)))


def _row_copies_reference(w, dtype):
    """The row recipe's two copies as quantize_fp8 makes them: w per row, w's transpose per row."""
    g, n, k = w.shape
    r8, rs = distgemm.quantize_fp8(w.reshape(g * n, k).contiguous(), "row", dtype=dtype)
    t8, ts = distgemm.quantize_fp8(w.transpose(1, 2).reshape(g * k, n), "row", dtype=dtype)
    return r8.view(g, n, k), rs.view(g, n), t8.view(g, k, n), ts.view(g, k)


# (experts, N, K): 144 rows (transposed rows end mid-vector), 272 / 200 / 13 columns (a strip of
# 64 ends early; 13: no vector loads), one row, one column, no rows, no columns, 300 experts of a
# few rows (more strips than CTAs: the grid strides), 4,100 rows (32 staged tiles).
ROW_WEIGHT_SHAPES = [(1, 144, 272), (9, 144, 272), (17, 200, 200), (3, 13, 13), (2, 1, 130), (2, 130, 1),
                     (2, 0, 64), (2, 64, 0), (300, 16, 256), (1, 4100, 96)]


@pytest.mark.parametrize("shape", ROW_WEIGHT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_row_weight_copies_match_quantize_fp8(shape):
    """The row recipe's copies: the forward's per output channel, the dgrad's per output channel
    of the transpose (w's columns, the transpose never formed), bit for bit quantize_fp8's;
    each copy alone the same bits."""
    torch.manual_seed(sum(shape))
    g, n, k = shape
    w = (torch.randn(g, n, k, device=DEV) * torch.rand(g, 1, k, device=DEV) * 10).bfloat16()
    got = moe.quantize_weight(w, "row")
    want = _row_copies_reference(w, E4M3)
    for name, a, b in zip(("w8", "scale", "wt8", "scale_t"), got, want):
        assert _same_bits(a, b), name
    fwd, dgrad = moe.quantize_weight(w, "row", copies="forward"), moe.quantize_weight(w, "row", copies="dgrad")
    assert fwd[2] is None and fwd[3] is None and dgrad[0] is None and dgrad[1] is None
    assert _same_bits(fwd[0], want[0]) and _same_bits(fwd[1], want[1])
    assert _same_bits(dgrad[2], want[2]) and _same_bits(dgrad[3], want[3])


@pytest.mark.parametrize("w_dtype, offset", [(torch.float32, False), (torch.float16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_row_weight_copies_on_other_inputs_match_quantize_fp8(w_dtype, offset, dtype):
    """float32 / float16 weights and a bf16 one 2 bytes past a 16-byte boundary (element loads),
    e5m2, and columns holding zeros, a tiny amax (scales outside the fast quotient's range), inf
    and NaN: both row copies quantize_fp8's bits."""
    torch.manual_seed(7)
    for shape in [(3, 144, 264), (2, 200, 72), (1, 33, 130)]:
        w = (torch.randn(*shape, device=DEV) * 5).to(w_dtype)
        w[:, :, 0] = 0  # a column of zeros: scale 1
        w[:, :, 1] *= 1e-30 if w_dtype == torch.float32 else 1e-6
        w[0, 3, 2] = float("inf")
        w[-1, 5, 3] = float("nan")
        if offset:
            w = _two_bytes_past_16(w)
        got = moe.quantize_weight(w, "row", dtype=dtype)
        want = _row_copies_reference(w, dtype)
        for name, a, b in zip(("w8", "scale", "wt8", "scale_t"), got, want):
            assert _same_bits(a, b), (shape, name)


def test_row_dgrad_copy_holds_no_transposed_bf16_weight():
    """The dgrad copy is made without a transposed bf16 copy of w: what it allocates is the FP8
    copy and its scales, nothing as large as w."""
    w = torch.randn(8, 1024, 2048, device=DEV).bfloat16()
    moe.quantize_weight(w, "row", copies="dgrad")  # warm up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = moe.quantize_weight(w, "row", copies="dgrad")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= w.numel() + 8 * 2048 * 4 + 2 ** 20, extra  # FP8 copy + scales (+ allocator rounding)
    del out


def test_activation_refuses_bad_arguments():
    x = torch.randn(4, 6, device=DEV).bfloat16()
    with pytest.raises(ValueError, match="activation must be"):
        moe.activation(x, "relu")
    with pytest.raises(ValueError, match="offs"):
        moe.activation(x, "gelu", fp8_transposed=True)
    with pytest.raises(ValueError, match="bfloat16"):
        moe.activation(x.float(), "gelu")
    with pytest.raises(ValueError, match="dy must be"):
        moe.activation(x, "gelu", dy=torch.randn(4, 5, device=DEV).bfloat16())


# ---------------------------------------------------------------- the layer


def _layer_case(counts, hidden, ffn, kind, fp8, bias=False, fuse=False, grad_dtype=E4M3, seed=0, overwrite=False):
    torch.manual_seed(seed)
    offs = make_offs(counts)
    g, t = len(counts), sum(counts)
    layer = GroupedMLP(g, hidden, ffn, activation=kind, bias=bias, device=DEV, fp8=fp8,
                       fuse_wgrad_accumulation=fuse, fp8_grad_dtype=grad_dtype)
    if fuse:
        for w in (layer.fc1_weight, layer.fc2_weight):  # overwrite_main_grad: written, never read
            w.main_grad = torch.full(w.shape, float("nan") if overwrite else 0.0, device=DEV)
            w.overwrite_main_grad = overwrite
    x = torch.randn(t, hidden, device=DEV).bfloat16().requires_grad_()
    dy = torch.randn(t, hidden, device=DEV).bfloat16()
    y = layer(x, offs)
    y.backward(dy)
    params = [layer.fc1_weight, layer.fc2_weight] + ([layer.fc1_bias, layer.fc2_bias] if bias else [])
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    xr = x.detach().clone().requires_grad_()
    yr = expert_mlp_reference(xr, counts, *ref_params[:2], kind, *(ref_params[2:] if bias else ()))
    yr.backward(dy.float())
    grads = [p.main_grad if fuse and i < 2 else p.grad for i, p in enumerate(params)]
    return y, yr, x.grad, xr.grad, grads, [p.grad for p in ref_params]


@pytest.mark.parametrize("fp8", [None, "block", "row"])
@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
@pytest.mark.parametrize("counts, hidden, ffn", [
    ([300, 0, 129, 1000], 256, 384),      # odd counts, an expert without tokens
    ([1] * 7 + [0], 512, 256),            # one token per expert
    ([200, 56], 384, 208),                # ffn not a multiple of 128 (FP8 GEMMs need K % 16 == 0)
])
def test_grouped_mlp_matches_fp32_reference(fp8, kind, counts, hidden, ffn):
    y, yr, dx, dxr, grads, ref_grads = _layer_case(counts, hidden, ffn, kind, fp8, fuse=fp8 is not None)
    assert y.dtype == torch.bfloat16 and y.shape == yr.shape
    err = rel(y, yr)
    assert err < OUT_BAND[fp8], f"output: relative error {err:.4f}"
    for name, a, b in [("dx", dx, dxr), ("fc1", grads[0], ref_grads[0]), ("fc2", grads[1], ref_grads[1])]:
        e = rel(a, b)
        assert e < GRAD_BAND[fp8], f"{name}: relative error {e:.4f}"
    for g, n in enumerate(counts):
        if n == 0:
            assert torch.all(grads[0][g] == 0) and torch.all(grads[1][g] == 0), "an expert without tokens got a gradient"


@pytest.mark.parametrize("fp8", [None, "block", "row"])
def test_overwrite_main_grad_writes_every_expert(fp8):
    """overwrite_main_grad (TransformerEngine's flag): main_grad, NaN before the step, holds the
    weight gradients after it; the expert without tokens holds zeros."""
    counts = [300, 0, 129, 1000]
    _, _, _, _, grads, ref_grads = _layer_case(counts, 256, 384, "swiglu", fp8, fuse=True, overwrite=True)
    for name, a, b in [("fc1", grads[0], ref_grads[0]), ("fc2", grads[1], ref_grads[1])]:
        assert torch.isfinite(a).all(), f"{name}: main_grad kept values from before the step"
        e = rel(a, b)
        assert e < GRAD_BAND[fp8], f"{name}: relative error {e:.4f}"
        assert torch.all(a[1] == 0), f"{name}: the expert without tokens"


@pytest.mark.parametrize("fp8", [None, "block"])
def test_grouped_mlp_with_bias_and_e5m2_gradients(fp8):
    counts = [100, 0, 300]
    y, yr, dx, dxr, grads, ref_grads = _layer_case(counts, 256, 256, "swiglu", fp8, bias=True, grad_dtype=E5M2)
    assert rel(y, yr) < OUT_BAND[fp8]
    band = 0.25 if fp8 else GRAD_BAND[None]
    for name, a, b in zip(("fc1", "fc2", "fc1_bias", "fc2_bias"), grads, ref_grads):
        assert rel(a, b) < band, f"{name}: relative error {rel(a, b):.4f}"
    assert rel(dx, dxr) < band


@pytest.mark.parametrize("experts", [1, 64, 256])
def test_grouped_mlp_many_experts(experts):
    counts = random_counts(experts, 4 * experts + 37, zero_groups=(0,) if experts > 1 else ())
    y, yr, dx, dxr, grads, ref_grads = _layer_case(counts, 128, 128, "swiglu", "block", fuse=True)
    assert rel(y, yr) < OUT_BAND["block"] and rel(dx, dxr) < GRAD_BAND["block"]


def test_grouped_mlp_with_no_tokens():
    y, yr, dx, dxr, grads, _ = _layer_case([0, 0, 0], 256, 128, "swiglu", "block", fuse=True)
    assert y.shape == (0, 256) and dx.shape == (0, 256)
    assert torch.all(grads[0] == 0) and torch.all(grads[1] == 0)


@pytest.mark.parametrize("fp8", [None, "block"])
def test_graph_replay_takes_new_routing_and_updated_weights(fp8):
    torch.manual_seed(4)
    g, hidden, ffn, t = 4, 256, 256, 700
    layer = GroupedMLP(g, hidden, ffn, device=DEV, fp8=fp8)
    x = torch.randn(t, hidden, device=DEV).bfloat16()
    offs = make_offs([300, 100, 0, 300])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            layer(x, offs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = layer(x, offs)
    for counts in ([0, 700, 0, 0], [1, 2, 3, 694]):
        offs.copy_(make_offs(counts))
        with torch.no_grad():
            layer.fc2_weight.mul_(2.0)            # an optimizer's in-place update
            layer.fc1_weight.data.mul_(0.5)       # and one through .data (no version bump)
        graph.replay()
        torch.cuda.synchronize()
        ref = expert_mlp_reference(x, counts, layer.fc1_weight.detach(), layer.fc2_weight.detach(), "swiglu")
        assert rel(y, ref) < OUT_BAND[fp8], f"replay with routing {counts}: {rel(y, ref):.4f}"


@pytest.mark.parametrize("recipe", ["block", "row"])
def test_fp8_grouped_linear_sees_every_weight_update(recipe):
    torch.manual_seed(5)
    counts = [300, 0, 212, 512]
    offs = make_offs(counts)
    layer = GroupedLinear(4, 1024, 512, device=DEV, fp8=recipe)
    x = torch.randn(sum(counts), 1024, device=DEV).bfloat16()

    bounds = list(zip([0] + torch.tensor(counts).cumsum(0).tolist()[:-1], torch.tensor(counts).cumsum(0).tolist()))

    def err():
        y = layer(x, offs)
        w = layer.weight.detach().float()
        return rel(y, torch.cat([x[s:e].float() @ w[g].T for g, (s, e) in enumerate(bounds)]))

    assert err() < 0.08
    with torch.no_grad():
        layer.weight.mul_(2.0)
    assert err() < 0.08, "in-place update under no_grad"
    layer.weight.data.mul_(2.0)
    assert err() < 0.08, "update through .data"
    layer(x, offs, is_first_microbatch=True)
    layer.weight.data.mul_(2.0)
    # The caller promised the weight did not change: the copies are reused (documented contract).
    y = layer(x, offs, is_first_microbatch=False)
    assert rel(y, layer(x, offs)) > 0.3
    # Captured, then updated in place: the replay quantizes the weight as it is then.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x, offs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        yg = layer(x, offs, is_first_microbatch=False)
    with torch.no_grad():
        layer.weight.mul_(0.25)
    graph.replay()
    torch.cuda.synchronize()
    ref = layer(x, offs)
    assert rel(yg, ref) < 0.08, "graph replay after an in-place update"


def test_grouped_mlp_under_torch_compile():
    torch.manual_seed(6)
    counts = [130, 0, 250]
    offs = make_offs(counts)
    layer = GroupedMLP(3, 256, 256, device=DEV, fp8="block")
    x = torch.randn(sum(counts), 256, device=DEV).bfloat16().requires_grad_()
    compiled = torch.compile(layer)
    y = compiled(x, offs)
    y.float().square().sum().backward()
    ref = expert_mlp_reference(x.detach(), counts, layer.fc1_weight.detach(), layer.fc2_weight.detach(), "swiglu")
    assert rel(y, ref) < OUT_BAND["block"]
    assert x.grad is not None and layer.fc1_weight.grad is not None and torch.isfinite(layer.fc1_weight.grad).all()


@pytest.mark.parametrize("fp8", [None, "block"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_compiled_grouped_mlp_writes_main_grad_as_eager_does(fp8, overwrite):
    """fullgraph=True with fused wgrads into main_grad (added to, or written with
    overwrite_main_grad): the compiled step leaves main_grad as the eager step does."""
    torch.manual_seed(7)
    offs = make_offs([130, 0, 250])
    layer = GroupedMLP(3, 256, 256, device=DEV, fp8=fp8, fuse_wgrad_accumulation=True)
    weights = (layer.fc1_weight, layer.fc2_weight)
    for w in weights:
        w.main_grad, w.overwrite_main_grad = torch.ones(w.shape, device=DEV), overwrite
    x = torch.randn(380, 256, device=DEV).bfloat16()
    layer(x, offs).float().square().sum().backward()
    want = [w.main_grad.clone() for w in weights]
    for w in weights:
        w.main_grad.fill_(1.0)
    # bf16 traces whole (as on the CPU); the FP8 step may break its graph around the weight copies
    torch.compile(layer, fullgraph=fp8 is None)(x, offs).float().square().sum().backward()
    for w, ref in zip(weights, want):  # the same kernels; a tile chosen otherwise sums in another order
        assert rel(w.main_grad, ref) < 1e-3
    torch._dynamo.reset()


def test_grouped_mlp_training_tracks_bf16():
    """A toy regression trained 40 steps: the FP8 layer's loss stays within 2% of bf16's start."""
    counts = random_counts(8, 4096, zero_groups=(3,))
    offs = make_offs(counts)
    losses = {}
    for fp8 in (None, "block"):
        torch.manual_seed(7)
        layer = GroupedMLP(8, 256, 256, device=DEV, fp8=fp8)
        opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
        gen = torch.Generator(device=DEV).manual_seed(8)
        x = torch.randn(4096, 256, device=DEV, generator=gen).bfloat16()
        target = torch.tanh(x.float() @ (torch.randn(256, 256, device=DEV, generator=gen) / 16))
        run = []
        for _ in range(40):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(layer(x, offs).float(), target)
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses[fp8] = run
    bf16, fp8 = losses[None], losses["block"]
    assert bf16[-1] < 0.8 * bf16[0], f"bf16 did not train: {bf16[0]:.4f} -> {bf16[-1]:.4f}"
    gap = max(abs(a - b) for a, b in zip(bf16, fp8)) / bf16[0]
    assert gap < 0.02, f"FP8 loss left the band: {gap:.4f} of the starting loss"


@pytest.mark.parametrize("fp8", ["block", "row"])
def test_save_original_input_gives_the_same_gradients_and_frees_memory(fp8):
    """Keeping x and making its FP8 transposed copy in the backward: bit-identical gradients,
    and the training step (wgrads accumulated into main_grad) holds less at its peak. Without
    fused accumulation the peak is fc1's wgrad output, where both ways hold the copy (the CPU
    memory model, tests/memory_model.py, shows both)."""
    counts = random_counts(8, 4096, zero_groups=(5,))
    offs = make_offs(counts)
    gen = torch.Generator(device=DEV).manual_seed(11)
    x = torch.randn(sum(counts), 1024, device=DEV, generator=gen).bfloat16()
    dy = torch.randn(sum(counts), 1024, device=DEV, generator=gen).bfloat16()
    grads, peaks = [], []
    for save in (False, True):
        torch.manual_seed(12)
        layer = GroupedMLP(8, 1024, 512, device=DEV, fp8=fp8, save_original_input=save,
                           fuse_wgrad_accumulation=True)
        params = (layer.fc1_weight, layer.fc2_weight)
        for p in params:
            p.main_grad = torch.zeros(p.shape, device=DEV)
        xi = x.clone().requires_grad_()
        layer(xi, offs).backward(dy)  # warm-up (autotuning, workspaces)
        xi.grad = None
        for p in params:
            p.main_grad.zero_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        layer(xi, offs).backward(dy)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        grads.append((xi.grad, *(p.main_grad for p in params)))
        assert torch.equal(xi.detach(), x)
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert peaks[1] < peaks[0], f"peak {peaks[1]} bytes with save_original_input, {peaks[0]} without"


@pytest.mark.parametrize("fp8", [None, "block"])
def test_biases_and_weights_leave_out_rows_past_the_last_expert(fp8):
    """Rows past offs[-1] (dropped copies) belong to no expert: the GEMMs leave them unwritten
    (the allocator's NaN-filled memory here), and no parameter gradient may see them. The same
    as the layer run on the routed rows only (up to the order of index_add's atomics and the
    tiles the autotuner picks for the other token count)."""
    counts = random_counts(6, 900, zero_groups=(2,))
    offs = make_offs(counts)
    routed, tokens, hidden, ffn = sum(counts), sum(counts) + 77, 256, 384
    gen = torch.Generator(device=DEV).manual_seed(21)
    x = torch.randn(tokens, hidden, device=DEV, generator=gen).bfloat16()
    dy = torch.randn(tokens, hidden, device=DEV, generator=gen).bfloat16()
    grads = []
    for rows in (tokens, routed):
        torch.manual_seed(22)
        layer = GroupedMLP(6, hidden, ffn, bias=True, device=DEV, fp8=fp8)
        torch.empty(256 << 20, device=DEV).fill_(float("nan"))  # freed into the cache the outputs come from
        xi = x[:rows].clone().requires_grad_()
        layer(xi, offs).backward(dy[:rows])
        grads.append([p.grad for p in layer.parameters()] + [xi.grad[:routed]])
    for a, b in zip(*grads):
        assert torch.isfinite(a).all()
        assert rel(a, b) < 1e-2, rel(a, b)
