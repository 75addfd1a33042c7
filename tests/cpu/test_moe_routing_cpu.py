"""distgemm.moe.permute / unpermute and nn.MoEExperts against a per-token loop: forward and
backward, tokens dropped by the router (-1), experts without tokens, k = 1, a token routed
twice to one expert, and the argument checks."""

import pytest
import torch

from distgemm import moe
from distgemm.nn import MoEExperts
from tests.moe_reference import expert_mlp_reference, rel


def _routing(tokens, k, experts, drop=0.0, seed=0, avoid=()):
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in avoid])
    ids = allowed[torch.randint(len(allowed), (tokens, k), generator=gen)]
    ids[torch.rand(tokens, k, generator=gen) < drop] = -1
    weights = torch.rand(tokens, k, generator=gen)
    return ids, weights


def _loop_layer(x, ids, weights, f):
    """out[t] = sum_j w[t, j] * f(x[t], ids[t, j]) over the slots not dropped."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0:
                out[t] += weights[t, j].double() * f(x[t:t + 1], e)[0].double()
    return out


@pytest.mark.parametrize("k, drop", [(1, 0.0), (2, 0.0), (4, 0.3)])
def test_permute_groups_rows_by_expert(k, drop):
    ids, _ = _routing(37, k, 5, drop, avoid=(3,))
    x = torch.randn(37, 16)
    p = moe.permute(x, ids, 5)
    flat = ids.reshape(-1)
    counts = [int((flat == e).sum()) for e in range(5)]
    assert p.offs.dtype == torch.int32 and p.offs.tolist() == torch.tensor(counts).cumsum(0).tolist()
    assert counts[3] == 0 and p.rows.shape == (37 * k, 16)
    start = 0
    for e, n in enumerate(counts):
        slots = p.row_map[start:start + n]
        assert torch.all(flat[slots] == e)
        assert torch.all(slots[1:] > slots[:-1]), "token order within an expert"
        assert torch.equal(p.rows[start:start + n], x[slots // k])
        start += n
    assert torch.all(p.rows[start:] == 0), "dropped copies are zero rows"


def test_unpermute_is_the_weighted_combine_with_gradients():
    ids, w = _routing(29, 3, 4, drop=0.2, seed=1)
    x = torch.randn(29, 8, dtype=torch.float64, requires_grad=True)
    w = w.double().requires_grad_()
    scale = torch.randn(4, dtype=torch.float64)
    p = moe.permute(x, ids, 4)
    experts = torch.searchsorted(p.offs.long(), torch.arange(p.rows.shape[0]), right=True).clamp(max=3)
    y = p.rows * scale[experts].unsqueeze(1)
    y = torch.where(torch.arange(y.shape[0]).unsqueeze(1) < p.offs[-1], y, torch.full_like(y, float("nan")))
    out = moe.unpermute(y, p.row_map, w, ids, 4)
    ref = _loop_layer(x.detach(), ids, w.detach(), lambda xt, e: xt * scale[e])
    assert torch.allclose(out.detach(), ref), "forward"
    assert torch.isfinite(out).all(), "a dropped copy's NaN row reached the output"
    g = torch.randn_like(out)
    out.backward(g)
    x2 = x.detach().clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    ref2 = torch.stack([sum((w2[t, j] * x2[t] * scale[int(ids[t, j])]) if ids[t, j] >= 0 else x2[t] * 0
                            for j in range(3)) for t in range(29)])
    ref2.backward(g)
    assert torch.allclose(x.grad, x2.grad) and torch.allclose(w.grad, w2.grad)


def test_a_token_routed_twice_to_one_expert_gets_two_rows():
    ids = torch.tensor([[1, 1], [0, 1]])
    w = torch.tensor([[0.25, 0.5], [1.0, 2.0]])
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    p = moe.permute(x, ids, 2)
    assert p.offs.tolist() == [1, 4]
    out = moe.unpermute(p.rows * 10, p.row_map, w)
    assert torch.allclose(out, torch.tensor([[7.5, 15.0], [90.0, 120.0]]))


@pytest.mark.parametrize("fp8", [None, "block"])
def test_moe_experts_matches_the_loop(fp8):
    torch.manual_seed(2)
    layer = MoEExperts(4, 64, 128, fp8=fp8)
    ids, w = _routing(50, 2, 4, drop=0.1, seed=3, avoid=(2,))
    x = torch.randn(50, 64).bfloat16().requires_grad_()
    out = layer(x, ids, w)
    w1, w2 = layer.experts.fc1_weight.detach(), layer.experts.fc2_weight.detach()

    def expert(xt, e):
        return expert_mlp_reference(xt, [1], w1[e:e + 1], w2[e:e + 1], "swiglu")

    ref = _loop_layer(x.detach(), ids, w, expert)
    assert out.dtype == torch.bfloat16 and rel(out, ref) < (0.10 if fp8 else 0.02)
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert torch.all(layer.experts.fc1_weight.grad[2] == 0), "an expert without tokens got a gradient"


def test_routing_refuses_bad_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="topk_ids must be a 2-D"):
        moe.permute(x, torch.zeros(4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="one row per token"):
        moe.permute(x, torch.zeros(3, 1, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"in \[0, 2\) or -1"):
        moe.permute(x, torch.full((4, 1), 2), 2)
    with pytest.raises(ValueError, match="num_experts"):
        moe.permute(x, torch.zeros(4, 1, dtype=torch.int64), 0)
    p = moe.permute(x, torch.zeros(4, 2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="y must be"):
        moe.unpermute(p.rows[:5], p.row_map, torch.ones(4, 2))
    with pytest.raises(ValueError, match="row_map"):
        moe.unpermute(p.rows, p.row_map[:3], torch.ones(4, 2))


@pytest.mark.parametrize("skewed", [False, True])
def test_layer_bench_peer_is_the_same_layer(skewed):
    # The moe_layer suite's torch-ops layer (argsort, index_select, torch._grouped_mm, index_add_)
    # must compute what MoEExperts computes, forward and the input's gradient, or its ratios mean nothing.
    from distgemm.bench.moe_layer_suite import _TorchMoE, routing

    torch.manual_seed(0)
    ids, w = routing(50, 6, 2, skewed, "cpu")
    assert ids.shape == (50, 2) and torch.all(ids[:, 0] != ids[:, 1])
    assert torch.allclose(w.sum(1), torch.ones(50))
    layer = MoEExperts(6, 64, 32, activation="swiglu")
    peer = _TorchMoE(layer.experts.fc1_weight, layer.experts.fc2_weight)
    x = torch.randn(50, 64).bfloat16().requires_grad_()
    xp = x.detach().clone().requires_grad_()
    out, ref = layer(x, ids, w), peer(xp, ids, w)
    assert rel(out, ref) < 0.02
    out.float().sum().backward()
    ref.float().sum().backward()
    assert rel(x.grad, xp.grad) < 0.02


def test_bad_arguments_name_the_argument():
    x = torch.randn(10, 16).bfloat16()
    ids, w = torch.randint(0, 4, (10, 2)), torch.rand(10, 2)
    p = moe.permute(x, ids, 4)
    with pytest.raises(ValueError, match=r"topk_weights must have topk_ids' shape \(10, 2\), got \(10, 1\)"):
        moe.unpermute(p.rows, p.row_map, w[:, :1], ids, 4)
    with pytest.raises(ValueError, match="topk_weights must be a 2-D .* floating-point"):
        moe.unpermute(p.rows, p.row_map, torch.ones(10, 2, dtype=torch.int64), ids, 4)
    with pytest.raises(ValueError, match="row_map must be .* int64 row map, got torch.float32"):
        moe.unpermute(p.rows, p.row_map.float(), w)
    with pytest.raises(ValueError, match=r"y must be .* for topk_weights \(10, 2\)"):
        moe.unpermute(p.rows[:19], p.row_map, w)
    with pytest.raises(ValueError, match="topk_weights must have topk_ids' shape"):
        MoEExperts(4, 16, 8)(x, ids, w[:, :1])


def test_activation_bad_arguments_name_the_argument():
    x = torch.randn(10, 16).bfloat16()
    with pytest.raises(ValueError, match=r"x must be a 2-D bfloat16 tensor, got torch.bfloat16 of shape \(16,\)"):
        moe.activation(x[0], "gelu")
    with pytest.raises(ValueError, match="x must be a 2-D bfloat16 tensor, got list"):
        moe.activation([1, 2], "gelu")
    offs = torch.tensor([4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"needs offs, .* got torch.int64 of shape \(2,\)"):
        moe.activation(x, "gelu", offs=offs.long(), fp8_transposed=True)
    with pytest.raises(ValueError, match="needs offs, .* got NoneType"):
        moe.activation(x, "gelu", fp8_transposed=True)


@pytest.mark.parametrize("row_map, what", [(torch.zeros(20, dtype=torch.long), "with repeats"),
                                           (torch.arange(20) + 5, r"values in \[5, 24\]"),
                                           (torch.arange(20) - 1, r"values in \[-1, 18\]")])
def test_unpermute_names_a_row_map_that_is_not_a_permutation(row_map, what):
    with pytest.raises(ValueError, match=f"row_map must be a permutation of \\[0, 20\\).*{what}"):
        moe.unpermute(torch.randn(20, 16), row_map, torch.rand(10, 2))


def test_slot_rows_of_a_malformed_row_map_stay_in_bounds():
    # What the GPU path gets without the debug setting: each slot's row, or -1 - n where no row
    # names the slot; entries out of range are ignored.
    slot = moe._slot_rows(torch.tensor([2, 0, 7, -3]))
    assert slot.tolist() == [1, -5, 0, -5]
    assert moe._slot_rows(torch.tensor([2, 0, 3, 1])).tolist() == [1, 3, 0, 2]


def test_a_num_experts_past_int32_offs_is_named():
    ids = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"num_experts must be an int in \[1, 2\^31\)"):
        moe.permute(torch.randn(4, 8), ids, 2 ** 40)  # would have allocated 8 TiB of counts
