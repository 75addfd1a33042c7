"""The permute fused with the FP8 quantization, and the layer that gathers its rows as it reads
them (grouped_mlp / GroupedMLP with routing, MoEExperts), on the CPU's reference paths: each
equals the unfused composition (gather, then quantize; permute, then the layer), forward and
backward. tests/gpu/test_moe_routing_gpu.py checks dg_moe_permute against the same
compositions on the GPU."""

import pytest
import torch

from distgemm import moe, quantize_fp8
from distgemm.nn import GroupedMLP

E4M3 = torch.float8_e4m3fn


def _ids(tokens, k, experts, drop, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(experts, (tokens, k), generator=gen)
    ids[torch.rand(tokens, k, generator=gen) < drop] = -1
    return ids


def _bits(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t


@pytest.mark.parametrize("tokens, hidden", [(13, 200), (1, 128), (130, 64)])
def test_activation_with_rows_is_the_activation_of_the_gathered_rows(tokens, hidden):
    x = torch.randn(tokens, hidden).bfloat16()
    rows = torch.tensor([tokens - 1, -1, 0, 0, tokens // 2, -1, 1 % tokens] * 3, dtype=torch.int64)
    offs = torch.tensor([5, 5, 17, rows.numel()], dtype=torch.int32)
    gathered = torch.where((rows < 0).unsqueeze(1), 0, x[rows.clamp(min=0)])
    fused = moe.activation(x, "identity", rows=rows, offs=offs, bf16=True, fp8_rows=True, fp8_transposed=True)
    plain = moe.activation(gathered, "identity", offs=offs, bf16=True, fp8_rows=True, fp8_transposed=True)
    for a, b in zip(fused, plain):
        assert torch.equal(_bits(a), _bits(b))


def test_a_row_past_x_gives_nan_in_every_form():
    x = torch.randn(4, 128).bfloat16()
    out = moe.activation(x, "identity", rows=torch.tensor([0, 4, -1]), bf16=True, fp8_rows=True)
    assert torch.isnan(out.y[1]).all() and not torch.isnan(out.y[0]).any() and torch.equal(out.y[2], torch.zeros(128))
    assert torch.isnan(out.y_fp8[1].float()).all() or torch.isnan(out.y_scale[1]).all()


@pytest.mark.parametrize("recipe", ["block", "row"])
@pytest.mark.parametrize("k, drop", [(1, 0.0), (3, 0.25)])
def test_permute_fp8_is_the_quantized_permute(recipe, k, drop):
    x = torch.randn(37, 192).bfloat16()
    ids = _ids(37, k, 5, drop, seed=k)
    plain = moe.permute(x, ids, 5)
    fused = moe.permute(x, ids, 5, fp8=recipe)
    assert fused.rows is None and torch.equal(fused.offs, plain.offs) and torch.equal(fused.row_map, plain.row_map)
    rows8, scale = quantize_fp8(plain.rows, (1, 128) if recipe == "block" else "row")
    assert torch.equal(_bits(fused.rows_fp8), _bits(rows8)) and torch.equal(fused.scale, scale)


def test_permute_fp8_refuses_what_it_cannot_do():
    ids = _ids(8, 2, 3, 0.0, seed=0)
    with pytest.raises(ValueError, match="fp8 must be None or one of"):
        moe.permute(torch.randn(8, 16).bfloat16(), ids, 3, fp8="tensor")
    with pytest.raises(ValueError, match="fp8 permutes bfloat16 x"):
        moe.permute(torch.randn(8, 16), ids, 3, fp8="block")
    x = torch.randn(8, 16).bfloat16()
    with pytest.raises(ValueError, match="rows .a gather. applies to the identity only"):
        moe.activation(torch.randn(8, 32).bfloat16(), "swiglu", rows=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows must be a 1-D int64 tensor"):
        moe.activation(x, "identity", rows=torch.zeros(3, dtype=torch.int32))


def test_route_says_where_each_copy_goes():
    ids = torch.tensor([[1, 0], [-1, 1], [0, 0]])
    r = moe.route(ids, 2)
    assert r.offs.tolist() == [3, 5] and r.k == 2
    # expert 0: slots 1, 4, 5 (tokens 0, 2, 2); expert 1: slots 0, 3 (tokens 0, 1); dropped: slot 2
    assert r.row_map.tolist() == [1, 4, 5, 0, 3, 2]
    assert r.source.tolist() == [0, 2, 2, 0, 1, -1]
    assert r.token_rows.tolist() == [3, 0, -1 - 5, 4, 1, 2]
    with pytest.raises(ValueError, match="topk_ids must be"):
        moe.route(torch.tensor([[5]]), 2)


@pytest.mark.parametrize("fp8", [None, "block", "row"])
def test_the_layer_with_routing_is_the_layer_on_permuted_rows(fp8):
    torch.manual_seed(3)
    experts, tokens, k, hidden = 4, 45, 2, 128
    layer = GroupedMLP(experts, hidden, 128, fp8=fp8, bias=True)
    ids = _ids(tokens, k, experts, 0.2, seed=4)
    ids[:, :][ids == 2] = 1  # expert 2 gets no tokens
    x = torch.randn(tokens, hidden).bfloat16()

    def run(with_routing):
        layer.zero_grad()
        xs = x.clone().requires_grad_()
        if with_routing:
            routing = moe.route(ids, experts)
            y = layer(xs, routing.offs, routing=routing)
        else:
            p = moe.permute(xs, ids, experts)
            y = layer(p.rows, p.offs)
        y.float().mul(torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return y.detach(), xs.grad, layer.fc1_weight.grad.clone(), layer.fc2_weight.grad.clone()

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8", ["block", "row"])
def test_the_layer_with_routing_keeps_the_tokens_with_save_original_input(fp8):
    """With routing and save_original_input, the backward regathers the tokens' transposed copy
    (block) or keeps the FP8 one (row: its rows are gathered here): the same gradients."""
    torch.manual_seed(5)
    experts, tokens, k, hidden = 4, 45, 2, 128
    ids = _ids(tokens, k, experts, 0.2, seed=6)
    x = torch.randn(tokens, hidden).bfloat16()
    grads = []
    for save in (False, True):
        torch.manual_seed(7)
        layer = GroupedMLP(experts, hidden, 128, fp8=fp8, save_original_input=save)
        xs = x.clone().requires_grad_()
        routing = moe.route(ids, experts)
        layer(xs, routing.offs, routing=routing).float().sum().backward()
        grads.append((xs.grad, layer.fc1_weight.grad, layer.fc2_weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8", [None, "block", "row"])
def test_moe_experts_keeps_its_input_under_block_scaling_by_default(fp8):
    """MoEExperts with fp8="block" saves x (the caller keeps it anyway) rather than the
    permuted rows' FP8 transposed copy, unless told otherwise; the gradients are the same."""
    from distgemm.nn import MoEExperts

    assert MoEExperts(4, 128, 128, fp8=fp8).experts.save_original_input == (fp8 == "block")
    assert not MoEExperts(4, 128, 128, fp8=fp8, save_original_input=False).experts.save_original_input
    ids = _ids(45, 2, 4, 0.2, seed=8)
    x = torch.randn(45, 128).bfloat16()
    grads = []
    for options in ({}, {"save_original_input": False}):
        torch.manual_seed(9)
        layer = MoEExperts(4, 128, 128, fp8=fp8, **options)
        xs = x.clone().requires_grad_()
        w = torch.rand(45, 2).requires_grad_()
        layer(xs, ids, w).float().sum().backward()
        grads.append((xs.grad, w.grad, layer.experts.fc1_weight.grad, layer.experts.fc2_weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_routing_is_checked_against_x():
    layer = GroupedMLP(3, 64, 64)
    routing = moe.route(_ids(10, 2, 3, 0.0, seed=1), 3)
    with pytest.raises(ValueError, match="routing is for 10 tokens x k=2, but x has 9 tokens"):
        layer(torch.randn(9, 64).bfloat16(), routing.offs, routing=routing)
    with pytest.raises(TypeError, match="routing must be distgemm.moe.route's Routing"):
        layer(torch.randn(10, 64).bfloat16(), routing.offs, routing=(1, 2))


@pytest.mark.parametrize("fp8", [None, "block", "row"])
def test_permute_of_no_tokens(fp8):
    p = moe.permute(torch.empty(0, 256).bfloat16(), torch.empty(0, 2, dtype=torch.int64), 4, fp8=fp8)
    assert p.offs.tolist() == [0, 0, 0, 0] and (p.rows if fp8 is None else p.rows_fp8).shape == (0, 256)


@pytest.mark.parametrize("fp8", [None, "block"])
def test_layer_bench_unfused_variant_is_the_same_layer(fp8):
    # The moe_layer suite's permute-then-quantize variant must compute what MoEExperts computes
    # (bit for bit on these paths), or its ratio measures something else.
    from distgemm.bench.moe_layer_suite import _PermutedMoE, routing
    from distgemm.nn import MoEExperts

    torch.manual_seed(0)
    ids, w = routing(40, 5, 2, True, "cpu")
    layer = MoEExperts(5, 128, 64, fp8=fp8)
    x = torch.randn(40, 128).bfloat16()
    xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = layer(xs, ids, w), _PermutedMoE(layer)(xp, ids, w)
    assert torch.equal(out, ref)
    out.float().sum().backward()
    ref.float().sum().backward()
    assert torch.equal(xs.grad, xp.grad)


def test_offs_other_than_the_routings_are_refused():
    """With routing the layer's rows are routing's: offs of other values (another batch's, a
    stale copy) would put rows under the wrong experts. Before: accepted when only the shape
    matched, a silent wrong answer. An equal copy is fine."""
    layer = GroupedMLP(3, 64, 64)
    routing = moe.route(_ids(10, 2, 3, 0.0, seed=1), 3)
    x = torch.randn(10, 64).bfloat16()
    want = layer(x, routing.offs, routing=routing)
    assert torch.equal(layer(x, routing.offs.clone(), routing=routing), want)
    other = torch.tensor([0, 0, 20], dtype=torch.int32)
    assert not torch.equal(other, routing.offs)
    with pytest.raises(ValueError, match=r"grouped_mlp: with routing, offs must be routing.offs \(its values"):
        layer(x, other, routing=routing)
