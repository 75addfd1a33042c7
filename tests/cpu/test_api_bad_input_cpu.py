"""Every public call, every argument, a range of wrong values (None, numbers, strings, lists,
dtypes, tensors of the wrong rank, dtype, width or layout): each is refused with a ValueError,
TypeError or NotImplementedError, never an AttributeError, IndexError or an unrelated
RuntimeError from deeper down (the README's promise for bad input). CPU tensors; the checks run
before any device work."""

import pytest
import torch

import distgemm
from distgemm import moe
from distgemm.quantize import dequantize_fp8
from distgemm import nn as dnn

BF16 = torch.bfloat16
NAMED = (ValueError, TypeError, NotImplementedError)


def _bad_values():
    return [None, -1, 0, True, 2.5, float("nan"), "s", [1, 2], torch.float16, torch.float8_e4m3fn,
            torch.tensor(1.0), torch.randn(3), torch.randn(2, 3, 4), torch.randn(10, 16).double(),
            torch.zeros(10, 16, dtype=torch.int32), torch.empty(0, 16, dtype=BF16),
            torch.randn(10, 32).to(BF16)[:, ::2]]


def _x():
    return torch.randn(10, 16).to(BF16)


def _offs():
    return torch.tensor([4, 10], dtype=torch.int32)


def _x8():
    return torch.randn(10, 16).to(torch.float8_e4m3fn)


def _fp8_grouped(**overrides):
    """An FP8 grouped forward with 128-block scales, one argument replaced."""
    args = dict(x=_x8(), w=torch.randn(2, 8, 16).to(torch.float8_e4m3fn), offs=_offs(), scale_x=torch.ones(10, 1),
                scale_w=torch.ones(2, 1, 1))
    return distgemm.grouped_mm(**{**args, **overrides})


def _fp8_wgrad(**overrides):
    """An FP8 wgrad in the padded transposed layout, one argument replaced."""
    offs = _offs()
    dy, sdy = distgemm.quantize_fp8(torch.randn(10, 8), (1, 128), transpose=True, offs=offs)
    x, sx = distgemm.quantize_fp8(torch.randn(10, 16), (1, 128), transpose=True, offs=offs)
    args = dict(dy=dy, x=x, offs=offs, scale_dy=sdy, scale_x=sx)
    return distgemm.grouped_mm_wgrad(**{**args, **overrides})


def _w1():
    return torch.randn(2, 16, 16).to(BF16)


def _w2():
    return torch.randn(2, 16, 8).to(BF16)


