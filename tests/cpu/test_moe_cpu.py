"""distgemm.moe on the CPU reference path: the activations' derivatives against autograd, the
expert MLP (bf16 and both FP8 recipes) against an FP32 per-expert reference, and the argument
checks. Bounds as in tests/gpu/test_moe_gpu.py (which says how they follow from the formats)."""

import pytest
import torch

from distgemm import moe
from distgemm.nn import GroupedMLP
from tests.moe_reference import expert_mlp_reference, rel

OUT_BAND = {None: 0.02, "block": 0.10, "row": 0.10}
GRAD_BAND = {None: 0.03, "block": 0.15, "row": 0.15}


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_activation_derivatives_match_autograd(kind):
    torch.manual_seed(0)
    inner = 48
    x = (torch.randn(37, 2 * inner if kind == "swiglu" else inner) * 3).bfloat16()
    dy = torch.randn(37, inner).bfloat16()
    xf = x.double().requires_grad_()
    y = (torch.nn.functional.silu(xf[:, :inner]) * xf[:, inner:] if kind == "swiglu"
         else torch.nn.functional.gelu(xf))
    y.backward(dy.double())
    forward = moe.activation(x, kind).y
    backward = moe.activation(x, kind, dy=dy).y
    assert rel(forward, y.detach()) < 2 ** -8 and rel(backward, xf.grad) < 2 ** -8


def test_activation_identity_returns_a_copy():
    """The identity's bf16 form is a new tensor, as the kernel writes it: changing it leaves x
    as it was (before: on the CPU path it was x itself)."""
    x = torch.randn(6, 16).bfloat16()
    x0 = x.clone()
    out = moe.activation(x, "identity")
    assert torch.equal(out.y, x0)
    out.y.zero_()
    assert torch.equal(x, x0)


