"""Property tests (hypothesis) of distgemm.moe's routing (route, permute, gather, unpermute), the
expert MLP with routing (grouped_mlp) and nn.MoEExperts on the CPU path, against plain PyTorch
written here: a stable sort for the routing, a per-slot FP32 loop for the layer. Forward and
backward, in bf16 and both FP8 recipes, with router drops (-1), experts without tokens, k = 1
and a token routed twice to one expert (two rows, two terms of its sum).

Bands (norm-wise relative error, tests.moe_reference.rel): bf16 rounds x, h, the activation and
y once each (2^-9 relative), so the output stays well under 2e-2; the gradients round dy, da
and dh too, hence 3e-2. FP8 e4m3 keeps 3 mantissa bits: each quantized operand (x, the weights,
the activation, dy, dh, per 1 x 128 / 128 x 128 blocks or per row) carries a relative error of
up to 2^-4 per element, about 0.036 RMS; the forward stacks four such operands (about 0.07 RMS),
the gradients six (about 0.09): 0.10 and 0.15, as tests/cpu/test_moe_cpu.py uses. Those bands
are statistical: a norm over a few rows, or over dot products of 8 to 24 terms, does not average
the rounding errors (one row of 96 values, or 21 rows of hidden = ffn = 8, reach 0.11), so with
fewer than 16 kept copies or a width under 32 FP8 is held to 0.3 only, which still catches a
wrong row, expert or scale (errors of order 1).
"""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from distgemm import moe  # noqa: E402
from distgemm.nn import MoEExperts  # noqa: E402
from tests.moe_reference import expert_mlp_reference, rel  # noqa: E402

