"""The zero-bubble automatic scheduler (ZB-1p, ZB-2p): a greedy heuristic under a memory limit.

Given per-stage T_F, T_B, T_W, T_comm and a per-rank activation limit, the heuristic places ops
stage by stage while keeping an estimate of every op's end time (the dependency rule of
``deps.py``, as in the simulator, plus T_comm between ranks) and of the activations each stage
holds (``costs.py``'s memory changes). It runs
for each of the 8 settings of three switches and keeps the cheapest result:

- H1 ``allow_bubble_before_first_b``: stop the warm-up before an F would delay the first B;
  otherwise allow one F that overshoots.
- H2 ``prioritize_b``: a rank 2+ forwards ahead of the next one may skip its F to take the
  coming B sooner.
- H3 ``no_bubble_greedy``: fill a gap shorter than T_W with a W even if that delays what follows.

Cost = max over stages of (last W end - first F start), as in the paper.
"""

from __future__ import annotations

from itertools import product
from types import MappingProxyType

from twinpipe import checks
from twinpipe.schedule._args import check_int, check_number, per_stage
from twinpipe.schedule.costs import SearchInputs, memory_delta, microbatch_peak
from twinpipe.schedule.deps import dependency_table
from twinpipe.schedule.ops import B, F, Op, OpKind, Schedule, W
from twinpipe.schedule.placement import linear

__all__ = ["zb_auto"]

_NAME = "zb-auto"


_KINDS = MappingProxyType({"F": OpKind.F, "B": OpKind.B, "W": OpKind.W})


class _Infeasible(Exception):
    """A stage must free memory but has no W left to run."""