CALLS = {
    "gemm a": lambda v: distgemm.gemm(v, _x()),
    "gemm b": lambda v: distgemm.gemm(_x(), v),
    "gemm c": lambda v: distgemm.gemm(_x(), _x(), v),
    "gemm out_dtype": lambda v: distgemm.gemm(_x(), _x(), out_dtype=v),
    "gemm scale_a": lambda v: distgemm.gemm(_x(), _x(), scale_a=v),
    "gemm alpha": lambda v: distgemm.gemm(_x(), _x(), alpha=v),
    "gemm use_fast_accum": lambda v: distgemm.gemm(_x(), _x(), use_fast_accum=v),
    "grouped_mm x": lambda v: distgemm.grouped_mm(v, torch.randn(2, 8, 16).to(BF16), _offs()),
    "grouped_mm w": lambda v: distgemm.grouped_mm(_x(), v, _offs()),
    "grouped_mm offs": lambda v: distgemm.grouped_mm(_x(), torch.randn(2, 8, 16).to(BF16), v),
    "grouped_mm out": lambda v: distgemm.grouped_mm(_x(), torch.randn(2, 8, 16).to(BF16), _offs(), out=v),
    "grouped_mm trans_w": lambda v: distgemm.grouped_mm(_x(), torch.randn(2, 8, 16).to(BF16), _offs(), trans_w=v),
    "grouped_mm accumulate": lambda v: distgemm.grouped_mm(_x(), torch.randn(2, 8, 16).to(BF16), _offs(),
                                                           accumulate=v),
    "grouped_mm_wgrad dy": lambda v: distgemm.grouped_mm_wgrad(v, _x(), _offs()),
    "grouped_mm_wgrad out": lambda v: distgemm.grouped_mm_wgrad(torch.randn(10, 8).to(BF16), _x(), _offs(), out=v,
                                                                accumulate=True),
    "grouped_mm_wgrad x": lambda v: distgemm.grouped_mm_wgrad(torch.randn(10, 8).to(BF16), v, _offs()),
    "grouped_mm_wgrad offs": lambda v: distgemm.grouped_mm_wgrad(torch.randn(10, 8).to(BF16), _x(), v),
    "grouped_mm out_dtype": lambda v: distgemm.grouped_mm(_x(), torch.randn(2, 8, 16).to(BF16), _offs(), out_dtype=v),
    "grouped_mm fp8 x": lambda v: _fp8_grouped(x=v),
    "grouped_mm fp8 w": lambda v: _fp8_grouped(w=v),
    "grouped_mm fp8 out": lambda v: _fp8_grouped(out=v),
    "grouped_mm fp8 out_dtype": lambda v: _fp8_grouped(out_dtype=v),
    "grouped_mm fp8 scale_x": lambda v: _fp8_grouped(scale_x=v),
    "grouped_mm fp8 scale_w": lambda v: _fp8_grouped(scale_w=v),
    "grouped_mm_wgrad fp8 out": lambda v: _fp8_wgrad(out=v),
    "grouped_mm_wgrad fp8 x": lambda v: _fp8_wgrad(x=v),
    "grouped_mm_wgrad fp8 scale_dy": lambda v: _fp8_wgrad(scale_dy=v),
    "gemm fp8 scale_b": lambda v: distgemm.gemm(_x8(), _x8(), scale_a=torch.ones(1), scale_b=v),
    "gemm fp8 c": lambda v: distgemm.gemm(_x8(), _x8(), v, beta=1.0, scale_a=torch.ones(1), scale_b=torch.ones(1)),
    "gemm beta": lambda v: distgemm.gemm(_x(), _x(), beta=v),
    "dequantize_fp8 scale": lambda v: dequantize_fp8(_x8(), v, (1, 128)),
    "dequantize_fp8 granularity": lambda v: dequantize_fp8(_x8(), torch.ones(10, 1), v),
    "quantize_fp8 transpose": lambda v: distgemm.quantize_fp8(_x(), (1, 128), transpose=v),
    "quantize_fp8 x": lambda v: distgemm.quantize_fp8(v, "row"),
    "quantize_fp8 granularity": lambda v: distgemm.quantize_fp8(_x(), v),
    "quantize_fp8 dtype": lambda v: distgemm.quantize_fp8(_x(), "row", dtype=v),
    "quantize_fp8 offs": lambda v: distgemm.quantize_fp8(_x(), (1, 128), transpose=True, offs=v),
    "activation x": lambda v: moe.activation(v, "gelu"),
    "activation kind": lambda v: moe.activation(_x(), v),
    "activation dy": lambda v: moe.activation(_x(), "gelu", dy=v),
    "activation bf16": lambda v: moe.activation(_x(), "gelu", bf16=v),
    "quantize_weight w": lambda v: moe.quantize_weight(v),
    "quantize_weight recipe": lambda v: moe.quantize_weight(_w1(), v),
    "grouped_mlp x": lambda v: moe.grouped_mlp(v, _offs(), _w1(), _w2()),
    "grouped_mlp offs": lambda v: moe.grouped_mlp(_x(), v, _w1(), _w2()),
    "grouped_mlp fc1_weight": lambda v: moe.grouped_mlp(_x(), _offs(), v, _w2()),
    "grouped_mlp fc2_weight": lambda v: moe.grouped_mlp(_x(), _offs(), _w1(), v),
    "grouped_mlp activation": lambda v: moe.grouped_mlp(_x(), _offs(), _w1(), _w2(), activation=v),
    "grouped_mlp fp8": lambda v: moe.grouped_mlp(_x(), _offs(), _w1(), _w2(), fp8=v),
    "grouped_mlp fuse": lambda v: moe.grouped_mlp(_x(), _offs(), _w1(), _w2(), fuse_wgrad_accumulation=v),
    "permute x": lambda v: moe.permute(v, torch.zeros(10, 2, dtype=torch.long), 3),
    "permute topk_ids": lambda v: moe.permute(_x(), v, 3),
    "permute num_experts": lambda v: moe.permute(_x(), torch.zeros(10, 2, dtype=torch.long), v),
    "unpermute y": lambda v: moe.unpermute(v, torch.arange(20), torch.rand(10, 2)),
    "unpermute row_map": lambda v: moe.unpermute(torch.randn(20, 16), v, torch.rand(10, 2)),
    "unpermute topk_weights": lambda v: moe.unpermute(torch.randn(20, 16), torch.arange(20), v),
    "GroupedLinear num_experts": lambda v: dnn.GroupedLinear(v, 16, 8),
    "GroupedLinear forward x": lambda v: dnn.GroupedLinear(2, 16, 8)(v, _offs()),
    "GroupedLinear forward offs": lambda v: dnn.GroupedLinear(2, 16, 8)(_x(), v),
    "GroupedMLP hidden": lambda v: dnn.GroupedMLP(2, v, 8),
    "GroupedMLP bias": lambda v: dnn.GroupedMLP(2, 16, 8, bias=v),
    "GroupedMLP forward x": lambda v: dnn.GroupedMLP(2, 16, 8)(v, _offs()),
    "MoEExperts topk_ids": lambda v: dnn.MoEExperts(2, 16, 8)(_x(), v, torch.rand(10, 2)),
    "MoEExperts topk_weights": lambda v: dnn.MoEExperts(2, 16, 8)(_x(), torch.zeros(10, 2, dtype=torch.long), v),
    "settings timeout_s": lambda v: _enter_settings(timeout_s=v),
    "settings tp_pieces": lambda v: _enter_settings(tp_pieces=v),
    "settings grouped_backend": lambda v: _enter_settings(grouped_backend=v),
    "settings debug": lambda v: _enter_settings(debug=v),
    "settings autotune": lambda v: _enter_settings(autotune=v),
    "settings cache_dir": lambda v: _enter_settings(cache_dir=v),
}


def _enter_settings(**overrides):
    with distgemm.settings(**overrides):
        pass


@pytest.mark.parametrize("call", sorted(CALLS))
def test_bad_values_are_named(call):
    unnamed = []
    for v in _bad_values():
        try:
            CALLS[call](v)
        except NAMED:
            continue
        except Exception as e:  # noqa: BLE001  (what the test looks for)
            unnamed.append(f"{type(v).__name__} {getattr(v, 'shape', v)!s:.40}: {type(e).__name__}: {str(e)[:120]}")
    assert not unnamed, "\n".join(unnamed)


def test_fp8_grouped_calls_name_a_non_tensor_operand():
    """The argument named is the one that is wrong (not the scales that came with it)."""
    with pytest.raises(TypeError, match="grouped_mm: x must be a torch.Tensor, got list"):
        _fp8_grouped(x=[[1.0]])
    with pytest.raises(TypeError, match="grouped_mm_wgrad: dy must be a torch.Tensor, got list"):
        _fp8_wgrad(dy=[[1.0]])