OUT_BAND = {None: 0.02, "block": 0.10, "row": 0.10}
GRAD_BAND = {None: 0.03, "block": 0.15, "row": 0.15}
SMALL_FP8_BAND, FEW_ROWS, NARROW = 0.3, 16, 32
# Deterministic (derandomize): a failure reproduces from the printed case alone.
FUZZ = dict(deadline=None, derandomize=True, print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def routings(draw, max_tokens=300, max_k=8, max_experts=40):
    """A router's choice: sizes, the experts no token picks, the share of dropped copies, and
    whether some token picks one expert twice (a seed makes the tensors)."""
    experts = draw(st.integers(1, max_experts))
    return dict(tokens=draw(st.integers(0, max_tokens)), k=draw(st.integers(1, max_k)), experts=experts,
                unused=draw(st.sets(st.integers(0, experts - 1), max_size=experts - 1)),
                drop=draw(st.sampled_from([0.0, 0.0, 0.2, 0.6, 1.0])), twice=draw(st.booleans()),
                ids_dtype=draw(st.sampled_from([torch.int64, torch.int32])), seed=draw(st.integers(0, 2 ** 16)))


def make_ids(c):
    """topk_ids (T, k) and topk_weights (T, k) float32 for a case of routings()."""
    gen = torch.Generator().manual_seed(c["seed"])
    t, k, e = c["tokens"], c["k"], c["experts"]
    allowed = torch.tensor([g for g in range(e) if g not in c["unused"]])
    ids = allowed[torch.randint(len(allowed), (t, k), generator=gen)]
    if c["twice"] and k > 1 and t:
        ids[0, 1] = ids[0, 0]  # token 0 routed twice to one expert
    ids[torch.rand(t, k, generator=gen) < c["drop"]] = -1
    return ids.to(c["ids_dtype"]), torch.rand(t, k, generator=gen)


def reference_route(ids, num_experts):
    """(offs, row_map): slots grouped by expert in slot order, dropped slots last."""
    flat = ids.reshape(-1).tolist()
    key = [e if e >= 0 else num_experts for e in flat]
    row_map = sorted(range(len(flat)), key=lambda s: (key[s], s))
    counts = [key.count(g) for g in range(num_experts)]
    return torch.tensor(counts, dtype=torch.int64).cumsum(0), torch.tensor(row_map, dtype=torch.int64)


def per_slot_mlp(x, ids, w1, w2, kind, b1=None, b2=None):
    """Each slot's expert MLP of its token in FP32, (T * k, hidden), zero rows for dropped
    slots; autograd through x and the parameters."""
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    out = torch.zeros(flat.numel(), w2.shape[1])
    for g in range(w1.shape[0]):
        slots = torch.nonzero(flat == g).flatten()
        if slots.numel():
            bias = (None if b1 is None else b1[g:g + 1], None if b2 is None else b2[g:g + 1])
            y = expert_mlp_reference(x[slots // k], [slots.numel()], w1[g:g + 1], w2[g:g + 1], kind, *bias)
            out = out.index_copy(0, slots, y)
    return out


def combine(rows_per_slot, weights, kept):
    """out[t] = sum over kept j of weights[t, j] * rows_per_slot[t * k + j], in FP32."""
    t, k = kept.shape
    per_slot = torch.where(kept.unsqueeze(-1), rows_per_slot.float().view(t, k, rows_per_slot.shape[1]), 0.0)
    return (per_slot * weights.float().unsqueeze(-1)).sum(1)


def make_params(g, hidden, ffn, kind, bias, gen):
    width = 2 * ffn if kind == "swiglu" else ffn
    w1 = ((torch.rand(g, width, hidden, generator=gen) * 2 - 1) / hidden ** 0.5).bfloat16()
    w2 = ((torch.rand(g, hidden, ffn, generator=gen) * 2 - 1) / ffn ** 0.5).bfloat16()
    b1 = (torch.randn(g, width, generator=gen) * 0.5).bfloat16() if bias else None
    b2 = (torch.randn(g, hidden, generator=gen) * 0.5).bfloat16() if bias else None
    return w1, w2, b1, b2


def leaves(*tensors):
    """FP32 leaves holding the same values (None stays None)."""
    return [None if t is None else t.detach().float().clone().requires_grad_() for t in tensors]


def grad_or_zeros(t):
    return torch.zeros_like(t) if t.grad is None else t.grad


def bands(fp8, kept, hidden, ffn):
    """(output band, gradient band) for a layer run with `kept` routed copies."""
    if fp8 is not None and (kept < FEW_ROWS or min(hidden, ffn) < NARROW):
        return SMALL_FP8_BAND, SMALL_FP8_BAND
    return OUT_BAND[fp8], GRAD_BAND[fp8]


def check_close(name, got, want, band):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: not finite"
    err = rel(got, want)
    assert err < band, f"{name}: relative error {err:.4f} >= {band}"


# ---------------------------------------------------------------- routing


@settings(max_examples=200, **FUZZ)
@given(c=routings(), hidden=st.integers(1, 32).map(lambda n: 8 * n), dtype=st.sampled_from([torch.float32,
                                                                                          torch.bfloat16]))
@example(c=dict(tokens=3, k=2, experts=2, unused=set(), drop=0.0, twice=True, ids_dtype=torch.int64, seed=0),
         hidden=8, dtype=torch.float32)
@example(c=dict(tokens=5, k=1, experts=3, unused={1}, drop=1.0, twice=False, ids_dtype=torch.int32, seed=1),
         hidden=16, dtype=torch.bfloat16)
def test_route_permute_gather_match_a_stable_sort(c, hidden, dtype):
    ids, _ = make_ids(c)
    t, k, e = c["tokens"], c["k"], c["experts"]
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    x = torch.randn(t, hidden, generator=gen).to(dtype).requires_grad_()
    offs, row_map = reference_route(ids, e)
    routing = moe.route(ids, e)
    assert routing.offs.dtype == torch.int32 and torch.equal(routing.offs.long(), offs)
    assert routing.k == k and torch.equal(routing.row_map.long(), row_map)
    end = int(offs[-1]) if e else 0
    flat = ids.reshape(-1).long()
    kept = flat[row_map] >= 0
    assert torch.equal(routing.source, torch.where(kept, row_map // k, -1))
    rows_of_slot = torch.empty_like(row_map)
    rows_of_slot[row_map] = torch.arange(row_map.numel())
    assert torch.equal(routing.token_rows, torch.where(flat >= 0, rows_of_slot, -1 - rows_of_slot))

    p = moe.permute(x, ids, e)
    assert torch.equal(p.offs, routing.offs) and torch.equal(p.row_map, routing.row_map)
    want = x.detach()[row_map // k] if t else x.new_zeros((0, hidden))
    assert torch.equal(p.rows[:end], want[:end]), "rows in expert order"
    assert torch.all(p.rows[end:] == 0), "dropped copies are zero rows"
    gathered = moe.gather(x, routing)
    assert torch.equal(gathered.detach(), p.rows.detach())

    # Backward: each token's kept rows summed; a dropped copy's row reaches nothing.
    dy = torch.randn(t * k, hidden, generator=gen).to(dtype)
    dx, = torch.autograd.grad(p.rows, x, dy)
    dx_gather, = torch.autograd.grad(gathered, x, dy)
    slot_grad = torch.where((flat >= 0).unsqueeze(1), dy.float()[rows_of_slot], 0.0) if t else dy.float()
    want_dx = slot_grad.view(t, k, hidden).sum(1)
    assert torch.isfinite(dx).all()
    assert torch.allclose(dx.float(), want_dx, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    assert torch.equal(dx, dx_gather)
    all_dropped = (ids < 0).all(1)
    assert torch.all(dx[all_dropped] == 0), "a token the router dropped got a gradient"

    if dtype == torch.bfloat16:  # the FP8 rows are quantize_fp8 of the bf16 rows, zeros after offs[-1]
        from distgemm import quantize_fp8

        for recipe, granularity in (("block", (1, 128)), ("row", "row")):
            p8 = moe.permute(x.detach(), ids, e, fp8=recipe)
            r8, s = quantize_fp8(p.rows.detach(), granularity)
            assert torch.equal(p8.rows_fp8.view(torch.uint8), r8.view(torch.uint8)), recipe
            assert torch.equal(p8.scale, s), recipe


@settings(max_examples=200, **FUZZ)
@given(c=routings(), hidden=st.integers(1, 32).map(lambda n: 8 * n), dtype=st.sampled_from([torch.float32,
                                                                                          torch.bfloat16]),
       with_ids=st.booleans())
@example(c=dict(tokens=2, k=2, experts=2, unused=set(), drop=0.0, twice=True, ids_dtype=torch.int64, seed=3),
         hidden=8, dtype=torch.float32, with_ids=True)
def test_unpermute_is_the_weighted_sum_of_each_tokens_rows(c, hidden, dtype, with_ids):
    ids, weights = make_ids(c)
    t, k, e = c["tokens"], c["k"], c["experts"]
    gen = torch.Generator().manual_seed(c["seed"] + 2)
    routing = moe.route(ids, e)
    end = int(routing.offs[-1])
    y = torch.randn(t * k, hidden, generator=gen).to(dtype)
    if with_ids:  # rows past offs[-1] are whatever the GEMMs left there: must not reach anything
        y[end:] = float("nan")
    else:  # without ids every slot counts: the dropped copies' rows are permute's zeros
        y[end:] = 0
    y.requires_grad_()
    w = weights.clone().requires_grad_()
    args = (ids, e) if with_ids else ()
    out = moe.unpermute(y, routing.row_map, w, *args)
    assert out.dtype == dtype and out.shape == (t, hidden)

    yr, wr = leaves(y, weights)
    slot_rows = torch.empty_like(routing.row_map)
    slot_rows[routing.row_map] = torch.arange(t * k)
    ref = combine(yr[slot_rows], wr, ids >= 0 if with_ids else torch.ones_like(ids, dtype=torch.bool))
    tol = dict(rtol=2 ** -7, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all(), "a dropped copy's row reached the output"
    assert torch.allclose(out.float(), ref.detach(), **tol)

    g = torch.randn(t, hidden, generator=gen).to(dtype)
    out.backward(g)
    if ref.requires_grad:  # else no copy is kept: every gradient is zero
        ref.backward(g.float())
    for name, got, want in (("y", y.grad, yr.grad), ("topk_weights", w.grad, wr.grad)):
        assert torch.isfinite(got).all(), name
        assert torch.allclose(got.float(), want, **tol), name
    if with_ids:
        assert torch.all(y.grad[end:] == 0), "a dropped copy's row got a gradient"
        assert torch.all(w.grad[ids < 0] == 0), "a dropped copy's weight got a gradient"


# ---------------------------------------------------------------- the layer

MLP_SIZES = dict(max_tokens=300, max_k=8, max_experts=40)
widths = st.integers(1, 32).map(lambda n: 8 * n)


def run_grouped_mlp(c, hidden, ffn, kind, bias, fp8):
    """grouped_mlp(..., routing=) and the per-slot reference: output rows and gradients."""
    ids, _ = make_ids(c)
    t, k, e = c["tokens"], c["k"], c["experts"]
    gen = torch.Generator().manual_seed(c["seed"] + 3)
    params = make_params(e, hidden, ffn, kind, bias, gen)
    x = torch.randn(t, hidden, generator=gen).bfloat16()
    dy = torch.randn(t * k, hidden, generator=gen).bfloat16()
    xs = [p if p is None else p.clone().requires_grad_() for p in (x,) + params]
    routing = moe.route(ids, e)
    y = moe.grouped_mlp(xs[0], routing.offs, xs[1], xs[2], activation=kind, fc1_bias=xs[3], fc2_bias=xs[4],
                        fp8=fp8, routing=routing)
    y.backward(dy)
    refs = leaves(x, *params)
    slot_out = per_slot_mlp(refs[0], ids, *refs[1:3], kind, *refs[3:])
    end = int(routing.offs[-1])
    row_map = routing.row_map
    ref_rows = slot_out[row_map[:end]]  # the kept rows, in the order route() gives (checked above)
    if ref_rows.requires_grad:  # else no row is kept: every gradient is zero
        ref_rows.backward(dy[:end].float())
    return ids, y, end, ref_rows, xs, refs


@pytest.mark.parametrize("fp8", [None, "block", "row"])
@settings(max_examples=100, **FUZZ)
@given(c=routings(**MLP_SIZES), hidden=widths, ffn=widths, kind=st.sampled_from(["swiglu", "gelu"]),
       bias=st.booleans())
@example(c=dict(tokens=40, k=2, experts=3, unused={1}, drop=0.2, twice=True, ids_dtype=torch.int64, seed=5),
         hidden=136, ffn=200, kind="swiglu", bias=True)
@example(c=dict(tokens=9, k=1, experts=2, unused=set(), drop=1.0, twice=False, ids_dtype=torch.int64, seed=6),
         hidden=64, ffn=24, kind="gelu", bias=True)
def test_grouped_mlp_with_routing_matches_the_per_slot_loop(fp8, c, hidden, ffn, kind, bias):
    ids, y, end, ref_rows, xs, refs = run_grouped_mlp(c, hidden, ffn, kind, bias, fp8)
    assert y.shape == (c["tokens"] * c["k"], hidden) and y.dtype == torch.bfloat16
    out_band, grad_band = bands(fp8, end, hidden, ffn)
    check_close("y", y[:end], ref_rows.detach(), out_band)
    for name, got, ref in zip(("x", "fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"), xs, refs):
        if got is not None:
            check_close(f"d{name}", grad_or_zeros(got), grad_or_zeros(ref), grad_band)
    dropped = (ids < 0).all(1)
    assert torch.all(grad_or_zeros(xs[0])[dropped] == 0), "a token the router dropped got a gradient"
    unused = torch.tensor(sorted(set(range(c["experts"])) - set(ids.flatten().tolist())), dtype=torch.long)
    for p in xs[1:]:
        if p is not None:
            assert torch.all(grad_or_zeros(p)[unused] == 0), "an expert without tokens got a gradient"


@pytest.mark.parametrize("fp8", [None, "block", "row"])
@settings(max_examples=100, **FUZZ)
@given(c=routings(**MLP_SIZES), hidden=widths, ffn=widths, kind=st.sampled_from(["swiglu", "gelu"]),
       bias=st.booleans(), save_input=st.booleans(), first=st.sampled_from([None, True]),
       w_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
@example(c=dict(tokens=30, k=3, experts=4, unused={2}, drop=0.2, twice=True, ids_dtype=torch.int32, seed=7),
         hidden=200, ffn=72, kind="gelu", bias=True, save_input=True, first=True, w_dtype=torch.float32)
@example(c=dict(tokens=0, k=2, experts=3, unused=set(), drop=0.0, twice=False, ids_dtype=torch.int64, seed=8),
         hidden=32, ffn=16, kind="swiglu", bias=False, save_input=False, first=None, w_dtype=torch.bfloat16)
def test_moe_experts_matches_the_per_slot_loop(fp8, c, hidden, ffn, kind, bias, save_input, first, w_dtype):
    check_moe_experts(fp8, c, hidden, ffn, kind, bias, save_input, first, w_dtype)


def check_moe_experts(fp8, c, hidden, ffn, kind, bias, save_input, first, w_dtype, device="cpu"):
    """MoEExperts on `device` (its inputs drawn on the host) against the per-slot FP32 loop on
    the host: the output and every gradient (tests/gpu/test_moe_fuzz_gpu.py runs it on the GPU)."""
    ids, weights = make_ids(c)
    weights = weights.to(w_dtype)
    t, e = c["tokens"], c["experts"]
    gen = torch.Generator().manual_seed(c["seed"] + 4)
    layer = MoEExperts(e, hidden, ffn, activation=kind, bias=bias, fp8=fp8, save_original_input=save_input,
                       device=device)
    mlp = layer.experts
    params = make_params(e, hidden, ffn, kind, bias, gen)
    with torch.no_grad():
        for p, v in zip((mlp.fc1_weight, mlp.fc2_weight, mlp.fc1_bias, mlp.fc2_bias), params):
            if p is not None:
                p.copy_(v)
    x_host = torch.randn(t, hidden, generator=gen).bfloat16()
    g = torch.randn(t, hidden, generator=gen).bfloat16()
    x = x_host.to(device).requires_grad_()
    w = weights.to(device).requires_grad_()
    # is_first_microbatch=True: the layer's cached FP8 copies
    out = layer(x, ids.to(device), w, is_first_microbatch=first if fp8 else None)
    assert out.shape == (t, hidden) and out.dtype == torch.bfloat16
    out.backward(g.to(device))

    refs = leaves(x_host, *params)
    wr, = leaves(weights)
    slot_out = per_slot_mlp(refs[0], ids, *refs[1:3], kind, *refs[3:])
    ref = combine(slot_out, wr, ids >= 0)
    if ref.requires_grad:  # else no copy is kept: every gradient is zero
        ref.backward(g.float())
    out_band, grad_band = bands(fp8, int((ids >= 0).sum()), hidden, ffn)
    check_close("out", out.cpu(), ref.detach(), out_band)
    got = [x, mlp.fc1_weight, mlp.fc2_weight, mlp.fc1_bias, mlp.fc2_bias]
    for name, p, r in zip(("x", "fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"), got, refs):
        if p is not None:
            check_close(f"d{name}", grad_or_zeros(p).cpu(), grad_or_zeros(r), grad_band)
    # d topk_weights[t, j] = <g[t], y of slot (t, j)>: a dot product that may cancel, so its
    # error is measured against |g[t]| |y of the slot| (Cauchy-Schwarz), the slot row's own scale.
    dw = grad_or_zeros(w).float().cpu()
    assert torch.isfinite(dw).all(), "dtopk_weights: not finite"
    scale = g.float().norm(dim=1, keepdim=True) * slot_out.detach().view(t, c["k"], hidden).norm(dim=2)
    err = float((dw - grad_or_zeros(wr)).norm() / scale.norm().clamp_min(1e-30))
    assert err < grad_band, f"dtopk_weights: error {err:.4f} of |g| |y| >= {grad_band}"
    assert torch.all(grad_or_zeros(x).cpu()[(ids < 0).all(1)] == 0), "a token the router dropped got a gradient"
    assert torch.all(grad_or_zeros(w).cpu()[ids < 0] == 0), "a dropped copy's weight got a gradient"
    assert w.grad is None or w.grad.dtype == w_dtype
    unused = torch.tensor(sorted(set(range(e)) - set(ids.flatten().tolist())), dtype=torch.long)
    for p in got[1:]:
        if p is not None:
            assert torch.all(grad_or_zeros(p).cpu()[unused] == 0), "an expert without tokens got a gradient"
