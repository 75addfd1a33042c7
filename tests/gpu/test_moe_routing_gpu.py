"""nn.MoEExperts on one GPU: against a per-token FP32 loop (bf16 and FP8), with dropped tokens
and experts without tokens, CUDA-graph replay with new routing, torch.compile."""

import pytest
import torch

from distgemm import moe
from distgemm.nn import MoEExperts
from tests.moe_reference import expert_mlp_reference, rel

pytestmark = pytest.mark.gpu
DEV = "cuda"
BAND = {None: 0.02, "block": 0.10}


def _routing(tokens, k, experts, drop, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.randint(experts, (tokens, k), generator=gen, device=DEV)
    ids[torch.rand(tokens, k, generator=gen, device=DEV) < drop] = -1
    return ids, torch.rand(tokens, k, generator=gen, device=DEV)


def _reference(layer, x, ids, w):
    """Per expert: the rows routed to it through the FP32 MLP, combined per token in FP32."""
    w1, w2 = layer.experts.fc1_weight.detach(), layer.experts.fc2_weight.detach()
    out = torch.zeros(x.shape[0], x.shape[1], device=DEV)
    for e in range(layer.num_experts):
        t, j = torch.nonzero(ids == e, as_tuple=True)
        if t.numel():
            y = expert_mlp_reference(x[t], [t.numel()], w1[e:e + 1], w2[e:e + 1], layer.experts.activation)
            out.index_add_(0, t, y * w[t, j].unsqueeze(1))
    return out


@pytest.mark.parametrize("fp8", [None, "block"])
@pytest.mark.parametrize("experts, k, drop", [(8, 2, 0.0), (64, 4, 0.1), (256, 8, 0.0), (4, 1, 0.3)])
def test_moe_experts_matches_the_reference(fp8, experts, k, drop):
    torch.manual_seed(0)
    layer = MoEExperts(experts, 256, 128, fp8=fp8, device=DEV)
    ids, w = _routing(1000, k, experts, drop, seed=1)
    x = torch.randn(1000, 256, device=DEV).bfloat16().requires_grad_()
    out = layer(x, ids, w)
    assert rel(out, _reference(layer, x.detach(), ids, w)) < BAND[fp8]
    out.float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.experts.fc1_weight.grad).all()


def test_graph_replay_takes_new_routing():
    torch.manual_seed(2)
    layer = MoEExperts(8, 256, 128, fp8="block", device=DEV)
    x = torch.randn(512, 256, device=DEV).bfloat16()
    ids, w = _routing(512, 2, 8, 0.0, seed=3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(2):
            layer(x, ids, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = layer(x, ids, w)
    for seed in (4, 5):
        new_ids, new_w = _routing(512, 2, 8, 0.2, seed)
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, _reference(layer, x, ids, w)) < BAND["block"]


def test_moe_experts_under_torch_compile():
    torch.manual_seed(6)
    layer = MoEExperts(8, 256, 128, device=DEV)
    ids, w = _routing(300, 2, 8, 0.1, seed=7)
    x = torch.randn(300, 256, device=DEV).bfloat16()
    out = torch.compile(layer)(x, ids, w)
    assert rel(out, _reference(layer, x, ids, w)) < BAND[None]


def test_permute_matches_a_sort_on_the_host():
    ids, _ = _routing(777, 4, 16, 0.2, seed=8)
    x = torch.randn(777, 64, device=DEV)
    p = moe.permute(x, ids, 16)
    flat = ids.reshape(-1).cpu()
    keys = torch.where(flat >= 0, flat, torch.full_like(flat, 16))
    order = torch.sort(keys, stable=True).indices
    assert torch.equal(p.row_map.cpu(), order)
    assert p.offs.cpu().tolist() == torch.bincount(flat[flat >= 0], minlength=16).cumsum(0).tolist()


def test_a_malformed_row_map_is_read_in_bounds_and_named_with_debug(use_settings):
    y = torch.randn(20, 16, device=DEV)
    w = torch.rand(10, 2, device=DEV)
    for bad in (torch.arange(20, device=DEV) + 5, torch.zeros(20, dtype=torch.long, device=DEV)):
        out = moe.unpermute(y, bad, w)
        torch.cuda.synchronize()  # no device-side assert: the context is still usable
        assert out.shape == (10, 16)
    use_settings(debug=True)
    with pytest.raises(ValueError, match="row_map must be a permutation"):
        moe.unpermute(y, torch.arange(20, device=DEV) + 5, w)