class _Heuristic:
    """One run of the greedy heuristic for one setting of (H1, H2, H3)."""

    def __init__(self, p: int, m: int, inputs: SearchInputs):
        t_f, t_b, t_w, t_comm, mw, mem_limit = inputs
        self.p, self.m = p, m
        self.cost = {"F": t_f, "B": t_b, "W": t_w}
        self.mem_delta = {kind: memory_delta(kind, 1.0, mw) for kind in "FBW"}  # in units of M_B
        self.comm, self.limit = t_comm, mem_limit
        self.count = {k: [0] * p for k in "FBW"}  # ops placed so far per stage
        self.end = {k: [[0.0] * m for _ in range(p)] for k in "FB"}  # estimated end times (0 until placed)
        # inputs[kind][s]: (end times of what it needs, comm to add) per need, from deps.py's rule
        needs = dependency_table(linear(p)).needs
        self.inputs = {
            kind: [tuple((self.end[str(n.work)][n.stage], 0.0 if n.local else t_comm) for n in needs[_KINDS[kind]][s]) for s in range(p)]
            for kind in "FBW"
        }
        self.w_end = [0.0] * p  # end of each stage's last W (its span ends there)
        self.free = [0.0] * p  # when each stage is next free
        self.mem = [0.0] * p
        self.bubble = [0.0] * p  # idle time so far, counted from the first op
        self.max_bubble = 0.0
        self.order: list[list[tuple[str, int]]] = [[] for _ in range(p)]  # (kind, micro-batch)

    def put(self, s: int, kind: str) -> None:
        """Place the next micro-batch of ``kind`` on stage ``s``."""
        j = self.count[kind][s]
        duration = self.cost[kind][s]
        end = no_wait = self.free[s] + duration
        for ends, comm in self.inputs[kind][s]:  # deps.py's rule
            if ends[j] + comm + duration > end:
                end = ends[j] + comm + duration
        if end > no_wait and self.count["F"][s] > 0:
            self.bubble[s] += end - no_wait
            self.max_bubble = max(self.max_bubble, self.bubble[s])
        self.free[s] = end
        if kind == "W":
            self.w_end[s] = end
        else:
            self.end[kind][s][j] = end
        self.mem[s] += self.mem_delta[kind]
        self.count[kind][s] += 1
        self.order[s].append((kind, j))

    def arrival(self, s: int, kind: str, j: int) -> float:
        """When the inputs of stage ``s``'s ``kind`` on micro-batch ``j`` are there (deps.py's rule;
        what it needs must be placed already)."""
        t = 0.0
        for ends, comm in self.inputs[kind][s]:
            if ends[j] + comm > t:
                t = ends[j] + comm
        return t

    def pending_w(self, s: int) -> bool:
        return self.count["W"][s] < self.count["B"][s]

    def free_memory_for(self, s: int, kind: str) -> None:
        """Run W's until ``kind`` fits under the limit."""
        while self.mem[s] + self.mem_delta[kind] > self.limit[s]:
            if not self.pending_w(s):
                raise _Infeasible
            self.put(s, "W")

    def fill_with_w(self, s: int, arrival: float, greedy: bool) -> None:
        """Run W's while stage ``s`` would otherwise wait for an input arriving at ``arrival``."""
        t_w = self.cost["W"][s]
        while self.pending_w(s) and self.free[s] + t_w <= arrival:
            self.put(s, "W")
        if self.pending_w(s) and self.free[s] < arrival:
            # A gap shorter than one W is left: a W there delays the next op. Take it anyway if
            # waiting would make this stage the worst one so far; otherwise only if greedy (H3).
            if arrival - self.free[s] > self.max_bubble - self.bubble[s] or greedy:
                self.put(s, "W")

    def warmup(self, allow_bubble_before_first_b: bool) -> None:
        """Micro-batch 0: F0 everywhere, extra forwards per stage, then B0 from the last stage back."""
        p, comm, t_f, t_b = self.p, self.comm, self.cost["F"], self.cost["B"]
        for s in range(p):
            self.put(s, "F")
        extra = [0] * p
        last_t = self.end["F"][p - 1][0] + t_b[p - 1]  # when B0 leaves the last stage
        for s in range(p - 2, -1, -1):
            # Add forwards while memory allows and B0 has not come back yet.
            mem, t, grow = self.mem[s], self.free[s], self.mem_delta["F"]
            while self.count["F"][s] + extra[s] < self.m and mem + grow <= self.limit[s]:
                if allow_bubble_before_first_b and t + t_f[s] > last_t + comm:
                    break
                if not allow_bubble_before_first_b and t >= last_t + comm:
                    break
                mem += grow
                t += t_f[s]
                extra[s] += 1
            last_t = max(t, last_t + comm) + t_b[s]
        for s in range(1, p):
            # Each stage keeps strictly fewer extra forwards than the one before it (unless that
            # would leave it short of micro-batches at the end).
            while extra[s] > 0 and extra[s] >= extra[s - 1] and self.count["F"][s] + extra[s] < self.m:
                extra[s] -= 1
        for s in range(p):
            for _ in range(extra[s]):
                self.put(s, "F")
        for s in range(p - 1, -1, -1):
            self.put(s, "B")

    def takes_forward(self, s: int, prioritize_b: bool) -> bool:
        """Whether stage ``s`` runs a forward in this round (before the propagation rule)."""
        count_f = self.count["F"]
        if count_f[s] >= self.m:
            return False
        if not (prioritize_b and s + 1 < self.p and count_f[s] >= count_f[s + 1] + 2):
            return True
        t_f, t_b, t_w = self.cost["F"], self.cost["B"], self.cost["W"]
        b_arrival = self.free[s + 1] + t_f[s + 1] + t_b[s + 1] + self.comm  # estimate
        if self.free[s] >= b_arrival:
            return False
        # The F fits before the B arrives, counting the W's that must run to make room for it.
        mem, w_time, w_count = self.mem[s] + self.mem_delta["F"], 0.0, 0
        while mem > self.limit[s] and self.count["W"][s] + w_count < self.count["B"][s]:
            w_time += t_w[s]
            mem += self.mem_delta["W"]
            w_count += 1
        if self.free[s] + t_f[s] + w_time <= b_arrival:
            return True
        # Otherwise wait for the B unless waiting makes this stage the worst one.
        return b_arrival - self.free[s] > self.max_bubble - self.bubble[s]

    def steady(self, i: int, prioritize_b: bool, no_bubble_greedy: bool) -> None:
        """Micro-batch i >= 1: maybe one F per stage (first stage to last), then B_i (last to first)."""
        p = self.p
        take = [self.takes_forward(s, prioritize_b) for s in range(p)]
        for s in range(p - 2, -1, -1):
            take[s] = take[s] and take[s + 1]  # a stage takes an F only if the next one does
        for s in range(p):
            if not take[s]:
                continue
            self.free_memory_for(s, "F")
            if s > 0:
                self.fill_with_w(s, self.arrival(s, "F", self.count["F"][s]), no_bubble_greedy)
            self.put(s, "F")
        for s in range(p - 1, -1, -1):
            self.free_memory_for(s, "B")
            if s + 1 < p:
                self.fill_with_w(s, self.arrival(s, "B", i), no_bubble_greedy)
            if s == 0 and self.count["F"][0] == self.m:
                while self.pending_w(0):  # the first stage has no forward left: flush its W's
                    self.put(0, "W")
            self.put(s, "B")

    def run(self, h1: bool, h2: bool, h3: bool) -> float:
        self.warmup(h1)
        for i in range(1, self.m):
            self.steady(i, h2, h3)
        for s in range(self.p):
            while self.pending_w(s):
                self.put(s, "W")
        return max(self.w_end[s] - (self.end["F"][s][0] - self.cost["F"][s]) for s in range(self.p))


