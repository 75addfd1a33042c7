"""The torch binding's host-side ops (no device needed) hand the C API ints: an int64 argument
that does not fit in a 32-bit int is refused with a ValueError naming it, never truncated into
another valid value (2**32 + 90 read as arch 90, 2**32 + 2 as world 2, 2**32 as device 0)."""

import pytest
import torch

import distgemm  # noqa: F401  (loads the ops)

ops = torch.ops.distgemm
BF16 = torch.bfloat16
WIDE = (2**32 + 90, 2**31, -(2**31) - 1, 2**62)


@pytest.mark.parametrize("arch", WIDE)
def test_gemm_queries_refuse_an_arch_past_int(arch):
    with pytest.raises(ValueError, match="arch must fit in a 32-bit int"):
        ops.gemm_configs(BF16, BF16, BF16, True, arch)
    with pytest.raises(ValueError, match="arch must fit in a 32-bit int"):
        ops.gemm_select_config(256, 256, 256, BF16, BF16, BF16, True, arch, 132)
    with pytest.raises(ValueError, match="arch must fit in a 32-bit int"):
        ops.grouped_configs(0, BF16, BF16, arch, 0)


def test_gemm_select_config_refuses_an_sm_count_past_int():
    assert ops.gemm_select_config(256, 256, 256, BF16, BF16, BF16, True, 90, 132) >= -1
    with pytest.raises(ValueError, match="sm_count must fit in a 32-bit int"):
        ops.gemm_select_config(256, 256, 256, BF16, BF16, BF16, True, 90, 2**32 + 132)


@pytest.mark.parametrize("kind,scale_mode,bad", [(2**32, 0, "kind"), (0, 2**32 + 2, "scale_mode")])
def test_grouped_configs_refuse_enums_past_int(kind, scale_mode, bad):
    with pytest.raises(ValueError, match=f"{bad} must fit in a 32-bit int"):
        ops.grouped_configs(kind, BF16, BF16, 90, scale_mode)


def test_grouped_configs_of_an_unknown_kind_or_mode_are_empty():
    # In int but outside the enumeration: the core matches no kernel (no truncation to a valid one).
    assert ops.grouped_configs(7, BF16, BF16, 90, 0) == []
    assert ops.grouped_configs(0, BF16, BF16, 90, 7) == []


def test_tp_workspace_size_refuses_a_world_or_kind_past_int():
    size = ops.tp_workspace_size(1, 128, 128, 128, BF16, BF16, 2)
    assert size > 0
    with pytest.raises(ValueError, match="world must fit in a 32-bit int"):
        ops.tp_workspace_size(1, 128, 128, 128, BF16, BF16, 2**32 + 2)
    with pytest.raises(ValueError, match="kind must fit in a 32-bit int"):
        ops.tp_workspace_size(2**32 + 1, 128, 128, 128, BF16, BF16, 2)


@pytest.mark.parametrize("device", [2**32, -(2**32)])
def test_tp_error_word_refuses_a_device_past_int(device):
    with pytest.raises(ValueError, match="device must fit in a 32-bit int"):
        ops.tp_error(device)
    with pytest.raises(ValueError, match="device must fit in a 32-bit int"):
        ops.tp_clear_error(device)
