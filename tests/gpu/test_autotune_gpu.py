"""Runtime autotuning of the dense GEMM: whichever candidate wins, the result is the GEMM's;
choices persist on disk and are reused; nothing is timed inside CUDA-graph capture or
torch.compile; DISTGEMM_AUTOTUNE=0 keeps the tile heuristic."""

import json

import pytest
import torch

import distgemm
from distgemm import _repeat_calls, autotune, dense
from tests.reference import assert_close, ref_gemm

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture
def cache(autotune_cache):
    return autotune_cache


@pytest.mark.parametrize("m, n, k", [(4096, 2112, 7168), (1, 4096, 4096), (333, 1000, 1000), (8192, 8192, 512)])
def test_autotuned_result_is_the_gemm(cache, m, n, k):
    a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    out = distgemm.gemm(a, b, bias, beta=1.0)
    assert autotune.last_backend() is not None and autotune.last_backend() != "cutlass", \
        "the first eager call of a shape should have been autotuned"
    assert_close(out, ref_gemm(a, b, bias, beta=1.0))
    saved = json.loads(cache.read_text())
    assert any(f"{m}x{n}x{k}" in key for key in saved), saved


def test_choices_are_reused_from_disk(cache):
    a = torch.randn(512, 768, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(1536, 768, device=DEV, dtype=torch.bfloat16)
    distgemm.gemm(a, b)
    first = autotune.last_backend()
    key = next(iter(json.loads(cache.read_text())))
    # Another process (simulated): memory cleared, the file says "cublas" for this shape.
    cache.write_text(json.dumps({key: "cublas"}))
    autotune.clear()
    autotune._LOADED = False
    out = distgemm.gemm(a, b)
    assert autotune.last_backend() == "cublas", (first, autotune.last_backend())
    assert_close(out, ref_gemm(a, b))


def test_graph_capture_never_times(cache):
    a = torch.randn(640, 1024, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(2048, 1024, device=DEV, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a shape never seen: timing here would break the capture
        out = distgemm.gemm(a, b)
    assert autotune.last_backend() == "cutlass"
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, ref_gemm(a, b))
    assert not cache.exists() or "640x2048x1024" not in cache.read_text()


def test_disabled_keeps_the_heuristic(cache, use_settings):
    use_settings(autotune=False)  # as DISTGEMM_AUTOTUNE=0
    a = torch.randn(256, 512, device=DEV, dtype=torch.float16)
    b = torch.randn(384, 512, device=DEV, dtype=torch.float16)
    out = distgemm.gemm(a, b)
    assert autotune.last_backend() == "cutlass"
    assert_close(out, ref_gemm(a, b), in_dtype=torch.float16)
    assert not cache.exists()


def test_autograd_through_autotuned_calls(cache):
    a = torch.randn(300, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(200, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    out = distgemm.gemm(a, b)
    out.float().sum().backward()
    ga = torch.ones(300, 200, device=DEV, dtype=torch.bfloat16) @ b.detach()
    assert_close(a.grad, ga)


def test_repeated_calls_take_the_remembered_choice(cache):
    """A call whose key was seen before runs the remembered choice through one native table
    lookup: same result, same backend; another key, autograd, disabled autotuning and bad
    input still take the full path."""
    a = torch.randn(384, 640, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(896, 640, device=DEV, dtype=torch.bfloat16)
    out1 = distgemm.gemm(a, b)
    first = autotune.last_backend()
    assert _repeat_calls.sizes()[0], "the settled call should have been remembered"
    out2 = distgemm.gemm(a, b)
    assert autotune.last_backend() == first
    assert torch.equal(out1, out2)
    assert_close(out2, ref_gemm(a, b))
    assert_close(distgemm.gemm(a, b, alpha=0.5), ref_gemm(a, b, alpha=0.5))  # another signature
    bias = torch.randn(896, device=DEV, dtype=torch.bfloat16)
    for _ in range(2):
        assert_close(distgemm.gemm(a, b, bias, beta=1.0), ref_gemm(a, b, bias, beta=1.0))
    leaf = a.clone().requires_grad_()
    distgemm.gemm(leaf, b).float().sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    with pytest.raises(ValueError, match="b must have shape"):
        distgemm.gemm(a[:, :320], b)
    autotune.clear()
    assert _repeat_calls.sizes() == (0, 0, 0), "clear() forgets the remembered calls too"


E4M3 = torch.float8_e4m3fn


def _fp8_operands(m, n, k, scales):
    a = (torch.randn(m, k, device=DEV) * 0.5).to(E4M3)
    b = (torch.randn(n, k, device=DEV) * 0.5).to(E4M3)
    if scales == "tensor":
        sa, sb = torch.tensor([0.7], device=DEV), torch.tensor([1.3], device=DEV)
    elif scales == "row":
        sa, sb = torch.rand(m, device=DEV) + 0.5, torch.rand(n, device=DEV) + 0.5
    else:  # per tensor for a, per row for b: torch._scaled_mm takes both row-wise
        sa, sb = torch.tensor([0.7], device=DEV), torch.rand(n, device=DEV) + 0.5
    return a, b, sa, sb


@pytest.mark.parametrize("scales", ["tensor", "row", "mixed"])
@pytest.mark.parametrize("m, n, k, with_bias", [(4096, 2112, 7168, False), (333, 1024, 512, True),
                                                (64, 1000, 1000, False)])
def test_fp8_autotuned_result_is_the_gemm(cache, scales, m, n, k, with_bias):
    """The FP8 autotuner's candidates (our tiles, torch._scaled_mm where it computes the same
    call) give the GEMM whichever wins, and the choice is stored."""
    a, b, sa, sb = _fp8_operands(m, n, k, scales)
    bias = torch.randn(n, device=DEV, dtype=torch.bfloat16) if with_bias else None
    out = distgemm.gemm(a, b, bias, beta=1.0, scale_a=sa, scale_b=sb)
    backend = autotune.last_backend()
    assert backend is not None and backend != "cutlass", backend
    assert out.dtype == torch.bfloat16
    assert_close(out, ref_gemm(a, b, bias, beta=1.0, sa=sa, sb=sb), in_dtype=E4M3)
    assert any(f"{m}x{n}x{k}" in key and "scales:" in key for key in json.loads(cache.read_text()))


@pytest.mark.parametrize("scales", ["tensor", "row"])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_fp8_every_candidate_agrees(cache, scales, fast_accum):
    """Each stored choice, forced through the cache file, computes the same product: ours and
    torch._scaled_mm alike, promoted and fast accumulation."""
    a, b, sa, sb = _fp8_operands(512, 768, 1024, scales)
    ref = ref_gemm(a, b, sa=sa, sb=sb)
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb, use_fast_accum=fast_accum)
    key = next(k for k in json.loads(cache.read_text()) if "512x768x1024" in k)
    assert key.endswith("peer:1"), key  # this call is one torch._scaled_mm computes
    configs = distgemm._library.ops.gemm_configs(E4M3, E4M3, torch.bfloat16, True, 90, fast_accum)
    for forced in ["torch._scaled_mm"] + [f"cutlass:{name}" for name in configs]:
        cache.write_text(json.dumps({key: forced}))
        autotune.clear()
        autotune._LOADED = False
        out = distgemm.gemm(a, b, scale_a=sa, scale_b=sb, use_fast_accum=fast_accum)
        assert autotune.last_backend() == forced
        assert_close(out, ref, in_dtype=E4M3)


def test_fp8_calls_torch_cannot_take_run_ours(cache):
    """alpha, a full c and float32 out are beyond torch._scaled_mm's row-wise form: the
    candidates are ours only, and the result is still the GEMM."""
    a, b, sa, sb = _fp8_operands(256, 512, 384, "row")
    c = torch.randn(256, 512, device=DEV, dtype=torch.float32)
    out = distgemm.gemm(a, b, c, alpha=0.5, beta=2.0, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert autotune.last_backend() != "torch._scaled_mm"
    assert_close(out, ref_gemm(a, b, c, alpha=0.5, beta=2.0, sa=sa, sb=sb), in_dtype=E4M3)


def test_fp8_graph_capture_never_times_nor_tries_the_peer(cache):
    a, b, sa, sb = _fp8_operands(640, 1024, 512, "tensor")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a shape never seen: no timing, no trial call inside the capture
        out = distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert autotune.last_backend() == "cutlass"
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, ref_gemm(a, b, sa=sa, sb=sb), in_dtype=E4M3)
    assert not cache.exists() or "640x1024x512" not in cache.read_text()


def test_the_tuner_and_the_benchmark_flush_the_gpu_l2():
    """Both time with the L2 evicted by overwriting a GPU buffer of twice its size (the
    benchmark Timer's, made with device=None, once lived on the host and flushed nothing)."""
    from distgemm.bench.common import Timer

    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    for buf in (autotune.flush_buffer(), Timer()._flush):
        assert buf.is_cuda and buf.numel() * buf.element_size() >= 2 * l2


@pytest.mark.parametrize("discipline", ["interleaved", "sequential", "sustained"])
def test_every_benchmark_timing_discipline_times_each_candidate(use_settings, discipline):
    """Each of DISTGEMM_BENCH_TIMING's disciplines calls every candidate warmup + reps times,
    returns a positive median per candidate (the longer GEMM timed longer), and the results'
    env names the discipline."""
    from distgemm.bench.common import Timer, env_info

    use_settings(bench_timing=discipline)
    small = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    large = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    calls = {"small": 0, "large": 0}

    def run(name, x):
        def fn():
            calls[name] += 1
            return x @ x
        return fn

    times = Timer().compare({"small": run("small", small), "large": run("large", large)}, warmup=2, reps=5)
    assert calls == {"small": 7, "large": 7}
    assert set(times) == {"small", "large"} and all(t > 0 for t in times.values())
    assert times["large"] > times["small"]
    assert env_info()["timing"] == discipline


@pytest.mark.parametrize("scales", ["tensor", "row", "mixed", "block"])
@pytest.mark.parametrize("forced", [None, "ours"])
def test_fp8_repeated_calls_take_the_remembered_runner(cache, monkeypatch, scales, forced):
    """A settled float8 call's repeat skips the checks (the runner is remembered), reads the new
    scales, and gives the GEMM: the autotuner's own choice, and ours forced through the cache."""
    from distgemm.grouped_fp8 import dequantize_blocks

    m, n, k = 384, 512, 1024
    if scales == "block":
        a = (torch.randn(m, k, device=DEV) * 0.5).to(E4M3)
        b = (torch.randn(n, k, device=DEV) * 0.5).to(E4M3)
        sa = torch.rand(k // 128, m, device=DEV).t() + 0.5  # quantize_fp8's (M, K/128) with strides (1, M)
        sb = torch.rand(n // 128, k // 128, device=DEV) + 0.5

        def ref(sa):
            return dequantize_blocks(a, sa, 1, 128) @ dequantize_blocks(b, sb, 128, 128).T
    else:
        a, b, sa, sb = _fp8_operands(m, n, k, scales)

        def ref(sa):
            return ref_gemm(a, b, sa=sa, sb=sb)
    first = distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    if forced:  # every key of this shape to ours (the block recipe's is the grouped kernel)
        stored = json.loads(cache.read_text())
        cache.write_text(json.dumps({key: ("cutlass:grouped" if "block" in key else
                                           "cutlass:" + distgemm._library.ops.gemm_configs(
                                               E4M3, E4M3, torch.bfloat16, True, 90, False)[0])
                                     for key in stored}))
        autotune.clear()
        autotune._LOADED = False
        first = distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    chosen = autotune.last_backend()
    assert dense._REPEAT_CALLS or _repeat_calls.sizes()[2], "the settled call was not remembered"
    checks = []
    original = dense.check_operands
    monkeypatch.setattr(dense, "check_operands", lambda *args: checks.append(1) or original(*args))
    again = distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert not checks, "the repeated call went through the checks"
    assert autotune.last_backend() == chosen
    assert torch.equal(first, again)
    assert_close(again, ref(sa), in_dtype=E4M3)
    sa2 = sa.clone().mul_(2)  # the same strides: the same signature
    assert_close(distgemm.gemm(a, b, scale_a=sa2, scale_b=sb), ref(sa2), in_dtype=E4M3)
    assert not checks
