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


def _routed_layer(x, ids, w, experts):
    """permute -> a per-expert scale (NaN past offs[-1]) -> unpermute; the output and the
    gradients of x and w for a fixed output gradient."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    p = moe.permute(x, ids, experts)
    scale = torch.arange(1, experts + 1, device=DEV, dtype=torch.float32) / experts
    expert = torch.searchsorted(p.offs.long(), torch.arange(p.rows.shape[0], device=DEV), right=True)
    y = (p.rows.float() * scale[expert.clamp(max=experts - 1)].unsqueeze(1)).to(x.dtype)
    y = torch.where(torch.arange(y.shape[0], device=DEV).unsqueeze(1) < p.offs[-1], y, torch.full_like(y, float("nan")))
    out = moe.unpermute(y, p.row_map, w, ids, experts)
    grad = torch.linspace(-1, 1, out.numel(), device=DEV).view_as(out).to(out.dtype)
    out.backward(grad)
    return p, out.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens, k, experts, drop, hidden", [(1000, 4, 64, 0.1, 256), (333, 1, 5, 0.3, 100),
                                                                (517, 8, 256, 0.0, 2048), (77, 3, 4, 0.5, 13),
                                                                (0, 2, 4, 0.0, 64), (40, 2, 3, 1.0, 32)])
def test_routing_kernels_match_the_torch_ops(dtype, tokens, k, experts, drop, hidden, monkeypatch):
    """The permute's gather and the combine kernels against the torch-ops path on the same
    inputs: odd widths (the scalar path), dropped copies with NaN rows, every copy dropped, no
    tokens; forward and both gradients."""
    ids, w = _routing(tokens, k, experts, drop, seed=tokens + k)
    x = torch.randn(tokens, hidden, device=DEV).to(dtype)
    p, out, dx, dw = _routed_layer(x, ids, w, experts)
    with monkeypatch.context() as m:
        m.setattr(moe, "_routing_kernels", lambda t: False)
        ref_p, ref_out, ref_dx, ref_dw = _routed_layer(x, ids, w, experts)
    assert torch.equal(p.rows, ref_p.rows), "the gather is a copy"
    assert torch.equal(p.row_map, ref_p.row_map) and torch.equal(p.offs, ref_p.offs)
    assert torch.isfinite(out).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(dx.float(), ref_dx.float(), rtol=tol, atol=tol * k)  # torch adds in the dtype
    torch.testing.assert_close(dw, ref_dw, rtol=1e-4, atol=1e-4)
    assert torch.all(dw[ids < 0] == 0)


def test_combine_skips_rows_out_of_range():
    """Row indices past the rows or negative contribute nothing (no read out of bounds), and the
    backward writes no row for them (the rows no slot names are unspecified)."""
    y = torch.randn(10, 24, device=DEV)
    rows = torch.tensor([0, 9, 10, -1, 1 << 40, 3], device=DEV)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], device=DEV)
    out = torch.ops.distgemm.moe_combine(y, rows, w, 3, 2)
    ref = torch.stack([y[0] + 2 * y[9], torch.zeros(24, device=DEV), 6 * y[3]])
    torch.testing.assert_close(out, ref)
    dy = torch.randn(3, 24, device=DEV)
    rows = torch.tensor([0, 9, 10, -1 - 5, ~(1 << 40), 3], device=DEV)  # -1 - 5: a dropped copy in row 5
    dy_rows, dw = torch.ops.distgemm.moe_combine_backward(dy, y, rows, w, 10, 3, 2, True)
    assert torch.equal(dy_rows[5], torch.zeros(24, device=DEV))
    torch.testing.assert_close(dy_rows[0], dy[0])
    torch.testing.assert_close(dy_rows[9], 2 * dy[0])
    torch.testing.assert_close(dy_rows[3], 6 * dy[2])
    torch.testing.assert_close(dw, torch.stack([dy[0] @ y[0], dy[0] @ y[9], dy[1].new_zeros(()), dy[1].new_zeros(()),
                                                dy[2].new_zeros(()), dy[2] @ y[3]]), rtol=1e-5, atol=1e-5)


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


@pytest.mark.parametrize("tokens, hidden, k, experts", [(1000, 256, 3, 16), (77, 200, 2, 5), (300, 4096, 8, 64),
                                                        (129, 136, 1, 3)])
def test_permute_kernel_is_the_quantized_gather(tokens, hidden, k, experts):
    # dg_moe_permute against the gather then the identity pass: every form bit for bit, with
    # dropped copies, experts without tokens and odd sizes
    x = torch.randn(tokens, hidden, device=DEV).bfloat16()
    ids, _ = _routing(tokens, k, experts, 0.1, seed=5)
    ids[ids == 1] = 0  # expert 1 gets no tokens
    r = moe.route(ids, experts)
    forms = dict(offs=r.offs, bf16=True, fp8_rows=True, fp8_transposed=True)
    torch.empty(64 << 20, device=DEV).fill_(float("nan"))  # freed into the cache the outputs come from
    fused = moe.activation(x, "identity", rows=r.source, **forms)
    gathered = torch.where((r.source < 0).unsqueeze(1), 0, x[r.source.clamp(min=0)])
    # Outputs from fresh memory filled with NaN: every row, the dropped copies past offs[-1]
    # included, must be written.
    torch.empty(64 << 20, device=DEV).fill_(float("nan"))
    plain = moe.activation(gathered, "identity", **forms)
    assert torch.equal(plain.y, gathered)
    for name, a, b in zip(fused._fields, fused, plain):
        assert torch.equal(_bits(a), _bits(b)), name
    fp8 = moe.permute(x, ids, experts, fp8="block")
    assert torch.equal(_bits(fp8.rows_fp8), _bits(plain.y_fp8)) and torch.equal(fp8.scale, plain.y_scale)


def test_permute_kernel_gives_nan_rows_for_rows_past_x():
    x = torch.randn(6, 256, device=DEV).bfloat16()
    out = moe.activation(x, "identity", rows=torch.tensor([0, 6, -1, 1 << 40], device=DEV), bf16=True, fp8_rows=True)
    assert torch.isnan(out.y[[1, 3]]).all() and torch.equal(out.y[2], torch.zeros_like(out.y[2]))
    assert torch.equal(out.y[0], x[0])
    assert (torch.isnan(out.y_fp8[[1, 3]].float()).all() or torch.isnan(out.y_scale[[1, 3]]).all())


@pytest.mark.parametrize("fp8", [None, "block"])
def test_moe_experts_gathering_as_it_reads_is_the_permuted_layer(fp8):
    torch.manual_seed(0)
    layer = MoEExperts(16, 256, 128, fp8=fp8, device=DEV)
    ids, w = _routing(500, 4, 16, 0.1, seed=2)
    x = torch.randn(500, 256, device=DEV).bfloat16()

    def run(fused):
        layer.zero_grad()
        xs = x.clone().requires_grad_()
        if fused:
            out = layer(xs, ids, w)
        else:
            p = moe.permute(xs, ids, 16)
            out = moe.unpermute(layer.experts(p.rows, p.offs), p.row_map, w, ids, 16)
        out.float().sum().backward()
        return out.detach(), xs.grad, layer.experts.fc1_weight.grad.clone()

    run(False)  # the autotuner settles each problem once
    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8", [None, "block", "row"])
def test_permute_of_no_tokens(fp8):
    x = torch.empty(0, 256, device=DEV, dtype=torch.bfloat16)
    p = moe.permute(x, torch.empty(0, 2, dtype=torch.int64, device=DEV), 4, fp8=fp8)
    assert p.offs.tolist() == [0, 0, 0, 0] and (p.rows if fp8 is None else p.rows_fp8).shape == (0, 256)
