"""Timelines: when each op ran on each rank, simulated or measured, and the numbers read off them.

Times are in arbitrary units for simulations and in seconds for measured runs. Bubble rate follows
the zero-bubble paper: ``(cost - busy) / cost`` where ``cost`` is the largest per-rank span (first
op start to last op end) and ``busy`` the largest per-rank compute time (all ranks are equally busy
under uniform costs).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

from twinpipe.schedule.ops import Op
from twinpipe.schedule.placement import Placement

__all__ = ["Slice", "Timeline", "RankStats"]


@dataclass(frozen=True)
class Slice:
    """One interval on one rank: a compute op (``op`` set) or a wait for messages (``op`` None)."""

    rank: int
    start: float
    end: float
    op: Op | None
    label: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class RankStats:
    rank: int
    start: float
    end: float
    busy: float
    idle: float
    peak_activation: float | None

    @property
    def span(self) -> float:
        """First op start to last op end on this rank."""
        return self.end - self.start


@dataclass
class Timeline:
    """Slices of a schedule's run on ``num_ranks`` ranks."""

    name: str
    num_ranks: int
    num_microbatches: int
    slices: list[Slice]
    _: KW_ONLY
    placement: Placement | None = None
    source: str = "simulated"  # or "measured"
    peak_activation: tuple[float, ...] | None = None  # per rank, in units of M_B
    meta: dict = field(default_factory=dict)

    def compute_slices(self, rank: int) -> list[Slice]:
        return sorted((s for s in self.slices if s.rank == rank and s.op is not None), key=lambda s: s.start)

    def wait_slices(self, rank: int) -> list[Slice]:
        return sorted((s for s in self.slices if s.rank == rank and s.op is None), key=lambda s: s.start)

    def rank_stats(self, rank: int) -> RankStats:
        return self._stats(rank, self.compute_slices(rank))

    def _stats(self, rank: int, compute: list[Slice]) -> RankStats:
        if not compute:
            return RankStats(rank, 0.0, 0.0, 0.0, 0.0, 0.0 if self.peak_activation else None)
        start, end = compute[0].start, max(s.end for s in compute)
        busy = sum(s.duration for s in compute)
        peak = self.peak_activation[rank] if self.peak_activation is not None else None
        return RankStats(rank, start, end, busy, (end - start) - busy, peak)

    def per_rank(self) -> list[RankStats]:
        by_rank: list[list[Slice]] = [[] for _ in range(self.num_ranks)]
        for s in self.slices:  # one pass, not one per rank: timelines can hold 10^5 slices
            if s.op is not None:
                by_rank[s.rank].append(s)
        return [self._stats(r, sorted(c, key=lambda s: s.start)) for r, c in enumerate(by_rank)]

    @property
    def makespan(self) -> float:
        compute = [s for s in self.slices if s.op is not None]
        if not compute:
            return 0.0
        return max(s.end for s in compute) - min(s.start for s in compute)

    @property
    def cost(self) -> float:
        """The largest per-rank span."""
        return max((st.end - st.start for st in self.per_rank()), default=0.0)

    @property
    def bubble_rate(self) -> float:
        stats = self.per_rank()
        cost = max((st.end - st.start for st in stats), default=0.0)
        if cost <= 0:
            return 0.0
        busy = max(st.busy for st in stats)
        return (cost - busy) / cost

    def op_order(self, rank: int) -> list[str]:
        """The ops of one rank in the order they ran, as strings."""
        return [str(s.op) for s in self.compute_slices(rank)]
