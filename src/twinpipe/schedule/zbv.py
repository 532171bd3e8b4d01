"""ZB-V (Qi et al., 2024, section 6): zero bubble on a V placement at the memory of 1F1B.

Rank r holds stages r and 2p-1-r, so a micro-batch's forward goes down the ranks and back up, and
both its first forward and its last backward run on rank 0. With B/W split and T_F = T_B = T_W
the V reaches zero bubble holding 2p activations of its half-size stages (p M_B of a linear
stage, the same as 1F1B).

We build it by list scheduling with time estimates. Whenever a rank is free it runs, by preference:
1. a ready B or a ready F that fits in memory (which kind, and which of its two stages, is set by
   the switches below);
2. its oldest pending W, if that ends before the next F or B can start (or memory needs it);
otherwise it waits. A forward of a rank's first stage leaves room for one activation of its second
stage: without that reserve first-stage forwards could fill the memory, the micro-batches coming
back up could not run, and nothing would ever be freed.

Like the zero-bubble scheduler we try each setting of two switches and keep the cheapest plan:
- ``alternate``: alternate B and F (the 1F1B rhythm) instead of always taking a ready B first;
- ``balance``: alternate the two stages instead of always taking the later one in the chain.
With uniform costs one of them reaches zero bubble for every p <= 12 and 2p <= m <= 6p.
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import product
from types import MappingProxyType

from twinpipe import checks
from twinpipe.schedule._args import check_int, check_number, per_stage
from twinpipe.schedule.costs import SearchInputs, memory_delta, microbatch_peak
from twinpipe.schedule.deps import dependency_table
from twinpipe.schedule.ops import B, F, OpKind, Schedule, W
from twinpipe.schedule.placement import vshape

__all__ = ["zbv"]

_NAME = "zbv"
_INF = float("inf")
_KINDS = MappingProxyType({"F": OpKind.F, "B": OpKind.B})


class _VListScheduler:
    """Greedy list scheduling of F, B, W on the V placement of ``p`` ranks (times per stage)."""

    def __init__(self, p: int, m: int, inputs: SearchInputs, alternate: bool = False, balance: bool = False):
        t_f, t_b, t_w, t_comm, mw, mem_limit = inputs
        self.p, self.m = p, m
        self.cost = {"F": t_f, "B": t_b, "W": t_w}
        self.comm, self.limit = t_comm, mem_limit
        self.mem_delta = {kind: memory_delta(kind, 1.0, mw) for kind in "FBW"}  # in units of M_B
        self.alternate, self.balance = alternate, balance
        placement = vshape(p)
        self.rank_of = placement.stage_ranks
        needs = dependency_table(placement).needs  # as (kind, stage, comm) per need of (kind, stage)
        self.inputs = {k: [tuple((str(n.work), n.stage, 0.0 if n.local else t_comm) for n in ns) for ns in needs[_KINDS[k]]] for k in "FB"}
        self.end = {"F": [[_INF] * m for _ in range(2 * p)], "B": [[_INF] * m for _ in range(2 * p)]}
        self.count = {"F": [0] * (2 * p), "B": [0] * (2 * p)}  # next micro-batch per stage
        self.mem = [0.0] * p
        self.free = [0.0] * p  # when each rank is next free
        self.first_start = [_INF] * p
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
        self.last_kind = ["F"] * p
        self.last_stage: list[dict[str, int]] = [{} for _ in range(p)]
        self.order: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]  # (kind, stage, micro-batch)
        self.now = 0.0  # time of the decision being made

    def _ready(self, kind: str, stage: int, j: int) -> tuple[float, bool]:
        """When the inputs of ``stage``'s ``kind`` on micro-batch ``j`` are on its rank (deps.py's
        rule), and whether that is known. For a need not placed yet: a lower bound, its rank's
        clock plus its cost."""
        t, known = 0.0, True
        for dep_kind, dep_stage, comm in self.inputs[kind][stage]:
            end = self.end[dep_kind][dep_stage][j]
            if end == _INF:
                end, known = max(self.now, self.free[self.rank_of[dep_stage]]) + self.cost[dep_kind][dep_stage], False
            t = max(t, end + comm)
        return t, known

    def _candidates(self, rank: int) -> list[tuple[str, int, float, bool, bool]]:
        """(kind, stage, ready time, known, fits in memory) of the rank's next B's and F's."""
        stages = (2 * self.p - 1 - rank, rank)  # the later stage in the chain first
        out = []
        for s in stages:
            j = self.count["B"][s]
            if j < self.count["F"][s]:  # its forward ran on this rank already
                t, known = self._ready("B", s, j)
                out.append(("B", s, t, known, self.mem[rank] + self.mem_delta["B"] <= self.limit))
        for s in stages:
            j = self.count["F"][s]
            if j < self.m:
                grow = self.mem_delta["F"]
                reserve = grow if s < self.p else 0.0  # room for the second stage's F (see module doc)
                t, known = self._ready("F", s, j)
                out.append(("F", s, t, known, self.mem[rank] + grow + reserve <= self.limit))
        return out

    def _choose(self, rank: int):
        """(kind, stage, ready) to run now; else a float: when to look again; else None: wait for news."""
        cands = self._candidates(rank)
        kinds = ("F", "B") if self.alternate and self.last_kind[rank] == "B" else ("B", "F")
        for kind in kinds:
            ready = [(s, t) for k, s, t, known, fits in cands if k == kind and known and fits and t <= self.now]
            if ready:
                if self.balance and len(ready) == 2 and self.last_stage[rank].get(kind) == ready[0][0]:
                    return kind, *ready[1]
                return kind, *ready[0]
        upcoming = min((t for _, _, t, _, fits in cands if fits), default=_INF)
        blocked = any(known and t <= self.now and not fits for _, _, t, known, fits in cands)
        pending = self.pending_w[rank]
        if pending and (blocked or self.now + self.cost["W"][pending[0][0]] <= upcoming):
            return "W", -1, 0.0
        known_times = [t for _, _, t, known, fits in cands if known and fits]
        return min(known_times) if known_times else None

    def _place(self, rank: int, kind: str, stage: int, ready: float) -> None:
        """Run the op as early as the rank and its inputs allow (the simulator's rule)."""
        start = max(self.free[rank], ready)
        self.first_start[rank] = min(self.first_start[rank], start)
        if kind == "W":
            stage, j = self.pending_w[rank].popleft()
            self.mem[rank] += self.mem_delta["W"]
            self.order[rank].append(("W", stage, j))
            self.free[rank] = start + self.cost["W"][stage]
            return
        j = self.count[kind][stage]
        self.free[rank] = self.end[kind][stage][j] = start + self.cost[kind][stage]
        self.count[kind][stage] += 1
        self.last_kind[rank] = kind
        self.last_stage[rank][kind] = stage
        self.order[rank].append((kind, stage, j))
        self.mem[rank] += self.mem_delta[kind]
        if kind == "B":
            self.pending_w[rank].append((stage, j))

    def run(self) -> float:
        """Place every op; return the cost (largest per-rank span)."""
        p = self.p
        remaining = [6 * self.m] * p
        events = [(0.0, r) for r in range(p)]
        idle: list[int] = []  # ranks waiting for an op elsewhere to be placed
        while events or idle:
            if events:
                time, rank = heapq.heappop(events)
                self.now = max(time, self.free[rank])
                choice = self._choose(rank)
            else:  # every rank waits on another: the earliest one with a W runs it
                waiting_w = [r for r in idle if self.pending_w[r]]
                if not waiting_w:
                    raise ValueError(f"{_NAME}: mem_limit={self.limit:g} leaves ranks {sorted(idle)} unable to proceed; raise it")
                rank = min(waiting_w, key=lambda r: self.free[r])
                idle.remove(rank)
                self.now = self.free[rank]
                choice = ("W", -1, 0.0)
            if choice is None:
                idle.append(rank)
            elif isinstance(choice, float):
                heapq.heappush(events, (choice, rank))
            else:
                self._place(rank, *choice)
                remaining[rank] -= 1
                if remaining[rank]:
                    heapq.heappush(events, (self.free[rank], rank))
                for other in idle:  # what just ran may have made their next op's time known
                    heapq.heappush(events, (self.now, other))
                idle.clear()
        return max(self.free[r] - self.first_start[r] for r in range(p))


