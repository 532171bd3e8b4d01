"""Which rank is persistently slower than the others: a pure function of the ranks' recent step times."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["WINDOW", "RATIO", "slow_rank"]

WINDOW = 20  # steps a rank must have been slow over
RATIO = 1.2  # how much slower than the median rank counts as slow


def slow_rank(history: Sequence[Sequence[float]], window: int = WINDOW, ratio: float = RATIO) -> tuple[int, float] | None:
    """``(rank, how many times the median)`` of the slowest rank whose median time over the last
    ``window`` steps is at least ``ratio`` x the median of all ranks' medians; None when none is, or
    fewer than ``window`` steps are known. ``history``: per step, every rank's time, by rank."""
    recent = history[-window:]
    if len(recent) < window or not recent[0]:
        return None
    medians = [statistics.median(step[rank] for step in recent) for rank in range(len(recent[0]))]
    typical = statistics.median(medians)
    if typical <= 0:
        return None
    rank = max(range(len(medians)), key=medians.__getitem__)
    slower = medians[rank] / typical
    return (rank, slower) if slower >= ratio else None
