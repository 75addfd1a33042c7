"""Grouped GEMMs on one GPU against a per-group FP64 reference: random and degenerate
routing, G from 1 to 1024, every compiled configuration, all backends, accumulate,
bounds safety with bad offsets, CUDA-graph replay with new routing, torch.compile and
GroupedLinear."""

import pytest
import torch

import distgemm
from distgemm._library import device_arch, ops
from distgemm.nn import GroupedLinear
from tests.reference import assert_close

pytestmark = pytest.mark.gpu
DEV = "cuda"


def make_offs(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEV)


def random_counts(groups, tokens, zero_groups=()):
    w = torch.rand(groups)
    for g in zero_groups:
        w[g] = 0
    c = (w / w.sum() * tokens).floor().long()
    live = [g for g in range(groups) if g not in zero_groups]
    c[live[0]] += tokens - int(c.sum())
    return c.tolist()


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


@pytest.mark.parametrize("kind,out_dtype", [(0, torch.bfloat16), (0, torch.float32), (1, torch.bfloat16),
                                            (2, torch.float32), (2, torch.bfloat16)])
def test_every_config(kind, out_dtype):
    names = ops.grouped_configs(kind, torch.bfloat16, out_dtype, device_arch(torch.device(DEV)))
    assert names
    counts = random_counts(7, 1500, (4,))
    offs = make_offs(counts)
    n, k = 392, 200
    x = torch.randn(1500, k, device=DEV).bfloat16()
    if kind == 2:
        dy = torch.randn(1500, n, device=DEV).bfloat16()
        for config in range(len(names)):
            assert_close(ops.grouped_mm_wgrad(dy, x, offs, out_dtype, 0, config), ref_wgrad(dy, x, counts))
    else:
        w = torch.randn(7, n, k, device=DEV).bfloat16() if kind == 0 else torch.randn(7, k, n, device=DEV).bfloat16()
        for config in range(len(names)):
            out = ops.grouped_mm(x, w, offs, out_dtype, kind == 0, 0, config)
            assert_close(out, ref_forward(x, w, counts, trans_w=kind == 0))


@pytest.mark.parametrize("backend", ["cutlass", "cublas", "torch"])
def test_backends_agree(backend, monkeypatch):
    monkeypatch.setenv("DISTGEMM_GROUPED_BACKEND", backend)
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
