"""The MoE API's answers to a new user's mistakes (distgemm.moe and distgemm.nn's MoE modules):
each is a ValueError or TypeError that starts with the public name of the call and names the
argument and what it got; never a crash from deeper down, nor a silent wrong answer. CPU
tensors, where the values (expert ids, offs, rows) are checked on the host."""

import pytest
import torch

from distgemm import moe
from distgemm import nn as dnn

BF16 = torch.bfloat16


def _x(tokens=4, hidden=16):
    return torch.randn(tokens, hidden).to(BF16)


def _ids():
    return torch.tensor([[0, 1], [1, 0], [0, -1], [1, 1]])


def _w():
    return torch.rand(4, 2)


def _offs(*ends):
    return torch.tensor(ends or (2, 4), dtype=torch.int32)


def _w1():
    return torch.randn(2, 16, 16).to(BF16)  # SwiGLU: (G, 2 * ffn, hidden), ffn = 8


def _w2():
    return torch.randn(2, 16, 8).to(BF16)


def _permuted():
    return moe.permute(_x(), _ids(), 2)


CASES = [
    # route / permute: topk_ids and num_experts
    (lambda: moe.route([[0, 1]], 2), ValueError, r"^distgemm\.moe\.route: topk_ids must be a 2-D .* got list"),
    (lambda: moe.route(None, 2), ValueError, r"^distgemm\.moe\.route: topk_ids .* got NoneType"),
    (lambda: moe.route(torch.tensor([0, 1]), 2), ValueError,
     r"^distgemm\.moe\.route: topk_ids .* got torch\.int64 of shape \(2,\)"),
    (lambda: moe.route(_ids().float(), 2), ValueError, r"^distgemm\.moe\.route: topk_ids .* got torch\.float32"),
    (lambda: moe.route(_ids().to(torch.int8), 2), ValueError, r"^distgemm\.moe\.route: topk_ids .* got torch\.int8"),
    (lambda: moe.route(_ids().bool(), 2), ValueError, r"^distgemm\.moe\.route: topk_ids .* got torch\.bool"),
    (lambda: moe.route(_ids(), 0), ValueError, r"^distgemm\.moe\.route: num_experts must be an int .* got 0"),
    (lambda: moe.route(_ids(), 2.0), ValueError, r"^distgemm\.moe\.route: num_experts .* got 2\.0"),
    (lambda: moe.route(_ids(), 1), ValueError, r"^distgemm\.moe\.route: topk_ids must be expert indices in \[0, 1\)"),
    (lambda: moe.route(torch.tensor([[-2, 0]]), 2), ValueError, r"topk_ids .* got values in \[-2, 0\]"),
    (lambda: moe.permute([[1.0]], _ids(), 2), ValueError, r"^distgemm\.moe\.permute: x must be a 2-D .* got list"),
    (lambda: moe.permute(_x(5), _ids(), 2), ValueError,
     r"^distgemm\.moe\.permute: topk_ids must have one row per token \(5\), got 4"),
    (lambda: moe.permute(_x(), _ids(), 2, fp8="blok"), ValueError, r"^distgemm\.moe\.permute: fp8 .* got 'blok'"),
    # unpermute
    (lambda: moe.unpermute(_permuted().rows.int(), _permuted().row_map, _w()), ValueError,
     r"^distgemm\.moe\.unpermute: y must be a floating-point tensor .* got torch\.int32"),
    (lambda: moe.unpermute(_permuted().rows, _permuted().row_map, _w(), None, 2), ValueError,
     r"^distgemm\.moe\.unpermute: num_experts \(got 2\) .* topk_ids is None"),
    (lambda: moe.unpermute(_permuted().rows, _permuted().row_map, _w(), [[0, 1]], 2), ValueError,
     r"^distgemm\.moe\.unpermute: topk_ids must be a 2-D .* got list"),
    (lambda: moe.unpermute(_permuted().rows, _permuted().row_map, torch.rand(4, 3), _ids(), 2), ValueError,
     r"^distgemm\.moe\.unpermute: topk_weights must have topk_ids' shape \(4, 2\), got \(4, 3\)"),
    (lambda: moe.unpermute(torch.randn(8, 16, device="meta"), torch.arange(8, device="meta"),
                           _w().to("meta"), _ids(), 2), ValueError,
     r"^distgemm\.moe\.unpermute: topk_ids is on cpu but y is on meta"),
    # gather
    (lambda: moe.gather(_x(), None), TypeError, r"^distgemm\.moe\.gather: routing must be .* got NoneType"),
    (lambda: moe.gather([[1.0]], moe.route(_ids(), 2)), ValueError, r"^distgemm\.moe\.gather: x must be .* got list"),
    (lambda: moe.gather(torch.randn(4), moe.route(_ids(), 2)), ValueError,
     r"^distgemm\.moe\.gather: x must be a 2-D .* got \(4,\)"),
    (lambda: moe.gather(_x(6), moe.route(_ids(), 2)), ValueError,
     r"^distgemm\.moe\.gather: x must have routing's 4 token rows \(k=2\), got 6"),
    # activation
    (lambda: moe.activation(_x(), ["gelu"]), ValueError, r"^distgemm\.moe\.activation: activation .* got \['gelu'\]"),
    (lambda: moe.activation(_x(), "gelu", dy=[1]), ValueError, r"^distgemm\.moe\.activation: dy must be .* got list"),
    (lambda: moe.activation(_x(), "gelu", fp8_transposed=True, offs=_offs(3, 1)), ValueError,
     r"^distgemm\.moe\.activation: offs must be non-negative and non-decreasing, got \[3, 1\]"),
    (lambda: moe.activation(_x(), "gelu", fp8_transposed=True, offs=_offs(2, 9)), ValueError,
     r"^distgemm\.moe\.activation: offs\[-1\] = 9 is past the 4 rows"),
    # quantize_weight
    (lambda: moe.quantize_weight([[[1.0]]]), ValueError, r"^distgemm\.moe\.quantize_weight: w must be .* got list"),
    # grouped_mlp
    (lambda: moe.grouped_mlp(_x(), _offs(3, 1), _w1(), _w2()), ValueError,
     r"^distgemm\.moe\.grouped_mlp: offs must be non-negative and non-decreasing, got \[3, 1\]"),
    (lambda: moe.grouped_mlp(_x(), _offs(2, 9), _w1(), _w2()), ValueError,
     r"^distgemm\.moe\.grouped_mlp: offs\[-1\] = 9 is past the 4 rows"),
    (lambda: moe.grouped_mlp(_x(), _offs(), _w1(), _w2(), fc1_bias=torch.zeros(2, 16, dtype=torch.long)), ValueError,
     r"^distgemm\.moe\.grouped_mlp: fc1_bias must be a floating-point \(2, 16\) tensor .* got torch\.int64"),
    (lambda: moe.grouped_mlp(_x(), moe.route(torch.zeros(4, 0, dtype=torch.long), 2).offs, _w1(), _w2(),
                             routing=moe.route(torch.zeros(4, 0, dtype=torch.long), 2)), ValueError,
     r"^distgemm\.moe\.grouped_mlp: routing must route each token to k >= 1 experts, got k=0"),
    # GroupedLinear
    (lambda: dnn.GroupedLinear(2, 16, 8, dtype=torch.float64), ValueError,
     r"^GroupedLinear: dtype must be torch\.bfloat16 or torch\.float16, got torch\.float64"),
    (lambda: dnn.GroupedLinear(2, 16, 8, dtype=torch.int32), ValueError, r"^GroupedLinear: dtype .* got torch\.int32"),
    (lambda: dnn.GroupedLinear(2, 16, 8, dtype="bf16"), ValueError, r"^GroupedLinear: dtype .* got bf16"),
    (lambda: dnn.GroupedLinear(2, 16, 8, fp8="block", dtype=torch.float32), ValueError,
     r"^GroupedLinear\(fp8='block'\): dtype must be torch\.bfloat16, got torch\.float32"),
    (lambda: dnn.GroupedLinear(2, 16, 8)(_x().float(), _offs()), ValueError,
     r"^GroupedLinear: x must have the weight's dtype torch\.bfloat16, got torch\.float32"),
    (lambda: dnn.GroupedLinear(2, 16, 8)(_x(), [2, 4]), TypeError, r"^GroupedLinear: offs must be .* got list"),
    (lambda: dnn.GroupedLinear(2, 16, 8, fp8="block")(_x(), [2, 4]), TypeError,
     r"^GroupedLinear: offs must be .* got list"),
    (lambda: dnn.GroupedLinear(2, 16, 8)(_x(), _offs(4)), ValueError,
     r"^GroupedLinear: offs must hold num_experts = 2 .* got shape \(1,\)"),
    (lambda: dnn.GroupedLinear(2, 16, 8)(_x(), _offs(2, 9)), ValueError, r"^GroupedLinear: offs\[-1\] = 9 is past"),
    (lambda: dnn.GroupedLinear(2, 16, 8)(_x(), _offs(), is_first_microbatch="yes"), ValueError,
     r"^GroupedLinear: is_first_microbatch must be None, True or False, got 'yes'"),
    (lambda: dnn.GroupedLinear(2, 16, 8)(_x().to("meta"), _offs().to("meta")), ValueError,
     r"^GroupedLinear: x is on meta but the weight is on cpu"),
    # GroupedMLP
    (lambda: dnn.GroupedMLP(2, 16, 8)(_x(), _offs(), is_first_microbatch="no"), ValueError,
     r"^GroupedMLP: is_first_microbatch must be None, True or False, got 'no'"),
    # MoEExperts
    (lambda: dnn.MoEExperts(2, 16, 8)(_x(4, 8), _ids(), _w()), ValueError,
     r"^MoEExperts: x must be a 2-D bfloat16 \(T, hidden=16\) tensor, got torch\.bfloat16 of shape \(4, 8\)"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x().float(), _ids(), _w()), ValueError, r"^MoEExperts: x .* got torch\.float32"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x(), _ids().float(), _w()), ValueError,
     r"^MoEExperts: topk_ids must be a 2-D \(T, k\) int32 or int64 tensor, got torch\.float32"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x(), torch.tensor([0, 1, 0, 1]), torch.rand(4)), ValueError,
     r"^MoEExperts: topk_ids .* got torch\.int64 of shape \(4,\)"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x(5), _ids(), _w()), ValueError,
     r"^MoEExperts: topk_ids must have one row per token \(5\), got 4"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x(), _ids() + 1, _w()), ValueError,
     r"^MoEExperts: topk_ids must be expert indices in \[0, 2\) or -1 \(dropped\), got values in \[0, 2\]"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x(), torch.zeros(4, 0, dtype=torch.long), torch.zeros(4, 0)), ValueError,
     r"^MoEExperts: topk_ids must route each token to k >= 1 experts, got shape \(4, 0\)"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x(), _ids(), None), ValueError,
     r"^MoEExperts: topk_weights must be a floating-point \(T, k\) tensor, got NoneType"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x(), _ids(), torch.ones(4, 2, dtype=torch.bool)), ValueError,
     r"^MoEExperts: topk_weights .* got torch\.bool"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x(), _ids(), torch.rand(2, 4)), ValueError,
     r"^MoEExperts: topk_weights must have topk_ids' shape \(4, 2\), got \(2, 4\)"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x(), _ids(), _w().to("meta")), ValueError,
     r"^MoEExperts: topk_weights is on meta but x is on cpu"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x().to("meta"), _ids(), _w()), ValueError,
     r"^MoEExperts: x is on meta but the experts' weights are on cpu"),
    (lambda: dnn.MoEExperts(2, 16, 8)(_x(), _ids(), _w(), is_first_microbatch="x"), ValueError,
     r"^MoEExperts: is_first_microbatch must be None, True or False, got 'x'"),
    (lambda: dnn.MoEExperts(0, 16, 8), ValueError, r"num_experts must be an int >= 1, got 0"),
    (lambda: dnn.MoEExperts(2, 16, 8, bias="yes"), TypeError, r"bias must be True or False, got str 'yes'"),
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_bad_input_is_named(i):
    call, error, message = CASES[i]
    with pytest.raises(error, match=message):
        call()


def test_routing_on_meta_tensors_gives_shapes():
    # Shape inference: the CPU-only value checks skip tensors without values.
    ids = _ids().to("meta")
    routing = moe.route(ids, 2)
    assert routing.offs.shape == (2,) and routing.offs.device.type == "meta"
    p = moe.permute(_x().to("meta"), ids, 2)
    assert p.rows.shape == (8, 16)
    out = moe.unpermute(torch.randn(8, 16, device="meta"), p.row_map, _w().to("meta"), ids, 2)
    assert out.shape == (4, 16) and out.device.type == "meta"
