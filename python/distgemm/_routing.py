"""How grouped GEMMs read offs: the one host-side copy of the core's clamping rule."""

from __future__ import annotations

import torch


def group_bounds(offs: torch.Tensor, tokens: int):
    """(start, end) row pairs of each group, clamped exactly as the core does: ends to
    [0, tokens], a decreasing end closing its group where it starts. Reads offs on the host."""
    ends = [min(max(e, 0), tokens) for e in offs.tolist()]
    starts = [0] + ends[:-1]
    return [(s, max(s, e)) for s, e in zip(starts, ends)]
