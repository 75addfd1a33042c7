"""Which candidate a dense or grouped call runs, what is cached under which key, and what a
repeated call runs, through the public ops as on an sm_90 GPU: the kernels, the vendor calls and
the autotuner's timing are replaced by counted plain-PyTorch stand-ins (no GPU needed). The keys
are the disk cache's: a change of them would drop every user's stored choices."""

import contextlib
import warnings

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import distgemm
from distgemm import _repeat_calls, _torch_block_scaled, autotune, dense, grouped, grouped_fp8

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
GEMM_BF16 = tuple(autotune.CUTLASS_PREFIX + n for n in dense.ops.gemm_configs(BF16, BF16, BF16, True, 90, False))
GEMM_FP8 = tuple(autotune.CUTLASS_PREFIX + n for n in dense.ops.gemm_configs(E4M3, E4M3, BF16, True, 90, False))


class _NoDeviceContext(contextlib.nullcontext):
    def __init__(self, device):
        super().__init__()


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """The dispatch of an sm_90 GPU on CPU tensors. Yields a record: `times` (candidate name ->
    ms, 1.0 unless set; a name in `refuse` raises when run), `ran` (what ran, in order: a
    config's index as ('cutlass', i), or the vendor call's name), `timings` (how often
    candidates were timed), `natively()` (a block whose calls the native repeat-call table runs:
    what they run goes to `ran` too, in the same names)."""
    import distgemm._library as library
    import sys

    # Inductor builds its decomposition table from every registered op when first imported: do
    # that before the fakes below stand in for torch.ops.distgemm.gemm and torch._scaled_mm.
    import torch._inductor.compile_fx  # noqa: F401

    has_kernels, device_arch = library.has_kernels, library.device_arch
    for name, module in list(sys.modules.items()):
        if name.startswith("distgemm") and module is not None:
            if getattr(module, "has_kernels", None) is has_kernels:
                monkeypatch.setattr(module, "has_kernels", lambda device: True)
            if getattr(module, "device_arch", None) is device_arch:
                monkeypatch.setattr(module, "device_arch", lambda device: 90)
    record = {"times": {}, "ran": [], "timings": 0, "refuse": set()}

    def medians(candidates, flush):
        record["timings"] += 1
        return {name: record["times"].get(name, 1.0) for name in candidates}
    monkeypatch.setattr(autotune, "_medians", medians)
    monkeypatch.setattr(autotune, "flush_buffer", lambda *args, **kwargs: None)
    monkeypatch.setattr(autotune, "may_time", lambda: True)
    monkeypatch.setattr(autotune, "_LOADED", True)
    # The timing's device context, as a class: torch's own code (Dynamo asking whether the GPU has
    # TMA, on a machine with one) tests isinstance(..., torch.cuda.device).
    monkeypatch.setattr(torch.cuda, "device", _NoDeviceContext)

    def ran(name):
        record["ran"].append(name)
        if name in record["refuse"]:
            raise RuntimeError(f"{name} refuses this call")
    record["run"] = ran
    record["natively"] = lambda: _RanNatively(ran)

    def fake_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, fast=False, config=-1, swizzle=0):
        ran(("cutlass", config))
        return dense.reference_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b)
    linear = torch.nn.functional.linear

    def fake_linear(a, b, bias=None):
        ran("cublas")
        return linear(a.float(), b.float(), None if bias is None else bias.float()).to(a.dtype)
    monkeypatch.setattr(torch.nn.functional, "linear", fake_linear)

    def fake_scaled_mm(a, b_t, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False):
        ran("torch._scaled_mm")
        out = (a.float() @ b_t.float()) * scale_a.float() * scale_b.float()
        return (out if bias is None else out + bias.float()).to(out_dtype)
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(_torch_block_scaled, "cublas_scale_a", lambda s: s)
    monkeypatch.setattr(_torch_block_scaled, "cublas_scale_b", lambda s: s)

    def fake_block(a, b_t, scale_a, scale_b):
        ran("F.scaled_mm")
        return (a.float() @ b_t.float()).to(BF16)
    monkeypatch.setattr(_torch_block_scaled, "scaled_mm_block", fake_block)

    def fake_grouped_fp8(x, w, offs, **kwargs):
        ran("cutlass:grouped")
        return (x.float() @ w[0].float().T).to(BF16)
    monkeypatch.setattr(grouped_fp8, "grouped_mm_fp8", fake_grouped_fp8)
    autotune.clear()
    with (distgemm.settings(autotune=True, autotune_cache=str(tmp_path / "cache.json"), grouped_backend="auto"),
          cpu_kernels(gemm=fake_gemm)):
        yield record
    autotune.clear()


