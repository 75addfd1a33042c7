"""How grouped GEMMs read offs: the one host-side copy of the core's clamping rule, and the
checks of offs that the host can make."""

from __future__ import annotations

import torch

from . import _settings


def group_bounds(offs: torch.Tensor, tokens: int):
    """(start, end) row pairs of each group, clamped exactly as the core does: ends to
    [0, tokens], a decreasing end closing its group where it starts. Reads offs on the host."""
    ends = [min(max(e, 0), tokens) for e in offs.tolist()]
    starts = [0] + ends[:-1]
    return [(s, max(s, e)) for s, e in zip(starts, ends)]


def check_offs_tensor(op: str, offs) -> None:
    """offs is a 1-D int32 tensor, or a ValueError/TypeError naming what it got."""
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"{op}: offs must be a 1-D int32 tensor of cumulative group ends, got "
                        f"{type(offs).__name__}")
    if offs.dtype != torch.int32 or offs.dim() != 1:
        raise ValueError(f"{op}: offs must be a 1-D int32 tensor of cumulative group ends, got "
                         f"{offs.dtype} of shape {tuple(offs.shape)}")


def check_offs_values(op: str, offs: torch.Tensor, tokens: int, rows: str = "rows of the input") -> None:
    """offs non-negative, non-decreasing and within ``tokens`` rows, checked on the host where
    that is free: CPU tensors always, GPU ones with DISTGEMM_DEBUG=1 (a device sync). Elsewhere
    the kernels clamp them (in bounds, unspecified results)."""
    if torch.compiler.is_compiling() or offs.device.type == "meta":
        return
    if offs.device.type != "cpu" and not _settings.current().debug:
        return
    ends = offs.tolist()
    if any(e < 0 for e in ends) or any(b < a for a, b in zip(ends, ends[1:])):
        raise ValueError(f"{op}: offs must be non-negative and non-decreasing, got {_preview(ends)}")
    if ends and ends[-1] > tokens:
        raise ValueError(f"{op}: offs[-1] = {ends[-1]} is past the {tokens} {rows}")


def _preview(ends, limit: int = 16) -> str:
    return str(ends) if len(ends) <= limit else f"{ends[:limit]} ... ({len(ends)} values)"
