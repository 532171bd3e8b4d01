"""1F1B (PipeDream-flush): a few warm-up forwards, then one forward and one full backward in turn."""

from __future__ import annotations

from typing import Iterator

from twinpipe.schedule._args import check_int
from twinpipe.schedule.ops import BW, F, Schedule
from twinpipe.schedule.placement import linear

__all__ = ["one_f_one_b", "one_f_one_b_order"]


def one_f_one_b_order(num_microbatches: int, warmup: int) -> Iterator[tuple[str, int]]:
    """("F", j) / ("B", j) in 1F1B order after ``warmup`` forwards: F, B, F, B, ..., then the last B's.

    Shared with the zero-bubble H1/H2 schedules, which only add W's to it.
    """
    warmup = min(warmup, num_microbatches)
    for j in range(warmup):
        yield "F", j
    for j in range(num_microbatches):
        if warmup + j < num_microbatches:
            yield "F", warmup + j
        yield "B", j


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B on any ``num_ranks`` >= 1 and ``num_microbatches`` >= 1.

    Rank r runs p-1-r warm-up forwards: exactly enough that the last rank's first backward can
    come back to it without the rank idling in between (under equal stage times); so rank r holds
    at most p-r activations.
    """
    p = check_int("1f1b", "num_ranks", num_ranks)
    m = check_int("1f1b", "num_microbatches", num_microbatches)
    ops = []
    for r in range(p):
        ops.append(tuple(F(r, j) if kind == "F" else BW(r, j) for kind, j in one_f_one_b_order(m, p - 1 - r)))
    return Schedule("1f1b", linear(p), m, tuple(ops))