@contextlib.contextmanager
def cpu_kernels(**fakes):
    """distgemm's ops (name -> kernel) replaced on CPU in the dispatcher, where the calls the native
    repeat-call table runs reach them too; restored after."""
    lib = torch.library.Library("distgemm", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "(?s).*Overriding a previously registered kernel")
        for name, fake in fakes.items():
            lib.impl(name, fake, "CPU", allow_override=True)
    try:
        yield
    finally:
        lib._destroy()


class _RanNatively(TorchDispatchMode):
    """Names the vendor calls a repeated call runs from the native table, which reach the
    dispatcher from C++ past the fixture's Python fakes (F.linear as mm, torch._scaled_mm,
    torch._grouped_mm); our ops' fakes are the dispatcher's (cpu_kernels) and record themselves."""

    def __init__(self, ran):
        super().__init__()
        self.ran = ran

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.ran("cublas")
        elif func is torch.ops.aten._scaled_mm.default:
            self.ran("torch._scaled_mm")
        elif func is torch.ops.aten._grouped_mm.default:
            self.ran("torch._grouped_mm")
        return func(*args, **(kwargs or {}))


def bf16(m=32, n=48, k=64):
    return torch.randn(m, k).to(BF16), torch.randn(n, k).to(BF16)


def test_bf16_fastest_config_is_cached_and_repeated(gpu):
    a, b = bf16()
    gpu["times"][GEMM_BF16[1]] = 0.5
    out = distgemm.gemm(a, b)
    torch.testing.assert_close(out.float(), a.float() @ b.float().T, rtol=2e-2, atol=2e-2)
    assert autotune.lookup("sm90|32x48x64|torch.bfloat16->torch.bfloat16|b:K|c:none|cublas:1") == GEMM_BF16[1]
    assert gpu["ran"][-1] == ("cutlass", 1) and gpu["timings"] == 1
    gpu["ran"].clear()
    with gpu["natively"]():
        distgemm.gemm(a, b)
    assert gpu["ran"] == [("cutlass", 1)] and gpu["timings"] == 1
    assert autotune.last_backend() == GEMM_BF16[1]


def test_bf16_cublas_keeps_a_near_tie_and_repeats_through_linear(gpu):
    a, b = bf16()
    gpu["times"].update({GEMM_BF16[0]: 0.98, "cublas": 1.0})
    distgemm.gemm(a, b)
    assert autotune.last_backend() == "cublas"
    gpu["ran"].clear()
    with gpu["natively"]():
        distgemm.gemm(a, b)
    assert gpu["ran"] == ["cublas"] and gpu["timings"] == 1


def test_bf16_alpha_leaves_cublas_out(gpu):
    a, b = bf16()
    gpu["times"]["cublas"] = 0.1  # faster, but it cannot scale by alpha
    distgemm.gemm(a, b, alpha=2.0)
    assert autotune.lookup("sm90|32x48x64|torch.bfloat16->torch.bfloat16|b:K|c:none|cublas:0") == GEMM_BF16[0]
    assert "cublas" not in gpu["ran"]