def zbv(
    num_ranks: int,
    num_microbatches: int,
    mem_limit=None,
    t_f=1.0,
    t_b=1.0,
    t_w=1.0,
    t_comm: float = 0.0,
    mw: float = 0.5,
) -> Schedule:
    """ZB-V on any ``num_ranks`` >= 1 and ``num_microbatches`` >= 1 (2p stages; rank i holds i and 2p-1-i).

    ``mem_limit``: activations a rank may hold, in units of one (half-size) stage's M_B; default
    2p (the memory of 1F1B); at least 1 + max(1, mw). Times are numbers or one per stage (2p).
    Zero bubble under uniform costs needs m >= 2p.
    """
    p = check_int(_NAME, "num_ranks", num_ranks)
    m = check_int(_NAME, "num_microbatches", num_microbatches)
    times = [per_stage(_NAME, name, value, 2 * p, strict=True) for name, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w))]
    comm = check_number(_NAME, "t_comm", t_comm)
    ratio = check_number(_NAME, "mw", mw)
    limit = check_number(_NAME, "mem_limit", 2 * p if mem_limit is None else mem_limit)
    need = memory_delta("F", 1.0, ratio) + microbatch_peak(ratio)  # one micro-batch through both stages, and its B
    if limit < need:
        raise checks.bad(f"{_NAME}: mem_limit", mem_limit, f"must be >= 1 + max(1, mw) = {need:g} (in units of M_B: one micro-batch through both stages of a rank)")
    best = None
    for alternate, balance in product((False, True), repeat=2):
        plan = _VListScheduler(p, m, SearchInputs(*times, comm, ratio, limit), alternate, balance)
        cost = plan.run()
        if best is None or cost < best[0]:
            best = (cost, plan.order, {"alternate": alternate, "balance": balance})
    cost, order, switches = best
    make = {"F": F, "B": B, "W": W}
    ops = tuple(tuple(make[kind](s, j) for kind, s, j in rank_ops) for rank_ops in order)
    return Schedule(_NAME, vshape(p), m, ops, {"mem_limit": limit, "cost": cost, "switches": switches})
