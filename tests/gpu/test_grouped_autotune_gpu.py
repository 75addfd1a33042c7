"""Runtime autotuning of the 16-bit grouped GEMMs: whichever candidate wins (a tile
configuration of ours or torch._grouped_mm), the result is the grouped GEMM's; the choice is
stored per problem and reused; accumulate=True adds into out once; nothing is timed inside
CUDA-graph capture; DISTGEMM_AUTOTUNE=0 keeps the cost model's configuration."""

import json

import pytest
import torch

import distgemm
from distgemm import autotune, grouped
from tests.gpu.test_grouped_gpu import ref_forward, ref_wgrad
from tests.reference import assert_close, make_offs, random_counts

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _tuned(backend):
    return backend == grouped.TORCH or str(backend).startswith("cutlass:")


# 4 x 256 tokens with K 768 / N 2048: the small-expert row where a 128 x 256 tile leaves most
# SMs idle; 7 ragged groups with an empty one; 128-row groups (clusters along N pad nothing).
@pytest.mark.parametrize("counts, n, k", [([256] * 4, 2048, 768), ([300, 17, 415, 0, 260, 400, 108], 392, 200),
                                          ([128] * 8, 1024, 512)])
def test_autotuned_passes_are_the_grouped_gemm(autotune_cache, counts, n, k):
    g, t = len(counts), sum(counts)
    offs = make_offs(counts)
    x = torch.randn(t, k, device=DEV).bfloat16()
    w = (torch.randn(g, n, k, device=DEV) * 0.1).bfloat16()
    dy = torch.randn(t, n, device=DEV).bfloat16()
    for _ in range(2):  # tuned, then the remembered choice
        assert_close(distgemm.grouped_mm(x, w, offs), ref_forward(x, w, counts))
        assert _tuned(autotune.last_backend()), autotune.last_backend()
        assert_close(distgemm.grouped_mm(dy, w, offs, trans_w=False), ref_forward(dy, w, counts, trans_w=False))
        assert _tuned(autotune.last_backend()), autotune.last_backend()
        assert_close(distgemm.grouped_mm_wgrad(dy, x, offs), ref_wgrad(dy, x, counts))
        assert str(autotune.last_backend()).startswith("cutlass:"), autotune.last_backend()  # FP32 out: ours only
    saved = json.loads(autotune_cache.read_text())
    for pass_name, dims in (("forward", f"{n}x{k}"), ("dgrad", f"{k}x{n}"), ("wgrad", f"{n}x{k}")):
        assert any(f"grouped-{pass_name}|G{g}|T{t}|{dims}|" in key for key in saved), (pass_name, saved)


def test_tuning_adds_into_out_once(autotune_cache):
    counts = random_counts(5, 700, (1,))
    offs = make_offs(counts)
    x, dy = torch.randn(700, 256, device=DEV).bfloat16(), torch.randn(700, 320, device=DEV).bfloat16()
    main_grad = torch.randn(5, 320, 256, device=DEV)
    expected = main_grad.double() + ref_wgrad(dy, x, counts)
    distgemm.grouped_mm_wgrad(dy, x, offs, out=main_grad, accumulate=True)  # timed on a scratch copy
    assert_close(main_grad, expected)
    w = torch.randn(5, 320, 256, device=DEV).bfloat16()
    out = torch.randn(700, 320, device=DEV).bfloat16()  # bf16: more than one configuration to time
    expected = out.double() + ref_forward(x, w, counts)
    distgemm.grouped_mm(x, w, offs, out=out, accumulate=True)
    assert_close(out, expected)
    assert str(autotune.last_backend()).startswith("cutlass:")  # torch._grouped_mm cannot accumulate


def test_autograd_runs_our_kernels(autotune_cache):
    counts = random_counts(6, 900, (2,))
    offs = make_offs(counts)
    x = torch.randn(900, 256, device=DEV).bfloat16().requires_grad_()
    w = (torch.randn(6, 384, 256, device=DEV) * 0.1).bfloat16().requires_grad_()
    y = distgemm.grouped_mm(x, w, offs)
    assert str(autotune.last_backend()).startswith("cutlass:")  # torch's autograd would bypass ours
    grad = torch.randn_like(y)
    y.backward(grad)
    assert_close(x.grad, ref_forward(grad, w.detach(), counts, trans_w=False))
    assert_close(w.grad, ref_wgrad(grad, x.detach(), counts))


def test_graph_capture_never_times(autotune_cache):
    counts = random_counts(4, 640, ())
    offs = make_offs(counts)
    x, w = torch.randn(640, 512, device=DEV).bfloat16(), torch.randn(4, 768, 512, device=DEV).bfloat16()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a problem never seen: timing here would break the capture
        y = distgemm.grouped_mm(x, w, offs)
    assert autotune.last_backend() == "cutlass"  # the cost model's configuration
    graph.replay()
    torch.cuda.synchronize()
    assert_close(y, ref_forward(x, w, counts))
    assert not autotune_cache.exists() or "T640|768x512" not in autotune_cache.read_text()
    distgemm.grouped_mm(x, w, offs)  # eager now: timed, and not the capture's stand-in
    assert _tuned(autotune.last_backend())


def test_disabled_keeps_the_cost_model(autotune_cache, use_settings):
    use_settings(autotune=False)
    counts = random_counts(3, 500, ())
    offs = make_offs(counts)
    x, w = torch.randn(500, 256, device=DEV).bfloat16(), torch.randn(3, 512, 256, device=DEV).bfloat16()
    assert_close(distgemm.grouped_mm(x, w, offs), ref_forward(x, w, counts))
    assert autotune.last_backend() == "cutlass"
    assert not autotune_cache.exists()