def _auto_order(p: int, m: int, t_f, t_b, t_w, t_comm: float, mw: float, mem_limit) -> tuple[list[list[Op]], float, tuple[bool, bool, bool]]:
    """Grid search over (H1, H2, H3): the per-stage op order with the smallest cost, that cost and
    the winning switches (the first one wins a tie). Costs and limits are per-stage lists."""
    best = None
    for switches in product((True, False), repeat=3):
        heuristic = _Heuristic(p, m, SearchInputs(t_f, t_b, t_w, t_comm, mw, mem_limit))
        try:
            cost = heuristic.run(*switches)
        except _Infeasible:
            continue
        if best is None or cost < best[1]:
            best = (heuristic.order, cost, switches)
    if best is None:
        raise ValueError(f"{_NAME}: mem_limit={mem_limit!r} is too small for these costs; no schedule fits (try a larger limit)")
    make = {"F": F, "B": B, "W": W}
    order = [[make[kind](s, j) for kind, j in ops] for s, ops in enumerate(best[0])]
    return order, best[1], best[2]


def zb_auto(
    num_ranks: int,
    num_microbatches: int,
    mem_limit=None,
    t_f=1.0,
    t_b=1.0,
    t_w=1.0,
    t_comm: float = 0.0,
    mw: float = 0.5,
) -> Schedule:
    """ZB-1p/ZB-2p on any ``num_ranks`` >= 1 and ``num_microbatches`` >= 1.

    ``mem_limit`` is the activation memory each rank may hold, in units of M_B (one micro-batch's
    activations on one stage): default p (ZB-1p, the memory of 1F1B); 2p gives ZB-2p. It must be
    at least max(1, mw). ``t_f``, ``t_b``, ``t_w`` are numbers or one per stage; ``mw`` is M_W/M_B.
    """
    p = check_int(_NAME, "num_ranks", num_ranks)
    m = check_int(_NAME, "num_microbatches", num_microbatches)
    times = {name: per_stage(_NAME, name, value, p, strict=True) for name, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w))}
    comm = check_number(_NAME, "t_comm", t_comm)
    ratio = check_number(_NAME, "mw", mw)
    limit = per_stage(_NAME, "mem_limit", p if mem_limit is None else mem_limit, p)
    need = microbatch_peak(ratio)  # one forward's activations; with mw > 1 a B grows them to mw
    if min(limit) < need:
        raise checks.bad(f"{_NAME}: mem_limit", mem_limit, f"must be >= max(1, mw) = {need:g} on every rank (in units of M_B)")
    order, cost, switches = _auto_order(p, m, times["t_f"], times["t_b"], times["t_w"], comm, ratio, limit)
    options = {"mem_limit": mem_limit if mem_limit is not None else p, "cost": cost, "heuristics": dict(zip(("allow_bubble_before_first_b", "prioritize_b", "no_bubble_greedy"), switches))}
    return Schedule(_NAME, linear(p), m, tuple(tuple(ops) for ops in order), options)
