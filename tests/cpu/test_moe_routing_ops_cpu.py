"""permute / unpermute through the routing ops' path (distgemm::moe_combine and its backward, as
the C API states them) on the CPU: the ops replaced by plain-PyTorch versions of that contract,
so that the wiring around them (slot rows, dropped copies as -1 - row, the autograd functions)
is checked against the torch-ops path without a GPU. tests/gpu/test_moe_routing_gpu.py checks
the kernels themselves against the same references."""

import pytest
import torch

from distgemm import moe


def combine(y, rows, weights, tokens, k):
    """dg_moe_combine: out[t] = sum over kept j of weights * y[rows], FP32 in slot order, rounded once."""
    assert k >= 1, "the binding refuses k < 1"
    out = torch.zeros(tokens, y.shape[1], dtype=torch.float32)
    for t in range(tokens):
        for j in range(k):
            r = int(rows[t * k + j])
            if 0 <= r < y.shape[0]:
                w = 1.0 if weights is None else weights[t * k + j]
                out[t] += w * y[r].float()
    return out.to(y.dtype)


def combine_backward(dy, y, rows, weights, num_rows, tokens, k, want_dweights):
    """dg_moe_combine_backward: dy_rows[r] = w * dy[t]; a dropped slot (-1 - p) zeros row p."""
    assert k >= 1, "the binding refuses k < 1"
    dy_rows = torch.zeros(num_rows, dy.shape[1], dtype=dy.dtype)
    dw = torch.zeros(tokens * k if want_dweights else 0, dtype=torch.float32)
    for t in range(tokens):
        for j in range(k):
            i = t * k + j
            r = int(rows[i])
            row = r if r >= 0 else -1 - r
            if row >= num_rows:
                continue
            if r < 0:
                dy_rows[row] = 0
                continue
            w = 1.0 if weights is None else float(weights[i])
            dy_rows[row] = (w * dy[t].float()).to(dy.dtype)
            if want_dweights:
                dw[i] = (dy[t].float() * y[row].float()).sum()
    return dy_rows, dw


class _Ops:
    moe_combine = staticmethod(combine)
    moe_combine_backward = staticmethod(combine_backward)


