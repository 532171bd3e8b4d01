"""BitPipe (Wu, Chen, Yu, 2024): a V-shaped interleaved pipeline in each of two directions.

D ranks (even) hold two copies of a 2D-chunk model (the ``dual_v`` placement): the *down* V
(chain 0) puts chunks i and 2D-1-i on rank i, the *up* V (chain 1) is its mirror, chunks D-1-i
and D+i on rank i. Four chunks per rank; the tip of each V (chunks D-1 and D) sits on one rank and
is handed over locally. Half the micro-batches go down, half up.

The op order comes from list scheduling in the paper's units: a chunk's forward takes 1, its full
backward 2. A *basic unit* is D micro-batches, D/2 per direction; in it, micro-batch i of each
direction enters its first chunk at time 2i (one every two units, so the forwards of both V's
interleave without meeting on a rank). Whenever a rank is free it runs, by preference, a ready
backward (oldest micro-batch first, the later chunk first), else the ready forward that entered
first. Each rank then runs its ops in the order they started. One unit reproduces the paper's
figure (D = 4: rank 0's order and a span of 28 for 24 of work).

Units: unit u may enter 2D after unit u-1, sooner than the ranks can finish one (6D of work per
rank), so the next unit's forwards are at hand to fill the previous unit's tail bubbles; backwards
go first, so forwards mostly fill idle time. Simulated with T_B = 2 T_F, the bubble and the peak
activations stop growing after a few units for D <= 16 (tests/test_bidirectional.py checks
D <= 8); for larger D they still creep up slowly (D = 24, 4 to 32 units: idle 69 to 75, peak 71
to 78 chunk activations). There is no memory cap.
"""

from __future__ import annotations

from twinpipe.schedule.chimera import check_even
from twinpipe.schedule.costs import CostModel, op_time
from twinpipe.schedule.ops import BW, F, Op, Schedule
from twinpipe.schedule.placement import dual_v

__all__ = ["bitpipe"]

_NAME = "bitpipe"
_UNITS = CostModel(t_f=1, t_b=1, t_w=1)  # the paper's units: a chunk's forward 1, its full backward (B and W) 2
_T_F, _T_BW = op_time(F(0, 0), _UNITS), op_time(BW(0, 0), _UNITS)


def _release_times(num_ranks: int, per_direction: int) -> list[int]:
    """When micro-batch k of a direction may enter its first chunk."""
    per_unit, period = num_ranks // 2, 2 * num_ranks
    return [(k // per_unit) * period + 2 * (k % per_unit) for k in range(per_direction)]


def _list_schedule(num_ranks: int, num_microbatches: int) -> list[list[Op]]:
    """Per rank, the ops in the order the list scheduler starts them (see the module doc)."""
    return _ListScheduler(num_ranks, num_microbatches // 2).run()


class _ListScheduler:
    """The list scheduler's state: per stage its chain, position, and the next micro-batch (index
    within the direction) of F and BW, and when each ran out; per rank when it is free."""

    def __init__(self, num_ranks: int, per_direction: int):
        placement = dual_v(num_ranks)
        self.num_ranks, self.per_direction = num_ranks, per_direction
        self.release = _release_times(num_ranks, per_direction)
        self.chains = placement.chains
        self.length = len(self.chains[0])
        self.info = [(c, pos) for c, chain in enumerate(self.chains) for pos, _ in enumerate(chain)]
        self.next_f = [0] * placement.num_stages
        self.next_b = [0] * placement.num_stages
        self.end_f = [[-1] * per_direction for _ in range(placement.num_stages)]
        self.end_b = [[-1] * per_direction for _ in range(placement.num_stages)]
        self.free = [0] * num_ranks
        self.order: list[list[Op]] = [[] for _ in range(num_ranks)]
        self.stages = [placement.stages_of(r) for r in range(num_ranks)]
        self.remaining = 2 * placement.num_stages * per_direction

    def run(self) -> list[list[Op]]:
        t, upcoming = 0, 0  # upcoming: the first release after t
        while self.remaining:
            for rank in range(self.num_ranks):
                if self.free[rank] <= t:
                    best = self._best(rank, t)
                    if best is not None:
                        self._start(rank, *best[1:], t)
            # Readiness changes only when an op ends or a micro-batch is released.
            while upcoming < self.per_direction and self.release[upcoming] <= t:
                upcoming += 1
            later = [f for f in self.free if f > t] + self.release[upcoming:upcoming + 1]
            if not later and self.remaining:
                raise RuntimeError(f"{_NAME}: the list scheduler is stuck at time {t}; this is a bug")
            t = min(later, default=t)
        return self.order

    def _best(self, rank: int, t: int) -> tuple | None:
        """(priority key, kind, stage, k) of the op ``rank`` starts at ``t``, or None."""
        best = None
        for s in self.stages[rank]:
            chain, pos = self.info[s]
            k = self.next_b[s]
            if k < self.next_f[s] and 0 <= self.end_f[s][k] <= t:
                nxt = self.chains[chain][pos + 1] if pos + 1 < self.length else None
                if nxt is None or 0 <= self.end_b[nxt][k] <= t:
                    key = (0, self.release[k], -pos, chain)
                    if best is None or key < best[0]:
                        best = (key, "B", s, k)
            k = self.next_f[s]
            if k < self.per_direction:
                prv = self.chains[chain][pos - 1] if pos > 0 else None
                ready = self.release[k] <= t if prv is None else 0 <= self.end_f[prv][k] <= t
                if ready:
                    key = (1, self.release[k] + pos, chain, 0)
                    if best is None or key < best[0]:
                        best = (key, "F", s, k)
        return best

    def _start(self, rank: int, kind: str, s: int, k: int, t: int) -> None:
        j = self.info[s][0] * self.per_direction + k
        if kind == "F":
            self.end_f[s][k] = self.free[rank] = t + _T_F
            self.next_f[s] += 1
            self.order[rank].append(F(s, j))
        else:
            self.end_b[s][k] = self.free[rank] = t + _T_BW
            self.next_b[s] += 1
            self.order[rank].append(BW(s, j))
        self.remaining -= 1


def bitpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """BitPipe on an even ``num_ranks`` >= 2 for an even ``num_microbatches`` >= 2 (half per
    direction; whole basic units when a multiple of ``num_ranks``)."""
    d = check_even(_NAME, "num_ranks", num_ranks)
    m = check_even(_NAME, "num_microbatches", num_microbatches)
    ops = tuple(tuple(rank_ops) for rank_ops in _list_schedule(d, m))
    return Schedule(_NAME, dual_v(d), m, ops)
