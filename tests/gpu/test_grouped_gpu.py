"""Grouped GEMMs on one GPU against a per-group FP64 reference: random and degenerate
routing, G from 1 to 1024, every compiled configuration, all backends, accumulate,
bounds safety with bad offsets, CUDA-graph replay with new routing, torch.compile and
GroupedLinear."""

import pytest
import torch

import distgemm
from distgemm._library import device_arch, ops
from distgemm.nn import GroupedLinear
from tests.reference import assert_close, make_offs, random_counts

pytestmark = pytest.mark.gpu
DEV = "cuda"


def ref_forward(x, w, counts, trans_w=True):
    out, s = torch.zeros(x.shape[0], w.shape[1] if trans_w else w.shape[2], dtype=torch.float64, device=DEV), 0
    for g, c in enumerate(counts):
        wg = w[g].double()
        out[s:s + c] = x[s:s + c].double() @ (wg.T if trans_w else wg)
        s += c
    return out


def ref_wgrad(dy, x, counts):
    out, s = torch.zeros(len(counts), dy.shape[1], x.shape[1], dtype=torch.float64, device=DEV), 0
    for g, c in enumerate(counts):
        out[g] = dy[s:s + c].double().T @ x[s:s + c].double()
        s += c
    return out


CASES = {
    "random": (8, 1000, ()),
    "zero_groups": (6, 777, (0, 3, 5)),
    "one_huge_group": (4, 4096, (0, 1, 2)),
    "g1": (1, 333, ()),
    "g1024": (1024, 20000, tuple(range(0, 1024, 7))),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_dgrad_wgrad(case, dtype):
    g, t, zeros = CASES[case]
    counts = random_counts(g, t, zeros)
    offs = make_offs(counts)
    n, k = 264, 128
    x = torch.randn(t, k, device=DEV).to(dtype)
    w = (torch.randn(g, n, k, device=DEV) * 0.1).to(dtype)
    dy = torch.randn(t, n, device=DEV).to(dtype)
    y = distgemm.grouped_mm(x, w, offs)
    assert y.dtype == dtype
    assert_close(y, ref_forward(x, w, counts))
    assert_close(distgemm.grouped_mm(x, w, offs, out_dtype=torch.float32), ref_forward(x, w, counts))
    dx = distgemm.grouped_mm(dy, w, offs, trans_w=False)
    assert_close(dx, ref_forward(dy, w, counts, trans_w=False))
    dw = distgemm.grouped_mm_wgrad(dy, x, offs)
    assert dw.dtype == torch.float32
    for e in zeros:
        assert torch.all(dw[e] == 0), f"empty group {e} not zeroed"
    assert_close(dw, ref_wgrad(dy, x, counts))


def test_all_groups_empty():
    g, n, k = 4, 64, 32
    x = torch.randn(16, k, device=DEV).bfloat16()
    w = torch.randn(g, n, k, device=DEV).bfloat16()
    offs = torch.zeros(g, dtype=torch.int32, device=DEV)
    out = torch.full((16, n), 3.0, device=DEV)
    distgemm.grouped_mm(x, w, offs, out=out)
    assert torch.all(out == 3.0)  # no rows belong to any group: untouched
    dw = distgemm.grouped_mm_wgrad(torch.randn(16, n, device=DEV).bfloat16(), x, offs)
    assert torch.all(dw == 0)
    main_grad = torch.ones(g, n, k, device=DEV)
    distgemm.grouped_mm_wgrad(torch.randn(16, n, device=DEV).bfloat16(), x, offs, out=main_grad, accumulate=True)
    assert torch.all(main_grad == 1)


def test_accumulate_into_fp32_main_grad_and_out():
    g, t, n, k = 5, 600, 128, 256
    counts = random_counts(g, t, (2,))
    offs = make_offs(counts)
    x, dy = torch.randn(t, k, device=DEV).bfloat16(), torch.randn(t, n, device=DEV).bfloat16()
    main_grad = torch.randn(g, n, k, device=DEV)
    expected = main_grad.double() + ref_wgrad(dy, x, counts)
    distgemm.grouped_mm_wgrad(dy, x, offs, out=main_grad, accumulate=True)
    assert_close(main_grad, expected)
    w = torch.randn(g, n, k, device=DEV).bfloat16()
    out = torch.randn(t, n, device=DEV)
    expected = out.double() + ref_forward(x, w, counts)
    distgemm.grouped_mm(x, w, offs, out=out, accumulate=True)
    assert_close(out, expected)


# n 600: three 256-wide N tiles, so a cluster of two along N computes a fourth, wholly out of bounds.
@pytest.mark.parametrize("n,k", [(392, 200), (600, 136)])
@pytest.mark.parametrize("kind,out_dtype", [(0, torch.bfloat16), (0, torch.float32), (1, torch.bfloat16),
                                            (2, torch.float32), (2, torch.bfloat16)])
def test_every_config(kind, out_dtype, n, k):
    names = ops.grouped_configs(kind, torch.bfloat16, out_dtype, device_arch(torch.device(DEV)))
    assert names
    counts = random_counts(7, 1500, (4,))
    offs = make_offs(counts)
    x = torch.randn(1500, k, device=DEV).bfloat16()
    # Into NaN-filled outputs: an element a config leaves unwritten fails the comparison instead
    # of passing with the previous config's (equal) result in recycled memory.
    if kind == 2:
        dy = torch.randn(1500, n, device=DEV).bfloat16()
        for config in range(len(names)):
            out = torch.full((7, n, k), float("nan"), device=DEV, dtype=out_dtype)
            ops.grouped_mm_wgrad_out(dy, x, offs, out, False, 0, config)
            assert_close(out, ref_wgrad(dy, x, counts))
    else:
        w = torch.randn(7, n, k, device=DEV).bfloat16() if kind == 0 else torch.randn(7, k, n, device=DEV).bfloat16()
        for config in range(len(names)):
            out = torch.full((1500, n), float("nan"), device=DEV, dtype=out_dtype)
            ops.grouped_mm_out(x, w, offs, out, False, kind == 0, 0, config)
            assert_close(out, ref_forward(x, w, counts, trans_w=kind == 0))


def test_repeated_calls_of_a_config_follow_their_arguments():
    """A config called again with the same arrays reuses the kernel parameters CUTLASS made for
    the last call; any argument they depend on (accumulation, group count, outputs, routing)
    changing between calls of the same config must still give that call's result: a sequence
    of calls per config, each against the reference, into NaN-filled outputs."""
    names = ops.grouped_configs(2, torch.bfloat16, torch.float32, device_arch(torch.device(DEV)))
    fwd_names = ops.grouped_configs(0, torch.bfloat16, torch.bfloat16, device_arch(torch.device(DEV)))
    n, k = 200, 136
    torch.manual_seed(3)
    problems = []
    for groups, tokens in ((5, 700), (5, 700), (9, 700), (5, 333)):
        counts = random_counts(groups, tokens, (1,))
        problems.append((groups, counts, make_offs(counts), torch.randn(tokens, n, device=DEV).bfloat16(),
                         torch.randn(tokens, k, device=DEV).bfloat16()))
    for config, name in enumerate(names):
        for i, (groups, counts, offs, dy, x) in enumerate(problems):
            for accumulate in (False, True, False):
                start = torch.randn(groups, n, k, device=DEV)
                out = start.clone() if accumulate else torch.full((groups, n, k), float("nan"), device=DEV)
                ops.grouped_mm_wgrad_out(dy, x, offs, out, accumulate, 0, config)
                assert_close(out, ref_wgrad(dy, x, counts) + (start.double() if accumulate else 0)), (name, i)
    for config, name in enumerate(fwd_names):
        for i, (groups, counts, offs, dy, x) in enumerate(problems):
            w = torch.randn(groups, n, k, device=DEV).bfloat16()
            for _ in range(2):
                out = torch.full((x.shape[0], n), float("nan"), device=DEV).bfloat16()
                ops.grouped_mm_out(x, w, offs, out, False, True, 0, config)
                assert_close(out, ref_forward(x, w, counts)), (name, i)


@pytest.mark.parametrize("kind", [0, 1])
def test_every_config_accumulates_bf16(kind):
    """accumulate=True into a bf16 out, every forward / dgrad config: one rounding of out + x @ w."""
    names = ops.grouped_configs(kind, torch.bfloat16, torch.bfloat16, device_arch(torch.device(DEV)))
    n, k, t = 264, 136, 1100
    counts = random_counts(5, t, (1,))
    offs = make_offs(counts)
    x = torch.randn(t, k, device=DEV).bfloat16()
    w = torch.randn(5, n, k, device=DEV).bfloat16() if kind == 0 else torch.randn(5, k, n, device=DEV).bfloat16()
    start = torch.randn(t, n, device=DEV).bfloat16()
    expected = start.double() + ref_forward(x, w, counts, trans_w=kind == 0)
    for config in range(len(names)):
        out = start.clone()
        ops.grouped_mm_out(x, w, offs, out, True, kind == 0, 0, config)
        assert_close(out, expected)


def contiguous_configs(kind):
    names = ops.grouped_configs(kind, torch.bfloat16, torch.bfloat16, device_arch(torch.device(DEV)))
    return [(i, name) for i, name in enumerate(names) if name.startswith("contig_")]


@pytest.mark.parametrize("groups,tokens", [(3, 5), (33, 3001), (300, 4000), (2000, 2500)])
@pytest.mark.parametrize("kind", [0, 1])
def test_contiguous_kernel_ragged_routing(kind, groups, tokens):
    """The contiguous-token kernel walks the offsets itself, 32 groups a step: G across that
    step, groups of 0, 1 and more rows than a tile, a tile straddling two groups; each group
    checked on its own, and the rows around out untouched."""
    configs = contiguous_configs(kind)
    assert configs, "no contiguous-token grouped kernel in this build"
    n, k = 200, 72  # N not a multiple of any tile; K one partial 64-wide step past the first
    torch.manual_seed(groups)
    counts = random_counts(groups, tokens, tuple(range(0, groups, 3)))
    offs = make_offs(counts)
    x = torch.randn(tokens, k, device=DEV).bfloat16()
    w = (torch.randn(groups, n, k, device=DEV) if kind == 0 else torch.randn(groups, k, n, device=DEV)).bfloat16()
    ref = ref_forward(x, w, counts, trans_w=kind == 0)
    for config, name in configs:
        storage = torch.full((tokens + 256, n), 7.0, device=DEV, dtype=torch.bfloat16)
        out = storage[128:128 + tokens]
        out.fill_(float("nan"))
        ops.grouped_mm_out(x, w, offs, out, False, kind == 0, 0, config)
        assert torch.all(storage[:128] == 7.0) and torch.all(storage[128 + tokens:] == 7.0), name
        s = 0
        for g, c in enumerate(counts):
            if c:
                assert_close(out[s:s + c], ref[s:s + c])
            s += c


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("groups,tokens", [(3, 5), (33, 3001), (300, 4000), (40, 0)])
def test_wgrad_ragged_routing_every_config(groups, tokens, accumulate):
    """Every FP32 wgrad config (the contiguous-token one too, in a build with the sweep's
    instances) on ragged routing: experts of 0, 1, fewer than one 64-token step and many steps,
    a reduction whose last step's tail belongs to the next expert or lies past T; the outputs
    around out untouched, zero-token experts zero (or, accumulating, unchanged)."""
    names = ops.grouped_configs(2, torch.bfloat16, torch.float32, device_arch(torch.device(DEV)))
    assert names
    n, k = 200, 136  # neither a multiple of the 128-wide tiles
    torch.manual_seed(groups + tokens)
    counts = random_counts(groups, tokens, tuple(range(0, groups, 3))) if tokens else [0] * groups
    offs = make_offs(counts)
    dy = torch.randn(tokens, n, device=DEV).bfloat16()
    x = torch.randn(tokens, k, device=DEV).bfloat16()
    start = torch.randn(groups, n, k, device=DEV)
    expected = ref_wgrad(dy, x, counts) + (start.double() if accumulate else 0)
    for config, name in enumerate(names):
        storage = torch.full((groups + 2, n, k), 7.0, device=DEV)
        out = storage[1:1 + groups]
        out.copy_(start) if accumulate else out.fill_(float("nan"))
        ops.grouped_mm_wgrad_out(dy, x, offs, out, accumulate, 0, config)
        assert torch.all(storage[0] == 7.0) and torch.all(storage[-1] == 7.0), name
        for g in range(groups):  # each expert alone: a small one's error shows
            assert_close(out[g], expected[g])


@pytest.mark.parametrize("accumulate", [False, True])
def test_wgrad_every_config_keeps_other_tokens_out(accumulate):
    """A wgrad reduces over its expert's tokens only: a NaN in the rows past offs[-1] or an Inf
    in another expert's rows reaches no other expert's gradient (a kernel that reads past the
    expert and zeroes one operand's extra tokens only gets 0 * Inf = NaN; the fuzz's NaN tail
    found this in the contiguous-token wgrad)."""
    names = ops.grouped_configs(2, torch.bfloat16, torch.float32, device_arch(torch.device(DEV)))
    counts, tail = [37, 50, 0, 20], 11  # no expert a multiple of the 64-token step
    routed, n, k = sum(counts), 200, 136
    torch.manual_seed(3)
    dy = torch.randn(routed + tail, n, device=DEV).bfloat16()
    x = torch.randn(routed + tail, k, device=DEV).bfloat16()
    dy[routed:] = float("nan")
    x[routed:] = float("nan")
    dy[counts[0] + 5, 7] = float("inf")  # expert 1's own gradient is not finite; the others are
    offs = make_offs(counts)
    start = torch.randn(len(counts), n, k, device=DEV)
    expected = ref_wgrad(dy[:routed], x[:routed], counts) + (start.double() if accumulate else 0)
    for config, name in enumerate(names):
        out = start.clone() if accumulate else torch.full_like(start, float("nan"))
        ops.grouped_mm_wgrad_out(dy, x, offs, out, accumulate, 0, config)
        for g in (0, 2, 3):
            assert bool(torch.isfinite(out[g]).all()), (name, g)
            assert_close(out[g], expected[g])


@pytest.mark.parametrize("backend", ["cutlass", "cublas", "torch"])
def test_backends_agree(backend, use_settings):
    use_settings(grouped_backend=backend)
    counts = random_counts(6, 900, (1,))
    offs = make_offs(counts)
    x, w = torch.randn(900, 256, device=DEV).bfloat16(), torch.randn(6, 512, 256, device=DEV).bfloat16()
    dy = torch.randn(900, 512, device=DEV).bfloat16()
    assert_close(distgemm.grouped_mm(x, w, offs), ref_forward(x, w, counts))
    assert_close(distgemm.grouped_mm(dy, w, offs, trans_w=False), ref_forward(dy, w, counts, False))
    assert_close(distgemm.grouped_mm_wgrad(dy, x, offs), ref_wgrad(dy, x, counts))


def test_bad_offsets_never_write_out_of_bounds():
    t, n, k = 256, 64, 64
    x, w = torch.randn(t, k, device=DEV).bfloat16(), torch.randn(3, n, k, device=DEV).bfloat16()
    storage = torch.full((t + 64, n), 5.0, device=DEV, dtype=torch.bfloat16)
    out = storage[32:32 + t]
    offs = torch.tensor([100, 50, 10_000], dtype=torch.int32, device=DEV)  # decreasing, then past T
    distgemm.grouped_mm(x, w, offs, out=out)
    torch.cuda.synchronize()
    assert torch.all(storage[:32] == 5.0) and torch.all(storage[32 + t:] == 5.0)
    # clamped bounds: group 0 rows 0..100, group 1 empty (50 < 100), group 2 rows 50..256
    assert_close(out[:50], ref_forward(x[:50], w[:1], [50]))
    main_grad = torch.zeros(3, n, k, device=DEV)
    distgemm.grouped_mm_wgrad(torch.randn(t, n, device=DEV).bfloat16(), x, offs, out=main_grad, accumulate=True)
    assert torch.isfinite(main_grad).all()


def test_cuda_graph_replay_with_new_routing():
    g, t, n, k = 8, 2048, 256, 128
    x = torch.randn(t, k, device=DEV).bfloat16()
    w = torch.randn(g, n, k, device=DEV).bfloat16()
    dy = torch.randn(t, n, device=DEV).bfloat16()
    offs = make_offs(random_counts(g, t))
    distgemm.grouped_mm(x, w, offs)
    distgemm.grouped_mm_wgrad(dy, x, offs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = distgemm.grouped_mm(x, w, offs)
        dw = distgemm.grouped_mm_wgrad(dy, x, offs)
    for step in range(4):
        counts = random_counts(g, t, (step,))
        offs.copy_(make_offs(counts))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(y, ref_forward(x, w, counts))
        assert_close(dw, ref_wgrad(dy, x, counts))


def test_torch_compile_fullgraph():
    g, t, n, k = 4, 512, 128, 64
    counts = random_counts(g, t)
    offs = make_offs(counts)
    x, w = torch.randn(t, k, device=DEV).bfloat16(), torch.randn(g, n, k, device=DEV).bfloat16()
    f = torch.compile(lambda x, w, offs: torch.nn.functional.silu(distgemm.grouped_mm(x, w, offs)), fullgraph=True)
    assert_close(f(x, w, offs), torch.nn.functional.silu(ref_forward(x, w, counts)))


@pytest.mark.parametrize("fuse_wgrad", [False, True])
def test_grouped_linear_matches_linear_loop(fuse_wgrad):
    g, t, din, dout = 6, 1200, 256, 512
    counts = random_counts(g, t, (2,))
    offs = make_offs(counts)
    layer = GroupedLinear(g, din, dout, bias=True, device=DEV, fuse_wgrad_accumulation=fuse_wgrad)
    if fuse_wgrad:
        layer.weight.main_grad = torch.zeros(g, dout, din, device=DEV)
        layer.weight.grad_added_to_main_grad = False
    refs = [torch.nn.Linear(din, dout, device=DEV, dtype=torch.float32) for _ in range(g)]
    with torch.no_grad():
        for e, lin in enumerate(refs):
            lin.weight.copy_(layer.weight[e])
            lin.bias.copy_(layer.bias[e])
    x = torch.randn(t, din, device=DEV).bfloat16().requires_grad_()
    y = layer(x, offs)
    xr = x.detach().float().requires_grad_()
    pieces, s = [], 0
    for e, c in enumerate(counts):
        pieces.append(refs[e](xr[s:s + c]))
        s += c
    yr = torch.cat(pieces)
    assert_close(y, yr)
    dy = torch.randn(t, dout, device=DEV).bfloat16()
    y.backward(dy)
    yr.backward(dy.float())
    assert_close(x.grad, xr.grad)
    wgrad = torch.stack([lin.weight.grad for lin in refs])
    if fuse_wgrad:
        assert layer.weight.grad_added_to_main_grad
        assert_close(layer.weight.main_grad, wgrad)
    else:
        assert_close(layer.weight.grad, wgrad)
    assert_close(layer.bias.grad, torch.stack([lin.bias.grad for lin in refs]))


# ---------------------------------------------------------------- the registered ops, called directly

def _op_case(name):
    """(op, args, argument the error must name) for the registered ops with mismatched shapes."""
    g, t, n, k = 4, 64, 32, 16
    bf = dict(device=DEV, dtype=torch.bfloat16)
    x, w, dy = torch.randn(t, k, **bf), torch.randn(g, n, k, **bf), torch.randn(t, n, **bf)
    offs = make_offs([16] * g)
    out = torch.zeros(t, n, **bf)
    dw = torch.zeros(g, n, k, device=DEV)
    fwd = lambda **kw: (ops.grouped_mm_out, dict(dict(x=x, w=w, offs=offs, out=out, accumulate=False,
                                                      trans_w=True), **kw))
    wgrad = lambda **kw: (ops.grouped_mm_wgrad_out, dict(dict(dy=dy, x=x, offs=offs, out=dw, accumulate=False),
                                                         **kw))
    cases = {
        "w_fewer_groups_than_offs": (*fwd(w=torch.randn(g - 1, n, k, **bf)), "w"),
        "w_more_groups_than_offs": (*fwd(w=torch.randn(g + 1, n, k, **bf)), "w"),
        "out_too_few_rows": (*fwd(out=torch.zeros(t - 1, n, **bf)), "out"),
        "out_wrong_n": (*fwd(out=torch.zeros(t, n + 8, **bf)), "out"),
        "out_3d": (*fwd(out=torch.zeros(1, t, n, **bf)), "out"),
        "x_and_w_different_k": (*fwd(w=torch.randn(g, n, k + 8, **bf)), "w"),
        "w_2d": (*fwd(w=torch.randn(n, k, **bf)), "w"),
        "x_3d": (*fwd(x=torch.randn(1, t, k, **bf)), "x"),
        "dgrad_w_not_transposed": (*fwd(w=torch.randn(g, n, k, **bf), trans_w=False), "w"),
        "w_other_dtype": (*fwd(w=w.half()), "w"),
        "offs_empty": (*fwd(offs=offs[:0]), "offs"),
        "offs_int64": (*fwd(offs=offs.long()), "offs"),
        "out_not_contiguous": (*fwd(out=torch.zeros(n, t, **bf).T), "out"),
        "wgrad_dy_x_different_tokens": (*wgrad(x=torch.randn(t - 16, k, **bf)), "x"),
        "wgrad_out_fewer_groups": (*wgrad(out=torch.zeros(g - 1, n, k, device=DEV)), "out"),
        "wgrad_out_wrong_nk": (*wgrad(out=torch.zeros(g, k, n, device=DEV)), "out"),
        "wgrad_out_2d": (*wgrad(out=torch.zeros(n, k, device=DEV)), "out"),
        "wgrad_dy_3d": (*wgrad(dy=torch.randn(1, t, n, **bf)), "dy"),
    }
    return cases[name]


_OP_CASES = ["w_fewer_groups_than_offs", "w_more_groups_than_offs", "out_too_few_rows", "out_wrong_n", "out_3d",
             "x_and_w_different_k", "w_2d", "x_3d", "dgrad_w_not_transposed", "w_other_dtype", "offs_empty",
             "offs_int64", "out_not_contiguous", "wgrad_dy_x_different_tokens", "wgrad_out_fewer_groups",
             "wgrad_out_wrong_nk", "wgrad_out_2d", "wgrad_dy_3d"]


@pytest.mark.parametrize("backend", [0, 1], ids=["cutlass", "cublas"])
@pytest.mark.parametrize("case", _OP_CASES)
def test_registered_ops_refuse_mismatched_shapes(case, backend):
    op, args, name = _op_case(case)
    before = args["out"].clone()
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        op(*args.values(), backend)
    torch.cuda.synchronize()
    assert torch.equal(args["out"], before), "a refused call wrote its output"


@pytest.mark.parametrize("backend", [0, 1], ids=["cutlass", "cublas"])
def test_registered_allocating_ops_refuse_mismatched_shapes(backend):
    g, t, n, k = 4, 64, 32, 16
    bf = dict(device=DEV, dtype=torch.bfloat16)
    offs = make_offs([16] * g)
    x = torch.randn(t, k, **bf)
    with pytest.raises(ValueError, match=r"\bw\b"):
        ops.grouped_mm(x, torch.randn(g - 1, n, k, **bf), offs, torch.bfloat16, True, backend)
    with pytest.raises(ValueError, match=r"\bw\b"):
        ops.grouped_mm(x, torch.randn(g, n, k + 8, **bf), offs, torch.bfloat16, True, backend)
    with pytest.raises(ValueError, match=r"\bw\b"):
        ops.grouped_mm(x, torch.randn(n, k, **bf), offs, torch.bfloat16, True, backend)
    with pytest.raises(ValueError, match=r"\bx\b"):
        ops.grouped_mm_wgrad(torch.randn(t, n, **bf), torch.randn(t + 8, k, **bf), offs, torch.float32, backend)
    with pytest.raises(ValueError, match=r"\boffs\b"):
        ops.grouped_mm_wgrad(torch.randn(t, n, **bf), x, offs[:0], torch.float32, backend)


def test_more_groups_than_one_builder_grid():
    """G = 300000 > 1024 blocks x 256 threads of the argument builder: every group's arguments
    are built (grid-stride), the few non-empty groups checked against a reference, the empty
    ones left alone (forward/dgrad) or zeroed (wgrad)."""
    g, n, k = 300_000, 32, 64
    live = {0: 100, 1: 37, 150_000: 64, 262_143: 200, 262_144: 129, 262_145: 1, 299_999: 300}
    counts = torch.zeros(g, dtype=torch.int64)
    for e, c in live.items():
        counts[e] = c
    offs = counts.cumsum(0).to(torch.int32).to(DEV)
    t = int(counts.sum())
    bf = dict(device=DEV, dtype=torch.bfloat16)
    x, dy = torch.randn(t, k, **bf), torch.randn(t, n, **bf)
    w = torch.empty(g, n, k, **bf)
    w.normal_(std=0.1)
    rows = {}
    s = 0
    for e in sorted(live):
        rows[e] = (s, s + live[e])
        s += live[e]

    y = ops.grouped_mm(x, w, offs, torch.float32, True, 0)
    dx = ops.grouped_mm(dy, w, offs, torch.bfloat16, False, 0)  # dgrad: bf16 out is built
    for e, (a, b) in rows.items():
        assert_close(y[a:b], x[a:b].double() @ w[e].double().T)
        assert_close(dx[a:b], dy[a:b].double() @ w[e].double())

    dw = torch.full((g, n, k), 7.0, device=DEV)
    ops.grouped_mm_wgrad_out(dy, x, offs, dw, False, 0)
    for e, (a, b) in rows.items():
        assert_close(dw[e], dy[a:b].double().T @ x[a:b].double())
    empty = torch.ones(g, dtype=torch.bool, device=DEV)
    empty[list(live)] = False
    assert not (dw != 0).any(dim=(1, 2))[empty].any(), "an empty group of the 300000 was not zeroed"
    main_grad = torch.ones(g, n, k, device=DEV)
    ops.grouped_mm_wgrad_out(dy, x, offs, main_grad, True, 0)
    assert not (main_grad != 1).any(dim=(1, 2))[empty].any(), "accumulate touched an empty group"
    for e, (a, b) in rows.items():
        assert_close(main_grad[e], 1 + dy[a:b].double().T @ x[a:b].double())


def test_repeated_calls_take_the_remembered_runner(use_settings):
    """A repeated forward/dgrad call with the same signature skips the checks through one
    lookup and gives the same result; new routing in the same offs is read on the device; a
    changed backend setting, autograd and bad input take the full path."""
    from distgemm import _repeat_calls

    _repeat_calls.clear()
    counts = random_counts(6, 900, (2,))
    x = torch.randn(900, 256, device=DEV).bfloat16()
    w = torch.randn(6, 384, 256, device=DEV).bfloat16()
    offs = make_offs(counts)
    first = distgemm.grouped_mm(x, w, offs)
    assert _repeat_calls.sizes()[1], "the call should have been remembered"
    assert torch.equal(distgemm.grouped_mm(x, w, offs), first)
    assert_close(first, ref_forward(x, w, counts))
    new_counts = random_counts(6, 900, (0, 5))
    offs.copy_(make_offs(new_counts))  # same tensor, new routing
    assert_close(distgemm.grouped_mm(x, w, offs), ref_forward(x, w, new_counts))
    w_kn = w.transpose(1, 2).contiguous()  # dgrad layout: another signature
    for _ in range(2):
        assert_close(distgemm.grouped_mm(x, w_kn, offs, trans_w=False), ref_forward(x, w_kn, new_counts, False))
    use_settings(grouped_backend="torch")
    assert_close(distgemm.grouped_mm(x, w, offs), ref_forward(x, w, new_counts))
    use_settings(grouped_backend=None)
    leaf = x.clone().requires_grad_()
    distgemm.grouped_mm(leaf, w, offs).float().sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    with pytest.raises(ValueError, match="w must have shape"):
        distgemm.grouped_mm(x[:, :128], w, offs)
    _repeat_calls.clear()
