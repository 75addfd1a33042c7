"""Autograd and torch.compile behaviour of the MoE layers on the CPU reference path: a kept
graph's second backward, double backward, gradients of some inputs only, frozen inputs,
no_grad / inference_mode, non-contiguous and in-place-modified x, fused wgrad accumulation,
is_first_microbatch, activation checkpointing and torch.compile, each against the layer's
own plain backward (bit for bit) and, in bf16, the FP32 per-expert reference."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from distgemm.nn import GroupedLinear, GroupedMLP, MoEExperts
from tests.moe_reference import expert_mlp_reference, rel

COUNTS = [50, 0, 78]
RECIPES = [None, "block", "row"]


def _offs(counts=COUNTS):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _mlp(fp8, **kw):
    torch.manual_seed(0)
    return GroupedMLP(3, 128, 128, fp8=fp8, bias=True, **kw)


def _data(rows=sum(COUNTS)):
    torch.manual_seed(1)
    return torch.randn(rows, 128).bfloat16(), torch.randn(rows, 128).bfloat16()


def _grads(layer, x):
    return [x.grad] + [p.grad for p in layer.parameters()]


def _plain(layer, x0, dy, *args):
    """Output and gradients (x first, then the parameters) of one ordinary backward."""
    x = x0.clone().requires_grad_()
    y = layer(x, *args)
    y.backward(dy)
    out = y.detach(), [g.clone() for g in _grads(layer, x)]
    layer.zero_grad()
    return out


def _same(got, want, scale=1):
    for a, b in zip(got, want):
        assert torch.equal(a, b * scale) if scale == 1 else rel(a, b * scale) == 0.0


@pytest.mark.parametrize("fp8", RECIPES)
def test_kept_graph_second_backward_doubles_the_gradients(fp8):
    layer, (x0, dy) = _mlp(fp8), _data()
    y, want = _plain(layer, x0, dy, _offs())
    if fp8 is None:  # the layer's plain backward against the FP32 reference
        ps = [p.detach().clone().requires_grad_() for p in layer.parameters()]
        xr = x0.clone().requires_grad_()
        expert_mlp_reference(xr, COUNTS, ps[0], ps[1], "swiglu", ps[2], ps[3]).backward(dy.float())
        for a, b in zip(want, [xr.grad] + [p.grad for p in ps]):
            assert rel(a, b) < 0.03
    x = x0.clone().requires_grad_()
    loss = (layer(x, _offs()).float() * dy.float()).sum()
    loss.backward(retain_graph=True)
    _same(_grads(layer, x), want)
    loss.backward()  # nothing the first backward read may have been freed
    _same(_grads(layer, x), want, scale=2)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


@pytest.mark.parametrize("layer_kind", ["mlp bf16", "mlp block", "linear fused", "linear row"])
def test_double_backward_is_refused(layer_kind):
    """The backward is not differentiable: create_graph=True then a second differentiation is an
    error, not a silently missing term (before: fc1_weight's second derivative 70% off in bf16,
    and the fused GroupedLinear added into main_grad in the double backward)."""
    offs = _offs()
    x = _data()[0].requires_grad_()
    if layer_kind.startswith("mlp"):
        layer = _mlp(None if "bf16" in layer_kind else "block")
    else:
        torch.manual_seed(0)
        layer = GroupedLinear(3, 128, 64, fp8="row" if "row" in layer_kind else None,
                              fuse_wgrad_accumulation="fused" in layer_kind)
        layer.weight.main_grad = torch.zeros(layer.weight.shape)
    g, = torch.autograd.grad(layer(x, offs).float().pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.float().sum().backward()
    with pytest.raises(RuntimeError):
        torch.autograd.grad(g.float().sum(), list(layer.parameters()))


@pytest.mark.parametrize("fp8", RECIPES)
def test_some_inputs_only_frozen_and_no_grad(fp8):
    layer, (x0, dy) = _mlp(fp8), _data()
    offs = _offs()
    y, want = _plain(layer, x0, dy, offs)
    params = list(layer.parameters())
    for pick in ([0], [1, 2], [3, 4], [0, 2]):  # x; weights; biases; x and fc2's weight
        x = x0.clone().requires_grad_()
        loss = (layer(x, offs).float() * dy.float()).sum()
        got = torch.autograd.grad(loss, [([x] + params)[i] for i in pick])
        _same(got, [want[i] for i in pick])
    for frozen in ([0], [1], [2], [3, 4], [0, 1], [1, 2]):  # x without grad, frozen weights, frozen biases
        x = x0.clone().requires_grad_(0 not in frozen)
        for i, p in enumerate(params, 1):
            p.requires_grad_(i not in frozen)
        layer(x, offs).backward(dy)
        for i, t in enumerate([x] + params):
            assert (t.grad is None) == (i in frozen)
            if i not in frozen:
                assert torch.equal(t.grad, want[i]), (frozen, i)
        for p in params:
            p.requires_grad_(True)
        layer.zero_grad()
    x = x0.clone().requires_grad_()
    with torch.no_grad():
        a = layer(x, offs)
    with torch.inference_mode():
        b = layer(x, offs)
    assert not a.requires_grad and not b.requires_grad and torch.equal(a, y) and torch.equal(b, y)


@pytest.mark.parametrize("fp8", RECIPES)
def test_non_contiguous_x(fp8):
    layer, (x0, dy) = _mlp(fp8, save_original_input=True), _data()
    y, want = _plain(layer, x0, dy, _offs())
    wide = torch.zeros(x0.shape[0], 256).bfloat16()
    wide[:, 64:192] = x0
    for view in (x0.t().contiguous().t(), wide[:, 64:192]):
        x = view.requires_grad_()
        out = layer(x, _offs())
        out.backward(dy)
        assert torch.equal(out, y)
        _same(_grads(layer, x), want)
        layer.zero_grad()


@pytest.mark.parametrize("fp8, save", [(None, False), ("block", True), ("row", True), ("block", False)])
def test_x_changed_in_place_after_forward(fp8, save):
    """Where the backward keeps x (bf16; FP8 with save_original_input), changing x, or a view of
    x's buffer, in place after the forward is autograd's version-counter error; where it keeps
    only x's FP8 copy, the gradients are those at the forward's x."""
    layer, (x0, dy) = _mlp(fp8, save_original_input=save), _data(128)
    offs = torch.tensor([30, 30, 64], dtype=torch.int32)
    _, want = _plain(layer, x0[:64], dy[:64], offs)
    src = x0.clone().requires_grad_()
    base = src * 1
    x, sibling = base[:64], base[64:]  # contiguous views of one buffer
    y = layer(x, offs)
    with torch.no_grad():
        sibling.mul_(2)
    if fp8 is None or save:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward(dy[:64])
    else:
        y.backward(dy[:64])
        assert torch.equal(src.grad[:64], want[0]) and torch.equal(layer.fc1_weight.grad, want[1])


@pytest.mark.parametrize("fp8", RECIPES)
def test_fused_wgrad_accumulation(fp8):
    offs = _offs()
    ref, layer = _mlp(fp8), _mlp(fp8, fuse_wgrad_accumulation=True)
    x1, x2 = _data()
    w1, w2 = layer.fc1_weight, layer.fc2_weight
    for bad, err, match in ((None, RuntimeError, "needs fc2_weight.main_grad"),
                            (torch.zeros(3, 128, 64), ValueError, r"fc2_weight.main_grad must be .* got torch.float32"),
                            (torch.zeros(w2.shape, dtype=torch.bfloat16), ValueError, "got torch.bfloat16")):
        w1.main_grad = torch.zeros(w1.shape)
        w2.main_grad = bad
        with pytest.raises(err, match=match):
            layer(x1, offs)
    w2.requires_grad_(False)  # a frozen weight needs none
    layer(x1, offs)
    w2.requires_grad_(True)
    w1.main_grad, w2.main_grad = torch.zeros(w1.shape), torch.zeros(w2.shape)
    for x in (x1, x2):  # two micro-batches: main_grad holds the sum
        ref(x.clone().requires_grad_(), offs).float().sum().backward()
        layer(x.clone().requires_grad_(), offs).float().sum().backward()
    for w, r in ((w1, ref.fc1_weight), (w2, ref.fc2_weight)):
        assert w.grad is None and rel(w.main_grad, r.grad) < 0.01
    assert torch.equal(layer.fc1_bias.grad, ref.fc1_bias.grad)


@pytest.mark.parametrize("fp8", ["block", "row"])
def test_is_first_microbatch(fp8):
    """True quantizes and keeps the copies; False reuses them (the caller's promise: even after
    an in-place update the old copies are used); None always quantizes the weight as it is and
    drops the copies. Copies made under inference_mode are not reused outside it (autograd
    cannot save inference tensors)."""
    layer, fresh = _mlp(fp8), _mlp(fp8)
    x, dy = _data()
    offs = _offs()
    first = layer(x, offs, is_first_microbatch=True)
    with torch.no_grad():
        layer.fc1_weight.mul_(1.5)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(layer(x, offs, is_first_microbatch=False), first)
    assert torch.equal(layer(x, offs), fresh(x, offs))
    assert torch.equal(layer(x, offs, is_first_microbatch=False), fresh(x, offs))  # None dropped the copies
    with torch.inference_mode():
        layer(x, offs, is_first_microbatch=True)
    _, want = _plain(fresh, x, dy, offs)
    xg = x.clone().requires_grad_()
    layer(xg, offs, is_first_microbatch=False).backward(dy)
    _same(_grads(layer, xg), want)
    linear = GroupedLinear(3, 128, 64, fp8=fp8)
    with torch.inference_mode():
        linear(x, offs, is_first_microbatch=True)
    linear(x.clone().requires_grad_(), offs, is_first_microbatch=False).float().sum().backward()
    assert torch.isfinite(linear.weight.grad).all()


@pytest.mark.parametrize("fp8", RECIPES)
def test_checkpoint_gives_the_same_gradients(fp8):
    layer, (x0, dy) = _mlp(fp8, save_original_input=fp8 is not None), _data()
    y, want = _plain(layer, x0, dy, _offs())
    x = x0.clone().requires_grad_()
    out = checkpoint(layer, x, _offs(), use_reentrant=False)
    loss = (out.float() * dy.float()).sum()
    loss.backward(retain_graph=True)
    assert torch.equal(out, y)
    _same(_grads(layer, x), want)
    loss.backward()
    _same(_grads(layer, x), want, scale=2)


def _moe(fp8):
    torch.manual_seed(0)
    layer = MoEExperts(3, 128, 128, fp8=fp8, bias=True, save_original_input=fp8 == "block")
    x0, dy = _data(40)
    ids = torch.randint(0, 3, (40, 2))
    ids[3, 1] = -1
    return layer, x0, dy, ids, torch.rand(40, 2).bfloat16()


@pytest.mark.parametrize("fp8", RECIPES)
def test_moe_experts_autograd(fp8):
    layer, x0, dy, ids, w0 = _moe(fp8)
    params = list(layer.parameters())

    def run(x, w, how=None):
        y = layer(x, ids, w) if how is None else checkpoint(layer, x, ids, w, use_reentrant=False)
        return y, (y.float() * dy.float()).sum()

    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y, loss = run(x, w)
    loss.backward(retain_graph=True)
    want = [x.grad.clone(), w.grad.clone()] + [p.grad.clone() for p in params]
    loss.backward()
    _same([x.grad, w.grad] + [p.grad for p in params], want, scale=2)
    layer.zero_grad()
    for pick in ([0], [1], [2, 3, 4, 5]):  # x only, topk_weights only, the parameters only
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        _same(torch.autograd.grad(run(x, w)[1], [([x, w] + params)[i] for i in pick]), [want[i] for i in pick])
    for p in params:  # frozen experts, x without grad
        p.requires_grad_(False)
    w = w0.clone().requires_grad_()
    run(x0, w)[1].backward()
    assert torch.equal(w.grad, want[1])
    for p in params:
        p.requires_grad_(True)
    x, w = x0.t().contiguous().t().requires_grad_(), w0.clone().requires_grad_()  # non-contiguous x, checkpointed
    out, loss = run(x, w, "checkpoint")
    loss.backward()
    assert torch.equal(out, y)
    _same([x.grad, w.grad] + [p.grad for p in params], want)
    with torch.inference_mode():
        assert torch.equal(layer(x0, ids, w0), y)


def _compiled_matches_eager(layer, args, x0, dy, fullgraph):
    torch._dynamo.reset()
    y, want = _plain(layer, x0, dy, *args)
    x = x0.clone().requires_grad_()
    out = torch.compile(layer, fullgraph=fullgraph, backend="aot_eager")(x, *args)
    out.backward(dy)
    assert torch.equal(out, y)
    _same(_grads(layer, x), want)


@pytest.mark.parametrize("fp8", RECIPES)
def test_torch_compile_matches_eager(fp8):
    """bf16 traces whole (fullgraph=True). FP8 on the CPU: the reference FP8 grouped GEMM reads
    offs on the host (a graph break), so not fullgraph here."""
    fullgraph = fp8 is None
    layer, (x0, dy) = _mlp(fp8), _data()
    _compiled_matches_eager(layer, (_offs(),), x0, dy, fullgraph)
    moe_layer, x0, dy, ids, w0 = _moe(fp8)  # MoEExperts: its CPU id check must not break the graph
    _compiled_matches_eager(moe_layer, (ids, w0), x0, dy, fullgraph)


@pytest.mark.parametrize("fp8", ["block", "row"])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_forward_makes_no_wgrad_operands(fp8, mode, monkeypatch):
    """Without autograd nothing is kept for a backward: the FP8 forward makes no padded
    transposed copy (the wgrad's operand) of x or of the activation. Before: a Function's
    needs_input_grad says True under no_grad too, so GroupedMLP and GroupedLinear wrote them in
    every evaluation forward."""
    from distgemm import moe

    calls = []
    real = moe.activation

    def spy(*args, **kw):
        calls.append(kw.get("fp8_transposed", False))
        return real(*args, **kw)

    monkeypatch.setattr(moe, "activation", spy)
    x = _data()[0].requires_grad_()
    torch.manual_seed(0)
    linear = GroupedLinear(3, 128, 64, fp8=fp8)
    for layer in (_mlp(fp8), _mlp(fp8, save_original_input=True), linear):
        want = layer(x, _offs())
        assert any(calls), "the grad-mode forward makes the wgrad's operands"
        calls.clear()
        with mode():
            got = layer(x, _offs())
        assert not any(calls) and torch.equal(got, want)
        calls.clear()


@pytest.mark.parametrize("fp8", RECIPES)
@pytest.mark.parametrize("trainable", ["x", "fc1", "fc2", "x fc2"])
def test_the_backward_keeps_only_what_its_gradients_read(fp8, trainable):
    """x is read by fc1's weight gradient only, the activation by fc2's, fc1's output h by the
    gradients below the activation: with the rest frozen (or x needing no gradient) none of them
    stays alive for nothing (before: the bf16 layer kept x, h and the activation always, the FP8
    one h). The gradients asked for are those of the layer with everything trainable."""
    torch.manual_seed(0)
    layer = GroupedMLP(3, 64, 48, fp8=fp8, save_original_input=fp8 is not None)
    x0, dy = torch.randn(40, 64).bfloat16(), torch.randn(40, 64).bfloat16()
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    y, want = _plain(layer, x0, dy, offs)
    x = x0.clone().requires_grad_("x" in trainable)
    layer.fc1_weight.requires_grad_(trainable == "fc1")
    layer.fc2_weight.requires_grad_("fc2" in trainable)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = layer(x, offs)
    kept = {"x": (40, 64) in saved, "h": (40, 96) in saved, "a": (40, 48) in saved}
    assert kept["x"] == (trainable == "fc1"), saved
    assert kept["h"] == (trainable != "fc2"), saved
    assert kept["a"] == (fp8 is None and "fc2" in trainable), saved
    out.backward(dy)
    assert torch.equal(out, y)
    for t, g in zip([x, layer.fc1_weight, layer.fc2_weight], want[:3]):
        assert (t.grad is not None) == t.requires_grad and (t.grad is None or torch.equal(t.grad, g))