def test_activation_fp8_forms_are_quantize_fp8_of_the_bf16_values():
    import distgemm

    counts = [70, 0, 130]
    offs = _offs(counts)
    x = torch.randn(200, 2 * 256).bfloat16()
    out = moe.activation(x, "swiglu", offs=offs, bf16=True, fp8_rows=True, fp8_transposed=True)
    r8, rs = distgemm.quantize_fp8(out.y, (1, 128))
    t8, ts = distgemm.quantize_fp8(out.y, (1, 128), transpose=True, offs=offs)
    assert torch.equal(out.y_fp8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(out.y_scale, rs)
    assert torch.equal(out.yt_fp8.view(torch.uint8), t8.view(torch.uint8)) and torch.equal(out.yt_scale, ts)


@pytest.mark.parametrize("fp8", [None, "block", "row"])
@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_grouped_mlp_matches_fp32_reference(fp8, kind):
    torch.manual_seed(1)
    counts = [70, 0, 131]
    offs = _offs(counts)
    layer = GroupedMLP(3, 128, 144, activation=kind, fp8=fp8, bias=True)
    x = torch.randn(sum(counts), 128).bfloat16().requires_grad_()
    dy = torch.randn(sum(counts), 128).bfloat16()
    y = layer(x, offs)
    y.backward(dy)
    params = [p.detach().clone().requires_grad_() for p in (layer.fc1_weight, layer.fc2_weight,
                                                           layer.fc1_bias, layer.fc2_bias)]
    xr = x.detach().clone().requires_grad_()
    yr = expert_mlp_reference(xr, counts, *params[:2], kind, *params[2:])
    yr.backward(dy.float())
    assert rel(y, yr) < OUT_BAND[fp8]
    assert rel(x.grad, xr.grad) < GRAD_BAND[fp8]
    for p, r in zip((layer.fc1_weight, layer.fc2_weight, layer.fc1_bias, layer.fc2_bias), params):
        assert rel(p.grad, r.grad) < GRAD_BAND[fp8]
    assert torch.all(layer.fc1_weight.grad[1] == 0) and torch.all(layer.fc2_bias.grad[1] == 0)


@pytest.mark.parametrize("fp8", ["block", "row"])
def test_save_original_input_gives_the_same_gradients(fp8):
    """Keeping x and making its FP8 transposed copy in the backward is the same arithmetic as
    saving that copy from the forward: bit-identical gradients, x itself left intact."""
    torch.manual_seed(4)
    counts = [50, 0, 90]
    grads = []
    x = torch.randn(sum(counts), 128).bfloat16()
    dy = torch.randn(sum(counts), 128).bfloat16()
    for save in (False, True):
        torch.manual_seed(5)
        layer = GroupedMLP(3, 128, 128, fp8=fp8, save_original_input=save)
        xi = x.clone().requires_grad_()
        layer(xi, _offs(counts)).backward(dy)
        grads.append((xi.grad, layer.fc1_weight.grad, layer.fc2_weight.grad))
        assert torch.equal(xi.detach(), x), "the saved input was changed"
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8", [None, "block"])
def test_a_kept_graph_keeps_its_saved_activations(fp8):
    """The backward frees the saved activations after their last use unless the graph is kept:
    dgrad and wgrad asked for separately (retain_graph=True, as pipeline schedules split them)
    give what one backward gives."""
    torch.manual_seed(8)
    layer = GroupedMLP(2, 128, 128, fp8=fp8)
    x = torch.randn(64, 128).bfloat16().requires_grad_()
    offs = _offs([30, 34])
    loss = layer(x, offs).float().sum()
    dx, = torch.autograd.grad(loss, x, retain_graph=True)
    dw1, dw2 = torch.autograd.grad(loss, [layer.fc1_weight, layer.fc2_weight])
    loss = layer(x, offs).float().sum()
    loss.backward()
    assert torch.equal(dx, x.grad) and torch.equal(dw1, layer.fc1_weight.grad) and torch.equal(dw2, layer.fc2_weight.grad)


def test_grouped_mlp_traces_whole_under_torch_compile():
    """fullgraph=True: freeing the saved activations (a .data swap) is left to the compiled
    backward, so nothing breaks the graph."""
    torch.manual_seed(9)
    layer = GroupedMLP(2, 128, 128)
    x = torch.randn(64, 128).bfloat16().requires_grad_()
    offs = _offs([30, 34])
    layer(x, offs).float().sum().backward()
    want = x.grad.clone()
    x.grad = None
    torch.compile(layer, fullgraph=True, backend="eager")(x, offs).float().sum().backward()
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("case", ["kept", "frozen fc1", "strided x"])
def test_save_original_input_keeps_x_only_where_it_helps(case):
    """x is kept for the backward only where fc1's weight needs its gradient and x is contiguous
    (a contiguous copy of x would cost more than its FP8 transpose). Seen through autograd: a kept
    x changed in place after the forward is refused as usual; an x not kept is not read again."""
    torch.manual_seed(10)
    layer = GroupedMLP(2, 128, 128, fp8="block", save_original_input=True)
    layer.fc1_weight.requires_grad_(case != "frozen fc1")
    base = torch.randn(64, 256).bfloat16().requires_grad_()
    x = base[:, :128] if case == "strided x" else base[:, :128].detach().clone().requires_grad_()
    y = layer(x, _offs([30, 34]))
    with torch.no_grad():
        (base if case == "strided x" else x).mul_(2)
    if case == "kept":
        with pytest.raises(RuntimeError, match="inplace"):
            y.float().sum().backward()
    else:
        y.float().sum().backward()
        assert torch.isfinite(layer.fc2_weight.grad).all()


def test_grouped_mlp_fused_wgrad_accumulates_into_main_grad():
    torch.manual_seed(2)
    counts = [40, 60]
    layer = GroupedMLP(2, 64, 64, fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match="main_grad"):
        layer(torch.randn(100, 64).bfloat16(), _offs(counts))
    for w in (layer.fc1_weight, layer.fc2_weight):
        w.main_grad = torch.ones(w.shape)
    x = torch.randn(100, 64).bfloat16()
    layer(x, _offs(counts)).float().sum().backward()
    w1, w2 = (w.detach().clone().requires_grad_() for w in (layer.fc1_weight, layer.fc2_weight))
    expert_mlp_reference(x, counts, w1, w2, "swiglu").sum().backward()
    assert rel(layer.fc1_weight.main_grad - 1, w1.grad) < 0.03 and rel(layer.fc2_weight.main_grad - 1, w2.grad) < 0.03


@pytest.mark.parametrize("fp8", [None, "block", "row"])
@pytest.mark.parametrize("module", ["GroupedMLP", "GroupedLinear"])
def test_overwrite_main_grad_writes_it_without_reading(fp8, module):
    """A weight with overwrite_main_grad = True (TransformerEngine's flag, set by Megatron-FSDP)
    gets its gradient written into main_grad, not added: NaN there beforehand is gone, an expert
    without tokens reads zeros; the flag off still accumulates."""
    from distgemm.nn import GroupedLinear

    torch.manual_seed(3)
    counts = [70, 0, 131]
    offs = _offs(counts)
    if module == "GroupedMLP":
        layer = GroupedMLP(3, 128, 144, fp8=fp8, fuse_wgrad_accumulation=True)
        weights = (layer.fc1_weight, layer.fc2_weight)
    else:
        layer = GroupedLinear(3, 128, 256, fp8=fp8, fuse_wgrad_accumulation=True)
        weights = (layer.weight,)
    x = torch.randn(sum(counts), 128).bfloat16()
    dy = torch.randn(sum(counts), 128 if module == "GroupedMLP" else 256).bfloat16()
    for w in weights:
        w.main_grad = torch.full(w.shape, float("nan"))
        w.overwrite_main_grad = True
    layer(x, offs).backward(dy)
    first = [w.main_grad.clone() for w in weights]
    for w in weights:
        assert torch.isfinite(w.main_grad).all()
        assert torch.all(w.main_grad[1] == 0)
    if module == "GroupedMLP":
        ws = [w.detach().clone().requires_grad_() for w in weights]
        expert_mlp_reference(x, counts, *ws, "swiglu").backward(dy.float())
        for w, r in zip(weights, ws):
            assert rel(w.main_grad, r.grad) < GRAD_BAND[fp8]
    layer(x, offs).backward(dy)  # overwritten again: the same gradient, not twice it
    for w, f in zip(weights, first):
        assert torch.equal(w.main_grad, f)
    for w in weights:
        w.overwrite_main_grad = False
    layer(x, offs).backward(dy)
    for w, f in zip(weights, first):
        assert torch.allclose(w.main_grad, 2 * f, rtol=1e-5, atol=1e-6)


def test_grouped_mlp_refuses_bad_arguments():
    with pytest.raises(ValueError, match="activation"):
        GroupedMLP(2, 64, 64, activation="relu")
    with pytest.raises(ValueError, match="fp8"):
        GroupedMLP(2, 64, 64, fp8="tensor")
    with pytest.raises(ValueError, match="ffn"):
        GroupedMLP(2, 64, 0)
    layer = GroupedMLP(2, 64, 32)
    x = torch.randn(10, 64).bfloat16()
    with pytest.raises(ValueError, match="offs"):
        layer(x, torch.tensor([5, 10]))
    with pytest.raises(ValueError, match="hidden"):
        layer(torch.randn(10, 48).bfloat16(), _offs([5, 5]))
    with pytest.raises(ValueError, match="fc1_weight"):
        moe.grouped_mlp(x, _offs([5, 5]), layer.fc2_weight.transpose(1, 2), layer.fc2_weight)
    with pytest.raises(ValueError, match="activation must be"):
        moe.activation(x, "tanh")
    with pytest.raises(ValueError, match="copies"):
        moe.quantize_weight(layer.fc1_weight, copies="all")
    with pytest.raises(TypeError, match="fp8_rows must be True or False, got a tensor"):
        moe.activation(x, "gelu", fp8_rows=torch.ones(2))
    with pytest.raises(TypeError, match="fuse_wgrad_accumulation must be True or False"):
        moe.grouped_mlp(x, _offs([5, 5]), layer.fc1_weight, layer.fc2_weight, fuse_wgrad_accumulation="yes")
    from distgemm.nn import GroupedLinear

    with pytest.raises(ValueError, match="GroupedLinear: num_experts must be an int >= 1, got tensor"):
        GroupedLinear(torch.ones(3), 16, 8)
    with pytest.raises(ValueError, match="GroupedLinear: out_features must be an int >= 1, got 0"):
        GroupedLinear(2, 16, 0)


def test_grouped_mlp_with_no_tokens():
    layer = GroupedMLP(3, 64, 64, fp8="block")
    x = torch.randn(0, 64).bfloat16().requires_grad_()
    y = layer(x, _offs([0, 0, 0]))
    y.float().sum().backward()
    assert y.shape == (0, 64) and x.grad.shape == (0, 64)


@pytest.mark.parametrize("fp8", [None, "block"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("x_grad", [False, True])
def test_no_tokens_give_the_parameters_zero_gradients(fp8, fused, x_grad):
    """A micro-batch without tokens (an expert-parallel rank the router sent none) still takes a
    backward, as GroupedLinear's and torch.nn.Linear's do: x and the parameters get zero
    gradients, a fused weight adds nothing into main_grad (Megatron-LM's placeholder where it
    asks for one). Before: the output did not depend on the parameters (no gradient; and when x
    needs none, backward raised)."""
    from distgemm.nn import MoEExperts

    experts = MoEExperts(3, 64, 32, fp8=fp8, bias=True, fuse_wgrad_accumulation=fused)
    layer = experts.experts
    for w in (layer.fc1_weight, layer.fc2_weight):
        w.main_grad = torch.ones(w.shape)
    layer.fc2_weight.grad_added_to_main_grad = False  # Megatron-LM's flag: a placeholder gradient comes back
    layer.fc2_weight.zero_out_wgrad = True
    x = torch.randn(0, 64).bfloat16().requires_grad_(x_grad)
    for out in (layer(x, _offs([0, 0, 0])),
                experts(x, torch.zeros(0, 2, dtype=torch.long), torch.rand(0, 2))):
        assert out.shape == (0, 64) and out.requires_grad
        out.float().sum().backward()
        assert (x.grad is not None) == x_grad and (not x_grad or x.grad.shape == (0, 64))
        for b in (layer.fc1_bias, layer.fc2_bias):
            assert b.grad is not None and b.grad.shape == b.shape and torch.all(b.grad == 0)
        if fused:
            assert layer.fc1_weight.grad is None
            assert layer.fc2_weight.grad_added_to_main_grad and torch.all(layer.fc2_weight.grad == 0)
            for w in (layer.fc1_weight, layer.fc2_weight):
                assert torch.all(w.main_grad == 1)
        else:
            for w in (layer.fc1_weight, layer.fc2_weight):
                assert w.grad is not None and w.grad.shape == w.shape and torch.all(w.grad == 0)
        layer.zero_grad()


@pytest.mark.parametrize("fp8", [None, "block"])
def test_no_tokens_overwrite_main_grad_with_zeros(fp8):
    """overwrite_main_grad on a micro-batch without tokens: main_grad holds this step's gradient,
    zero, not what it held before."""
    layer = GroupedMLP(3, 64, 32, fp8=fp8, fuse_wgrad_accumulation=True)
    for w in (layer.fc1_weight, layer.fc2_weight):
        w.main_grad, w.overwrite_main_grad = torch.full(w.shape, float("nan")), True
    layer(torch.randn(0, 64).bfloat16(), _offs([0, 0, 0])).float().sum().backward()
    for w in (layer.fc1_weight, layer.fc2_weight):
        assert torch.all(w.main_grad == 0)


def test_fp8_weight_arguments_are_checked():
    # Caller-made FP8 weight copies and the micro-batch flag: each mistake names its argument.
    from distgemm.nn import GroupedLinear

    x = torch.randn(10, 16).bfloat16()
    offs = torch.tensor([4, 10], dtype=torch.int32)
    w1, w2 = torch.randn(2, 8, 16).bfloat16(), torch.randn(2, 16, 8).bfloat16()  # GELU: fc1 (G, ffn, hidden)
    c1, c2 = moe.quantize_weight(w1), moe.quantize_weight(w2)
    with pytest.raises(ValueError, match="fp8_weights needs fp8="):
        moe.grouped_mlp(x, offs, w1, w2, activation="gelu", fp8_weights=(c1, c2))
    with pytest.raises(ValueError, match=r"fp8_weights must be \(fc1's, fc2's\)"):
        moe.grouped_mlp(x, offs, w1, w2, activation="gelu", fp8="block", fp8_weights=(1, 2, 3))
    with pytest.raises(ValueError, match=r"fp8_weights\[1\] must be quantize_weight's"):
        moe.grouped_mlp(x, offs, w1, w2, activation="gelu", fp8="block", fp8_weights=(c1, 2))
    with pytest.raises(ValueError, match=r"fp8_weights\[0\]\[0\] must be a float8_e4m3fn tensor of shape \(2, 8, 16\) on cpu"):
        moe.grouped_mlp(x, offs, w1, w2, activation="gelu", fp8="block", fp8_weights=(c2, c2))
    with pytest.raises(ValueError, match=r"fp8_weights\[1\] has no forward copy"):
        moe.grouped_mlp(x, offs, w1, w2, activation="gelu", fp8="block",
                        fp8_weights=(c1, moe.quantize_weight(w2, copies="dgrad")))
    with pytest.raises(ValueError, match="w must be bfloat16, float16 or float32, got torch.int32"):
        moe.quantize_weight(torch.ones(2, 32, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype must be torch.float8_e4m3fn or torch.float8_e5m2"):
        moe.quantize_weight(w1, dtype=torch.float16)
    layer = GroupedLinear(2, 16, 8, fp8="block")
    with pytest.raises(ValueError, match="is_first_microbatch must be None, True or False, got 'yes'"):
        layer(x, offs, is_first_microbatch="yes")
    with pytest.raises(ValueError, match=r"x must be a 2-D \(T, in_features=16\) tensor, got \(10, 12\)"):
        layer(torch.randn(10, 12).bfloat16(), offs)


@pytest.mark.parametrize("mistake", ["other recipe", "e5m2", "no scale", "scale of the other copy", "other device"])
@pytest.mark.parametrize("fp8", ["block", "row"])
def test_fp8_weights_of_another_recipe_or_dtype_are_named(fp8, mistake):
    """fp8_weights must be quantize_weight(w, fp8)'s: e4m3 copies with their recipe's scales.
    Before: row copies ran under fp8="block" at hidden = ffn = 128 (their (G, N) scales read as
    blocks), and the other mistakes failed deeper down without naming fp8_weights."""
    x = torch.randn(10, 128).bfloat16()
    offs = torch.tensor([4, 10], dtype=torch.int32)
    w1, w2 = torch.randn(2, 128, 128).bfloat16(), torch.randn(2, 128, 128).bfloat16()  # GELU
    other = "row" if fp8 == "block" else "block"
    c1 = list(moe.quantize_weight(w1, other if mistake == "other recipe" else fp8,
                                  dtype=torch.float8_e5m2 if mistake == "e5m2" else torch.float8_e4m3fn))
    if mistake == "no scale":
        c1[1] = None
    if mistake == "scale of the other copy":
        c1[3] = moe.quantize_weight(w1, other)[3]
    if mistake == "other device":
        c1 = [t.to("meta") for t in c1]
    with pytest.raises(ValueError, match=r"^distgemm\.moe\.grouped_mlp: fp8_weights\[0\]\[[0-3]\] must be"):
        moe.grouped_mlp(x, offs, w1, w2, activation="gelu", fp8=fp8, fp8_weights=(c1, moe.quantize_weight(w2, fp8)))


def test_a_malformed_main_grad_is_named():
    layer = GroupedMLP(2, 64, 32, fuse_wgrad_accumulation=True)
    layer.fc1_weight.main_grad = torch.zeros(layer.fc1_weight.shape)
    layer.fc2_weight.main_grad = torch.zeros(layer.fc2_weight.shape[::-1])  # transposed by mistake
    with pytest.raises(ValueError, match=r"grouped_mlp: fc2_weight.main_grad must be a contiguous float32 tensor "
                                         r"of shape \(2, 64, 32\) on cpu, got torch.float32 \(32, 64, 2\)"):
        layer(torch.randn(10, 64).bfloat16(), _offs([5, 5]))


def test_fp8_grouped_linear_names_a_dtype_it_cannot_quantize():
    from distgemm.nn import GroupedLinear

    layer = GroupedLinear(2, 16, 8, fp8="block").half()
    with pytest.raises(ValueError, match=r"GroupedLinear\(fp8='block'\): x and weight must be bfloat16"):
        layer(torch.randn(10, 16).half(), _offs([4, 6]))


@pytest.mark.parametrize("fp8", ["block", "row"])
def test_grouped_linear_save_original_input_gives_the_same_gradients(fp8):
    from distgemm.nn import GroupedLinear

    torch.manual_seed(6)
    counts = [40, 0, 100]
    x = torch.randn(sum(counts), 256).bfloat16()
    dy = torch.randn(sum(counts), 128).bfloat16()
    grads = []
    for save in (False, True):
        torch.manual_seed(7)
        layer = GroupedLinear(3, 256, 128, fp8=fp8, save_original_input=save)
        xi = x.clone().requires_grad_()
        layer(xi, _offs(counts)).backward(dy)
        grads.append((xi.grad, layer.weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8", [None, "block"])
def test_bias_gradients_leave_out_rows_past_the_last_expert(monkeypatch, fp8):
    """Rows past offs[-1] (a router's dropped copies) belong to no expert: the GEMMs leave them
    unwritten on the GPU (NaN here, as uninitialized memory may hold), and neither bias nor its
    gradient may see them. The gradients equal those of the layer run on the routed rows only."""
    real = moe.grouped_mm

    def unwritten_past_the_end(x, w, offs, **kwargs):
        y = real(x, w, offs, **kwargs)
        y[int(offs[-1]):] = float("nan")
        return y
    monkeypatch.setattr(moe, "grouped_mm", unwritten_past_the_end)
    torch.manual_seed(1)
    t, h, f, g = 300, 128, 128, 4
    offs = torch.tensor([60, 60, 170, 250], dtype=torch.int32)  # an empty expert, 50 rows past the end
    w1, w2 = (torch.randn(g, 2 * f, h) * 0.05).bfloat16(), (torch.randn(g, h, f) * 0.05).bfloat16()
    b1, b2 = torch.randn(g, 2 * f).bfloat16(), torch.randn(g, h).bfloat16()
    x, dy = torch.randn(t, h).bfloat16(), torch.randn(t, h).bfloat16()
    grads = []
    for rows in (t, 250):
        leaves = [p.clone().requires_grad_() for p in (x[:rows], w1, w2, b1, b2)]
        y = moe.grouped_mlp(leaves[0], offs, *leaves[1:3], fc1_bias=leaves[3], fc2_bias=leaves[4], fp8=fp8)
        y.backward(dy[:rows])
        grads.append([p.grad for p in leaves[1:]] + [leaves[0].grad[:250]])
    for name, a, b in zip(("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias", "x"), *grads):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("experts", [1, 3, 8, 9, 17])
def test_row_dgrad_copy_in_chunks_is_the_whole_transpose_quantized(experts):
    """quantize_weight(recipe="row")'s dgrad copy, made a few experts at a time (so its bf16
    transposed transient is not a second weight), is bit for bit quantize_fp8 of the whole
    transposed weight with one scale per output channel of the transpose."""
    from distgemm.quantize import quantize_fp8

    torch.manual_seed(experts)
    w = (torch.randn(experts, 48, 80) * torch.rand(experts, 1, 80) * 10).bfloat16()
    _, _, wt8, swt = moe.quantize_weight(w, "row", copies="dgrad")
    want8, want_s = quantize_fp8(w.transpose(1, 2).reshape(experts * 80, 48), "row")
    assert wt8.shape == (experts, 80, 48) and swt.shape == (experts, 80)
    assert torch.equal(wt8.view(torch.uint8), want8.view(experts, 80, 48).view(torch.uint8))
    assert torch.equal(swt, want_s.view(experts, 80))
