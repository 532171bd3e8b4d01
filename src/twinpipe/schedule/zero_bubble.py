"""Hand-crafted zero-bubble schedules ZB-H1 and ZB-H2 (Qi et al., 2024).

Splitting the backward into B (input gradient, on the critical path) and W (weight gradient, not
needed by any other stage) lets each rank postpone W's into the bubbles of 1F1B:

- ZB-H1: 1F1B's warm-up; rank r defers its first r W's to the end. Same peak memory as 1F1B.
- ZB-H2: twice the warm-up forwards (2(p-1-r)); rank r defers 2r W's. About twice the memory,
  and with T_F + T_B >= 2 T_W no bubble at all in the steady state.
"""

from __future__ import annotations

from twinpipe.schedule._args import check_int
from twinpipe.schedule.one_f_one_b import one_f_one_b_order
from twinpipe.schedule.ops import B, F, Op, Schedule, W
from twinpipe.schedule.placement import linear

__all__ = ["zb_h1", "zb_h2"]


def _handcrafted(name: str, num_ranks: int, num_microbatches: int, factor: int) -> Schedule:
    p = check_int(name, "num_ranks", num_ranks)
    m = check_int(name, "num_microbatches", num_microbatches)
    ops = []
    for r in range(p):
        rank_ops: list[Op] = []
        deferred = factor * r  # the W's of the first `deferred` backwards wait until the tail
        next_w = 0
        for kind, j in one_f_one_b_order(m, factor * (p - 1 - r)):
            if kind == "F":
                rank_ops.append(F(r, j))
                continue
            rank_ops.append(B(r, j))
            if j >= deferred:
                rank_ops.append(W(r, next_w))
                next_w += 1
        rank_ops += [W(r, j) for j in range(next_w, m)]
        ops.append(tuple(rank_ops))
    return Schedule(name, linear(p), m, tuple(ops))


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1 on any ``num_ranks`` >= 1 and ``num_microbatches`` >= 1 (the bubble formula needs m >= p)."""
    return _handcrafted("zb-h1", num_ranks, num_microbatches, 1)


def zb_h2(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H2 on any ``num_ranks`` >= 1 and ``num_microbatches`` >= 1 (the bubble formula needs m >= 2p-1)."""
    return _handcrafted("zb-h2", num_ranks, num_microbatches, 2)
