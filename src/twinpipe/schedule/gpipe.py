"""GPipe: every forward, then every full backward."""

from __future__ import annotations

from twinpipe.schedule._args import check_int
from twinpipe.schedule.ops import BW, F, Schedule
from twinpipe.schedule.placement import linear

__all__ = ["gpipe"]


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe on any ``num_ranks`` >= 1 and ``num_microbatches`` >= 1; holds all m activations."""
    p = check_int("gpipe", "num_ranks", num_ranks)
    m = check_int("gpipe", "num_microbatches", num_microbatches)
    ops = tuple(tuple([F(r, j) for j in range(m)] + [BW(r, j) for j in range(m)]) for r in range(p))
    return Schedule("gpipe", linear(p), m, ops)