def _routing(tokens, k, experts, drop, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(experts, (tokens, k), generator=gen)
    ids[torch.rand(tokens, k, generator=gen) < drop] = -1
    return ids, torch.rand(tokens, k, generator=gen)


def _layer(x, ids, w, experts, use_ops, monkeypatch):
    """permute -> a per-expert scale (NaN in the rows past offs[-1]) -> unpermute, and the
    gradients of x and w."""
    with monkeypatch.context() as m:
        if use_ops:
            m.setattr(moe, "ops", _Ops)
            m.setattr(moe, "_routing_kernels", lambda t: True)
        x = x.detach().clone().requires_grad_()
        w = w.detach().clone().requires_grad_()
        p = moe.permute(x, ids, experts)
        scale = torch.arange(1, experts + 1, dtype=torch.float32)
        expert = torch.searchsorted(p.offs.long(), torch.arange(p.rows.shape[0]), right=True).clamp(max=experts - 1)
        y = (p.rows.float() * scale[expert].unsqueeze(1)).to(x.dtype)
        y = torch.where(torch.arange(y.shape[0]).unsqueeze(1) < p.offs[-1], y, torch.full_like(y, float("nan")))
        out = moe.unpermute(y, p.row_map, w, ids, experts)
        out.float().mul(torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return p, out.detach(), x.grad, w.grad


@pytest.mark.parametrize("tokens, k, experts, drop, hidden", [(37, 1, 5, 0.0, 16), (29, 3, 4, 0.25, 12),
                                                                (40, 4, 7, 0.1, 8), (1, 2, 3, 0.0, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_path_matches_the_torch_path(tokens, k, experts, drop, hidden, dtype, monkeypatch):
    ids, w = _routing(tokens, k, experts, drop, seed=tokens + k)
    x = torch.randn(tokens, hidden).to(dtype)
    ref_p, ref_out, ref_dx, ref_dw = _layer(x, ids, w, experts, False, monkeypatch)
    p, out, dx, dw = _layer(x, ids, w, experts, True, monkeypatch)
    assert torch.equal(p.rows, ref_p.rows) and torch.equal(p.offs, ref_p.offs) and torch.equal(p.row_map, ref_p.row_map)
    assert torch.isfinite(out).all(), "a dropped copy's NaN row reached the output"
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(dx, ref_dx, **tol)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-5)
    dropped = (ids < 0)
    assert torch.all(dw[dropped] == 0), "a dropped slot's weight got a gradient"


def test_a_token_routed_twice_through_the_ops(monkeypatch):
    monkeypatch.setattr(moe, "ops", _Ops)
    monkeypatch.setattr(moe, "_routing_kernels", lambda t: True)
    ids = torch.tensor([[1, 1], [0, 1]])
    w = torch.tensor([[0.25, 0.5], [1.0, 2.0]])
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    p = moe.permute(x, ids, 2)
    assert p.offs.tolist() == [1, 4]
    assert torch.equal(p.rows, torch.tensor([[3.0, 4.0], [1.0, 2.0], [1.0, 2.0], [3.0, 4.0]]))
    out = moe.unpermute(p.rows * 10, p.row_map, w)
    assert torch.allclose(out, torch.tensor([[7.5, 15.0], [90.0, 120.0]]))


def test_slot_rows_invert_the_row_map_and_mark_dropped_slots():
    row_map = torch.tensor([2, 0, 3, 1])
    assert moe._kept_slot_rows(row_map, None).tolist() == [1, 3, 0, 2]
    kept = torch.tensor([True, False, True, True])
    assert moe._kept_slot_rows(row_map, kept).tolist() == [1, -4, 0, 2]
    assert moe._kept_slot_rows(row_map.int(), None).dtype == torch.int64
    # a slot no row names stays -1 - n whether kept or not (nothing read or written for it)
    assert moe._kept_slot_rows(torch.tensor([2, 0, 7, -3]), kept).tolist() == [1, -5, 0, -5]


@pytest.mark.parametrize("use_ops", [False, True])
def test_gather_with_k_0_gives_x_a_zero_gradient(use_ops, monkeypatch):
    """Routing with k = 0 (no copies): the rows are empty and each token's gradient is zero
    (before: the backward divided by k)."""
    if use_ops:
        monkeypatch.setattr(moe, "ops", _Ops)
        monkeypatch.setattr(moe, "_routing_kernels", lambda t: True)
    x = torch.randn(4, 16).requires_grad_()
    p = moe.permute(x, torch.zeros(4, 0, dtype=torch.long), 2)
    assert p.rows.shape == (0, 16) and p.offs.tolist() == [0, 0]
    p.rows.sum().backward()
    assert x.grad.shape == (4, 16) and torch.all(x.grad == 0)


@pytest.mark.parametrize("use_ops", [False, True])
def test_unpermute_with_k_0_is_zeros(use_ops, monkeypatch):
    """k = 0: every token's sum is empty, zeros of y's width, and topk_weights' gradient is
    empty. The routing ops refuse k < 1: the call must not reach them."""
    if use_ops:
        monkeypatch.setattr(moe, "ops", _Ops)
        monkeypatch.setattr(moe, "_routing_kernels", lambda t: True)
    y = torch.randn(0, 16).requires_grad_()
    w = torch.rand(4, 0).requires_grad_()
    ids = torch.zeros(4, 0, dtype=torch.long)
    for args in ((), (ids, 2)):
        out = moe.unpermute(y, torch.zeros(0, dtype=torch.long), w, *args)
        assert out.shape == (4, 16) and torch.all(out == 0)
        out.sum().backward()
        assert w.grad.shape == (4, 0)


@pytest.mark.parametrize("weights_grad", [False, True])
def test_the_combine_keeps_y_only_for_the_weights_gradient(weights_grad, monkeypatch):
    """The combine's backward reads y only for topk_weights' gradient: with weights that need
    none (a frozen or detached router), y (T * k rows) is not kept alive for the backward, as
    the torch path's product keeps it only then. The gradients are the same either way."""
    monkeypatch.setattr(moe, "ops", _Ops)
    monkeypatch.setattr(moe, "_routing_kernels", lambda t: True)
    ids, w = _routing(9, 3, 4, 0.2, seed=5)
    x = torch.randn(9, 8)
    p = moe.permute(x, ids, 4)
    y = (p.rows * 2).requires_grad_()
    w.requires_grad_(weights_grad)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = moe.unpermute(y, p.row_map, w, ids, 4)
    assert (tuple(y.shape) in saved) == weights_grad
    out.sum().backward()
    monkeypatch.undo()
    y_ref = y.detach().clone().requires_grad_()
    w_ref = w.detach().clone().requires_grad_(weights_grad)
    moe.unpermute(y_ref, p.row_map, w_ref, ids, 4).sum().backward()
    torch.testing.assert_close(y.grad, y_ref.grad)
    if weights_grad:
        torch.testing.assert_close(w.grad, w_ref.grad)