def test_capture_of_an_untimed_shape_runs_the_heuristic_and_caches_nothing(gpu, monkeypatch):
    monkeypatch.setattr(autotune, "may_time", lambda: False)
    a, b = bf16()
    for _ in range(2):
        gpu["ran"].clear()
        distgemm.gemm(a, b)
        assert gpu["ran"] == [("cutlass", -1)]
    assert gpu["timings"] == 0
    assert autotune.lookup("sm90|32x48x64|torch.bfloat16->torch.bfloat16|b:K|c:none|cublas:1") is None


def test_autotune_off_runs_the_heuristic(gpu):
    a, b = bf16()
    with distgemm.settings(autotune=False):
        distgemm.gemm(a, b)
    assert gpu["ran"] == [("cutlass", -1)] and gpu["timings"] == 0


def fp8(m=32, n=48, k=64):
    a, b = bf16(m, n, k)
    return a.to(E4M3), b.to(E4M3), torch.tensor([0.5]), torch.tensor([2.0])


def test_fp8_vendor_keeps_a_near_tie_and_repeats(gpu):
    a, b, sa, sb = fp8()
    gpu["times"][GEMM_FP8[0]] = 0.99
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    key = "sm90|32x48x64|torch.float8_e4m3fnxtorch.float8_e4m3fn->torch.bfloat16|scales:tensor|fast:0|c:none|peer:1"
    assert autotune.lookup(key) == "torch._scaled_mm"
    gpu["ran"].clear()
    with gpu["natively"]():
        out = distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert gpu["ran"] == ["torch._scaled_mm"] and gpu["timings"] == 1 and _repeat_calls.sizes()[2] == 1
    torch.testing.assert_close(out.float(), a.float() @ b.float().T, rtol=2e-2, atol=2e-2)


def test_fp8_vendor_refusing_leaves_our_configs(gpu):
    a, b, sa, sb = fp8()
    gpu["refuse"].add("torch._scaled_mm")
    gpu["times"][GEMM_FP8[2]] = 0.5
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert autotune.last_backend() == GEMM_FP8[2]
    gpu["ran"].clear()
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert gpu["ran"] == [("cutlass", 2)] and _repeat_calls.sizes()[2] == 1


