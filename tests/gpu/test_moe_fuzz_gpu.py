"""Property tests (hypothesis) of the MoE layer on the GPU kernels, against the per-slot FP32
loop of tests/cpu/test_moe_layer_fuzz_cpu.py computed on the host: nn.MoEExperts (the routing
kernels, the permute folded into the FP8 quantization pass, the activation passes, the grouped
GEMMs) and GroupedMLP on offs, in bf16 and both FP8 recipes, on sizes the fixed tests do not
hold: token counts across several 128-row tiles and partial ones, 1 to 64 experts with some
unused, top-1 to top-8 with router drops and a token routed twice to one expert, widths that
are and are not multiples of 128, biases, save_original_input and fused wgrads into main_grad
(added to, or overwritten). Bands as that module states them.

DISTGEMM_FUZZ_EXAMPLES sets the number of cases of each test (default 40);
DISTGEMM_FUZZ_DEVICE=cpu runs the harness on the CPU reference path.
"""

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from distgemm.nn import GroupedMLP  # noqa: E402
from tests.cpu.test_moe_layer_fuzz_cpu import (bands, check_close, check_moe_experts, grad_or_zeros,  # noqa: E402
                                               leaves, make_params, routings)
from tests.fuzz_helpers import fuzz_examples  # noqa: E402
from tests.moe_reference import expert_mlp_reference  # noqa: E402

DEV = os.environ.get("DISTGEMM_FUZZ_DEVICE", "cuda")  # "cpu": a check of the harness through the reference path
pytestmark = pytest.mark.gpu if DEV == "cuda" else []
FUZZ = settings(max_examples=fuzz_examples(40), derandomize=True, deadline=None, database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# FP8 GEMMs need hidden and ffn to be multiples of 16; 128 and its neighbours take the passes'
# whole-block and partial-block paths.
WIDTHS = st.one_of(st.sampled_from([16, 112, 128, 144, 256, 272, 384]), st.integers(1, 40).map(lambda n: 16 * n))
LAYER_SIZES = dict(max_tokens=1500, max_k=8, max_experts=64)


@pytest.mark.parametrize("fp8", [None, "block", "row"])
@FUZZ
@given(c=routings(**LAYER_SIZES), hidden=WIDTHS, ffn=WIDTHS, kind=st.sampled_from(["swiglu", "gelu"]),
       bias=st.booleans(), save_input=st.booleans(), w_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_moe_experts_on_the_gpu_matches_the_per_slot_loop(fp8, c, hidden, ffn, kind, bias, save_input, w_dtype):
    check_moe_experts(fp8, c, hidden, ffn, kind, bias, save_input, None, w_dtype, device=DEV)


@pytest.mark.parametrize("fp8", [None, "block", "row"])
@FUZZ
@given(counts=st.lists(st.one_of(st.just(0), st.integers(1, 40), st.integers(100, 700)), min_size=1, max_size=24),
       hidden=WIDTHS, ffn=WIDTHS, kind=st.sampled_from(["swiglu", "gelu"]), overwrite=st.booleans(),
       tail=st.integers(0, 200), seed=st.integers(0, 2 ** 16))
def test_grouped_mlp_into_main_grad_on_the_gpu(fp8, counts, hidden, ffn, kind, overwrite, tail, seed):
    """GroupedMLP on offs with rows past offs[-1] (`tail` of them, NaN: nothing may read them),
    its weight gradients into main_grad: added to ones, or written over NaN with
    overwrite_main_grad."""
    g, t = len(counts), sum(counts)
    gen = torch.Generator().manual_seed(seed)
    w1, w2, _, _ = make_params(g, hidden, ffn, kind, False, gen)
    layer = GroupedMLP(g, hidden, ffn, activation=kind, fp8=fp8, fuse_wgrad_accumulation=True, device=DEV)
    with torch.no_grad():
        layer.fc1_weight.copy_(w1)
        layer.fc2_weight.copy_(w2)
    for p in (layer.fc1_weight, layer.fc2_weight):
        p.main_grad = torch.full(p.shape, float("nan") if overwrite else 1.0, device=DEV)
        p.overwrite_main_grad = overwrite
    x_host = torch.randn(t + tail, hidden, generator=gen).bfloat16()
    dy_host = torch.randn(t + tail, hidden, generator=gen).bfloat16()
    x_host[t:] = float("nan")
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = x_host.to(DEV).requires_grad_()
    y = layer(x, offs.to(DEV))
    y.backward(dy_host.to(DEV))

    xr, w1r, w2r = leaves(x_host[:t], w1, w2)
    yr = expert_mlp_reference(xr, counts, w1r, w2r, kind)
    if t:
        yr.backward(dy_host[:t].float())
    out_band, grad_band = bands(fp8, t, hidden, ffn)
    check_close("y", y[:t].cpu(), yr.detach(), out_band)
    check_close("dx", x.grad[:t].cpu(), grad_or_zeros(xr), grad_band)
    for name, p, r in (("fc1", layer.fc1_weight, w1r), ("fc2", layer.fc2_weight, w2r)):
        got = p.main_grad.cpu() - (0.0 if overwrite else 1.0)
        check_close(f"{name} main_grad", got, grad_or_zeros(r), grad_band)
        for e, n in enumerate(counts):
            if n == 0:
                assert torch.all(got[e] == 0), f"{name}: expert {e} without tokens"