def block(m=32, n=48, k=256):
    a, b = bf16(m, n, k)
    return a.to(E4M3), b.to(E4M3), torch.ones(m, k // 128), torch.ones((n + 127) // 128, k // 128)


def test_block_scaled_vendor_refusing_leaves_ours_remembered(gpu):
    a, b, sa, sb = block()
    gpu["refuse"].add("F.scaled_mm")
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    key = f"sm90|32x48x256|torch.float8_e4m3fnxtorch.float8_e4m3fn->bf16|scales:block|torch:{torch.__version__}"
    assert autotune.lookup(key) == "cutlass:grouped" and gpu["timings"] == 0
    gpu["ran"].clear()
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert gpu["ran"] == ["cutlass:grouped"]


def test_block_scaled_vendor_faster_is_chosen(gpu):
    a, b, sa, sb = block()
    gpu["times"]["F.scaled_mm"] = 0.5
    distgemm.gemm(a, b, scale_a=sa, scale_b=sb, alpha=2.0)
    assert autotune.last_backend() == "F.scaled_mm"
    gpu["ran"].clear()
    out = distgemm.gemm(a, b, scale_a=sa, scale_b=sb, alpha=2.0)
    assert gpu["ran"] == ["F.scaled_mm"] and gpu["timings"] == 1
    torch.testing.assert_close(out.float(), 2 * (a.float() @ b.float().T), rtol=2e-2, atol=2e-2)


@pytest.fixture
def grouped_gpu(gpu, monkeypatch):
    """The grouped kernels as counted stand-ins: ops.grouped_mm_out / _wgrad_out (config
    recorded; grouped_mm_out in the dispatcher, for the native table's repeated calls) and
    torch._grouped_mm."""
    from distgemm._routing import group_bounds

    def fake_out(x, w, offs, out, accumulate, trans_w, backend=0, config=-1):
        gpu["run"](("cutlass", config))
        grouped.reference_grouped_mm(x, w, offs, out, accumulate, trans_w)

    def fake_wgrad_out(dy, x, offs, out, accumulate, backend=0, config=-1):
        gpu["run"](("cutlass", config))
        grouped.reference_grouped_mm_wgrad(dy, x, offs, out, accumulate)

    def fake_torch(a, b, offs=None, out_dtype=None):
        gpu["run"]("torch._grouped_mm")
        if a.dim() == 2 and b.dim() == 3:
            out = torch.zeros(a.shape[0], b.shape[2], dtype=out_dtype)
            for g, (s, e) in enumerate(group_bounds(offs, a.shape[0])):
                out[s:e] = (a[s:e].float() @ b[g].float()).to(out_dtype)
            return out
        out = torch.zeros(offs.numel(), a.shape[0], b.shape[1], dtype=out_dtype)
        for g, (s, e) in enumerate(group_bounds(offs, b.shape[0])):
            out[g] = (a[:, s:e].float() @ b[s:e].float()).to(out_dtype)
        return out
    backend = grouped._backend  # as on a GPU: the inputs' device type is the one thing faked here
    monkeypatch.setattr(grouped, "_backend", lambda op, device, *args: backend(op, torch.device("cuda", 0), *args))
    monkeypatch.setattr(grouped.ops, "grouped_mm_wgrad_out", fake_wgrad_out)
    monkeypatch.setattr(torch, "_grouped_mm", fake_torch)
    monkeypatch.setattr(grouped.ops, "grouped_mm", lambda x, w, offs, out_dtype, trans_w, backend=0, config=-1:
                        _new_out(fake_out, x, w, offs, out_dtype, trans_w, config))
    monkeypatch.setattr(grouped.ops, "grouped_mm_wgrad", lambda dy, x, offs, out_dtype, backend=0, config=-1:
                        _new_wgrad(fake_wgrad_out, dy, x, offs, out_dtype, config))
    with cpu_kernels(grouped_mm_out=fake_out):
        yield gpu


def _new_out(fake_out, x, w, offs, out_dtype, trans_w, config):
    out = torch.zeros(x.shape[0], w.shape[1] if trans_w else w.shape[2], dtype=out_dtype)
    fake_out(x, w, offs, out, False, trans_w, 0, config)
    return out


def _new_wgrad(fake_wgrad_out, dy, x, offs, out_dtype, config):
    out = torch.zeros(offs.numel(), dy.shape[1], x.shape[1], dtype=out_dtype)
    fake_wgrad_out(dy, x, offs, out, False, 0, config)
    return out


def routed(tokens=100, groups=4, n=64, k=32):
    x = torch.randn(tokens, k).to(BF16)
    w = torch.randn(groups, n, k).to(BF16)
    offs = torch.tensor([10, 10, 60, 100], dtype=torch.int32)
    return x, w, offs


def grouped_names(kind, out=BF16):
    return tuple(autotune.CUTLASS_PREFIX + n for n in grouped.ops.grouped_configs(kind, BF16, out, 90, 0))


def test_grouped_forward_fastest_config_cached_and_repeated(grouped_gpu):
    x, w, offs = routed()
    names = grouped_names(0)
    grouped_gpu["times"][names[3]] = 0.5
    out = distgemm.grouped_mm(x, w, offs)
    torch.testing.assert_close(out.float(), grouped.reference_grouped_mm(x, w, offs, torch.zeros(100, 64), False,
                                                                          True), rtol=2e-2, atol=2e-2)
    key = "sm90|grouped-forward|G4|T100|64x32|torch.bfloat16->torch.bfloat16|acc:0|torch:1"
    assert autotune.lookup(key) == names[3]
    grouped_gpu["ran"].clear()
    with grouped_gpu["natively"]():
        distgemm.grouped_mm(x, w, offs)
    assert grouped_gpu["ran"] == [("cutlass", 3)] and grouped_gpu["timings"] == 1


def test_grouped_forward_torch_keeps_a_near_tie_and_repeats(grouped_gpu):
    x, w, offs = routed()
    grouped_gpu["times"].update({grouped_names(0)[0]: 0.99, "torch._grouped_mm": 1.0})
    distgemm.grouped_mm(x, w, offs)
    grouped_gpu["ran"].clear()
    with grouped_gpu["natively"]():
        distgemm.grouped_mm(x, w, offs)
    assert grouped_gpu["ran"] == ["torch._grouped_mm"]
    assert autotune.last_backend() == "torch._grouped_mm"


def test_grouped_accumulate_adds_once(grouped_gpu):
    x, w, offs = routed()
    out = torch.ones(100, 64, dtype=torch.float32)
    distgemm.grouped_mm(x, w, offs, out=out, accumulate=True, out_dtype=torch.float32)
    expected = grouped.reference_grouped_mm(x, w, offs, torch.ones(100, 64), True, True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert "torch._grouped_mm" not in grouped_gpu["ran"]  # it rounds the product before adding
    names = grouped_names(0, torch.float32)
    key = "sm90|grouped-forward|G4|T100|64x32|torch.bfloat16->torch.float32|acc:1|torch:0"
    if len(names) == 1:  # nothing to choose: run once, untimed, nothing cached
        assert grouped_gpu["ran"] == [("cutlass", 0)] and autotune.lookup(key) is None
    else:
        assert autotune.lookup(key) in names


def test_grouped_wgrad_choice_is_cached(grouped_gpu):
    x, w, offs = routed()
    dy = torch.randn(100, 64).to(BF16)
    names = grouped_names(2, torch.float32)
    grouped_gpu["times"][names[-1]] = 0.1
    out = distgemm.grouped_mm_wgrad(dy, x, offs)
    torch.testing.assert_close(out, grouped.reference_grouped_mm_wgrad(dy, x, offs, torch.zeros(4, 64, 32), False),
                               rtol=1e-5, atol=1e-5)
    key = "sm90|grouped-wgrad|G4|T100|64x32|torch.bfloat16->torch.float32|acc:0|torch:0"
    assert autotune.lookup(key) == names[-1]
    assert grouped_gpu["ran"][-1] == ("cutlass", len(names) - 1)


def test_grouped_refusing_config_is_left_out(grouped_gpu):
    x, w, offs = routed()
    names = grouped_names(1)
    grouped_gpu["refuse"].add(("cutlass", 0))
    grouped_gpu["times"][names[0]] = 0.1  # fastest, but it refuses the call
    wt = w.transpose(1, 2).contiguous()
    distgemm.grouped_mm(x, wt, offs, trans_w=False)
    key = "sm90|grouped-dgrad|G4|T100|64x32|torch.bfloat16->torch.bfloat16|acc:0|torch:1"
    assert autotune.lookup(key) not in (None, names[0])


def test_torch_compile_traces_the_cost_models_kernels_whole(gpu, monkeypatch):
    # Under torch.compile nothing is timed, looked up or remembered: the dense and grouped
    # paths trace to the cost model's configuration in one graph (the grouped op itself, with
    # its fake and CPU kernels, as a real op; the dense kernel's stand-in traced through).
    backend = grouped._backend
    monkeypatch.setattr(grouped, "_backend", lambda op, device, *args: backend(op, torch.device("cuda", 0), *args))
    a, b = bf16()
    x, w, offs = routed()

    def step(a, b, x, w, offs):
        return distgemm.gemm(a, b), distgemm.grouped_mm(x, w, offs)
    torch._dynamo.reset()
    dense_out, grouped_out = torch.compile(step, fullgraph=True, backend="eager")(a, b, x, w, offs)
    torch.testing.assert_close(dense_out.float(), a.float() @ b.float().T, rtol=2e-2, atol=2e-2)
    expected = grouped.reference_grouped_mm(x, w, offs, torch.zeros(100, 64), False, True)
    torch.testing.assert_close(grouped_out.float(), expected, rtol=2e-2, atol=2e-2)
    assert gpu["timings"] == 0 and gpu["ran"] == [("cutlass", -1)]
    assert not dense._REPEAT_CALLS and _repeat_calls.sizes() == (0, 0, 0)


def test_fp8_wgrad_times_its_configs_into_a_scratch_and_adds_once(gpu, monkeypatch):
    # The FP8 block wgrad's dispatcher: each compiled tile timed (on a copy of out when
    # accumulating), the fastest cached under the problem's key, the call itself adding once.
    from distgemm import quantize_fp8

    names = tuple(autotune.CUTLASS_PREFIX + n for n in grouped_fp8.ops.grouped_configs(2, E4M3, torch.float32, 90, 2))
    if len(names) < 2:
        pytest.skip("this build has one FP8 wgrad configuration")
    runs = []

    def fake_wgrad_out(dy_t, x_t, offs, scale_dy, scale_x, out, accumulate, config=-1):
        runs.append((config, out.data_ptr()))
        out.add_(1.0) if accumulate else out.fill_(1.0)
    monkeypatch.setattr(grouped_fp8, "_use_kernel", lambda device: True)
    monkeypatch.setattr(grouped_fp8.ops, "grouped_mm_wgrad_fp8_out", fake_wgrad_out)
    offs = torch.tensor([100, 100, 300, 310], dtype=torch.int32)
    dy8, sdy = quantize_fp8(torch.randn(310, 256).bfloat16(), (1, 128), transpose=True, offs=offs)
    x8, sx = quantize_fp8(torch.randn(310, 128).bfloat16(), (1, 128), transpose=True, offs=offs)
    gpu["times"][names[-1]] = 0.5
    out = torch.zeros(4, 256, 128)
    distgemm.grouped_mm_wgrad(dy8, x8, offs, scale_dy=sdy, scale_x=sx, out=out, accumulate=True)
    assert torch.equal(out, torch.ones_like(out)), "the timing runs added into the call's output"
    key = f"sm90|grouped-wgrad|G4|T{dy8.shape[1]}|256x128|torch.float8_e4m3fn->torch.float32|scale:2|acc:1|torch:0"
    assert autotune.lookup(key) == names[-1] and runs[-1] == (len(names) - 1, out.data_ptr())
    runs.clear()
    distgemm.grouped_mm_wgrad(dy8, x8, offs, scale_dy=sdy, scale_x=sx, out=out, accumulate=True)
    assert runs == [(len(names) - 1, out.data_ptr())] and gpu["timings"] == 1


def test_autograd_calls_take_the_settled_runner_and_the_dgrad_its_own_problem(gpu):
    # gemm with grads: the forward (inside autograd's Function) runs the runner the first call
    # settled; the dgrad reads b N-major in place, a problem of its own (b:N in its key).
    a, b = bf16()
    gpu["times"]["cublas"] = 0.5
    a.requires_grad_()
    out = distgemm.gemm(a, b)
    out.float().sum().backward()
    assert autotune.lookup("sm90|32x48x64|torch.bfloat16->torch.bfloat16|b:K|c:none|cublas:1") == "cublas"
    assert autotune.lookup("sm90|32x64x48|torch.bfloat16->torch.bfloat16|b:N|c:none|cublas:1") == "cublas"
    timings = gpu["timings"]
    gpu["ran"].clear()
    with gpu["natively"]():
        distgemm.gemm(a, b).float().sum().backward()
    assert gpu["timings"] == timings and gpu["ran"] == ["cublas", "cublas"]  # forward, dgrad: nothing timed
    torch.testing.assert_close(a.grad.float(), 2 * b.float().sum(0).expand(32, 64), rtol=2e-2, atol=2e-2)


def test_block_scaled_runner_never_hands_a_graph_tensor_to_eager_calls(gpu, monkeypatch):
    # Our block-scaled kernel's remembered runner holds the one-group offs. Made during CUDA-graph
    # capture, offs is the graph's memory, filled only on replay: eager calls must make their own,
    # and captured calls theirs (a graph must not read a tensor the table may drop).
    state = {"capturing": True}
    monkeypatch.setattr(dense, "_capturing", lambda t: state["capturing"])
    monkeypatch.setattr(autotune, "may_time", lambda: not state["capturing"])
    one_group = dense._one_group

    def tagged(a):
        offs = one_group(a)
        offs.made_in_capture = state["capturing"]
        return offs
    monkeypatch.setattr(dense, "_one_group", tagged)
    seen = []

    def fake_grouped_fp8(x, w, offs, **kwargs):
        seen.append((state["capturing"], getattr(offs, "made_in_capture", None)))
        return (x.float() @ w[0].float().T).to(BF16)
    monkeypatch.setattr(grouped_fp8, "grouped_mm_fp8", fake_grouped_fp8)
    a, b, sa, sb = block(n=40)  # N % 16 != 0: F.scaled_mm refuses, ours is the lone taker
    for capturing in (True, False, False, True):
        state["capturing"] = capturing
        distgemm.gemm(a, b, scale_a=sa, scale_b=sb)
    assert dense._REPEAT_CALLS and autotune.last_backend() == "cutlass:grouped"
    assert seen == [(True, True), (False, False), (False, False), (True, True)], seen


@pytest.mark.parametrize("name, value", [("alpha", True), ("beta", False), ("alpha", np.True_), ("beta", np.False_)])
def test_a_repeated_call_refuses_bool_alpha_and_beta_as_the_first_does(gpu, name, value):
    """bool hashes and compares equal to 1 and 0: the table of repeat calls must not answer a
    call whose checks refuse it."""
    for a, b, scales in ((*bf16(), {}), (*fp8()[:2], dict(scale_a=fp8()[2], scale_b=fp8()[3]))):
        distgemm.gemm(a, b, **scales, **{name: float(value)})  # settled and remembered
        with pytest.raises(TypeError, match=f"{name} must be a real number"):
            distgemm.gemm(a, b, **scales, **{name: value})
        distgemm.gemm(a, b, **scales, **{name: int(value)})  # an int is a real number


@pytest.mark.parametrize("flags", [dict(trans_w=1.0), dict(use_fast_accum="yes"), dict(use_fast_accum=None)])
def test_a_repeated_grouped_call_refuses_the_flags_its_first_call_refuses(grouped_gpu, flags):
    """1.0 hashes and compares equal to True; use_fast_accum is checked, not part of the call:
    the table of repeat calls must not answer a call whose checks refuse it."""
    x, w, offs = routed()
    distgemm.grouped_mm(x, w, offs)
    distgemm.grouped_mm(x, w, offs)  # remembered
    with pytest.raises(TypeError, match="must be True or False"):
        distgemm.grouped_mm(x, w, offs, **flags)


@pytest.mark.parametrize("backend", ["torch", "cutlass", "cublas", "auto"])
def test_grouped_without_groups_leaves_out_as_it_was(grouped_gpu, backend):
    """G = 0: no rows belong to a group, so out keeps every row (the torch backend read offs[-1])."""
    x, w, offs = routed()
    out = torch.full((100, 64), 7.0, dtype=BF16)
    with distgemm.settings(grouped_backend=backend):
        assert distgemm.grouped_mm(x, w[:0], offs[:0], out=out) is out
    assert torch.all(out == 7)
