"""Event simulation: time any schedule under a cost model and return a Timeline.

Each rank runs its ops in order; an op starts at ``max(rank free, every dependency done + comm)``,
where comm is paid only if the dependency ran on another rank. Ranks are advanced one at a time
until they block on a dependency that has not run yet; finishing an op wakes the ranks blocked
on it. Every op is started once, so the run is O(total ops).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from twinpipe.schedule.check import ScheduleError, check_work
from twinpipe.schedule.costs import op_costs
from twinpipe.schedule.deps import WORK_DONE, Work, dependency_table, work_done
from twinpipe.schedule.ops import OpKind, Schedule
from twinpipe.sim.costs import CostModel
from twinpipe.timeline import Slice, Timeline

__all__ = ["simulate", "summarize", "Summary"]

_F, _B, _W, _BW, _FB = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.FB


@dataclass(frozen=True)
class Summary:
    """What a simulation's numbers come to, without its slices (``summarize``): per rank, the
    compute time, first op start, last op end and peak activations (units of M_B)."""

    busy: tuple[float, ...]
    first: tuple[float, ...]
    last: tuple[float, ...]
    peak: tuple[float, ...]

    @property
    def makespan(self) -> float:
        """First op start on any rank to last op end on any rank."""
        return max(self.last) - min(self.first) if self.first else 0.0


def simulate(schedule: Schedule, costs: CostModel | None = None) -> Timeline:
    """Time ``schedule`` under ``costs`` (default: T_F = T_B = T_W = 1, no comm, M_W = 0.5 M_B).

    The schedule is checked first (``check.check_work``): an op on a wrong rank, out of range,
    repeated or missing raises ScheduleError naming the rule, rank and op. So does a rank that
    would wait forever (rule "deadlock", naming the stuck ranks and ops).
    """
    costs = _checked(schedule, costs)
    slices: list[Slice] = []
    summary = _run(schedule, costs, slices)
    meta = {"costs": costs, "options": dict(schedule.options)}
    return Timeline(schedule.name, schedule.placement.num_ranks, schedule.num_microbatches, slices, placement=schedule.placement,
                    source="simulated", peak_activation=summary.peak, meta=meta)


def summarize(schedule: Schedule, costs: CostModel | None = None, check: bool = True) -> Summary:
    """``simulate``'s numbers without recording its slices: same checks, same times, about half the work.

    ``check=False`` skips ``check_work`` (a tenth of the time) for schedules known to be whole, such
    as the built-in generators' (their tests validate them); a deadlock is still an error.
    """
    return _run(schedule, _checked(schedule, costs, check), None)


def _checked(schedule: Schedule, costs: CostModel | None, check: bool = True) -> CostModel:
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    costs = CostModel() if costs is None else costs
    if not isinstance(costs, CostModel):
        raise TypeError(f"costs must be a CostModel, got {type(costs).__name__}")
    if check:
        check_work(schedule)
    return costs


def _run(schedule: Schedule, costs: CostModel, slices: list | None) -> Summary:
    """Time ``schedule``; appends a Slice per op (and per wait) to ``slices`` unless it is None."""
    if costs.cores is not None and costs.cores < schedule.placement.num_ranks:
        return _run_shared(schedule, costs, slices)
    return _event_loop(schedule, _Tables(schedule, costs), slices)


class _Tables:
    """What the event loop looks up per op, worked out once per simulation. Work item (work, s, j)
    ends at ``ends[work*n + s*m + j]``; ``needs[kind][s]``: (index base, delay) per item an op of
    ``kind`` at stage s waits for (an FB: its forward's), the delay T_comm across ranks and 0 on one
    rank; ``done[kind]``: the bases of the items a simple op completes; ``steps[kind][s]``: its
    memory changes (one)."""

    def __init__(self, schedule: Schedule, costs: CostModel):
        placement = schedule.placement
        self.m = schedule.num_microbatches
        self.n = n = placement.num_stages * self.m
        self.costs = table = op_costs(costs, placement.num_stages)  # op times and memory changes: schedule/costs.py's rules
        rule = dependency_table(placement).needs
        self.needs = {kind: [tuple((int(d.work) * n + d.stage * self.m, 0.0 if d.local else table.t_comm) for d in stage)
                             for stage in rule[kind]] for kind in rule}
        self.needs[_FB] = self.needs[_F]
        self.done = {kind: tuple(int(work) * n for work in works) for kind, works in WORK_DONE.items()}
        self.steps = {kind: [(change,) for change in changes] for kind, changes in table.memory.items()}


def _event_loop(schedule: Schedule, tables: _Tables, slices: list | None) -> Summary:
    """Advance each rank through its ops until one needs an item not done yet; finishing an item
    wakes the ranks blocked on it. Every op starts once: O(total ops)."""
    n, m, needs, done, steps, duration = tables.n, tables.m, tables.needs, tables.done, tables.steps, tables.costs.duration
    pair, pair_steps, f_base = tables.costs.pair, tables.costs.pair_steps, int(Work.F) * n
    num_ranks = schedule.placement.num_ranks
    ends = [-1.0] * (len(Work) * n)  # -1: not done yet
    waiters: dict[int, list[int]] = {}  # item index -> the ranks blocked on it
    runnable = list(range(num_ranks - 1, -1, -1))
    ready_at, finish = _ready_and_finish(ends, waiters, runnable)
    cursor, free, memory, peak, busy, first = [0] * num_ranks, *([0.0] * num_ranks for _ in range(5))
    while runnable:
        rank = runnable.pop()
        ops, i, now, mem, top, work = schedule.ops[rank], cursor[rank], free[rank], memory[rank], peak[rank], busy[rank]
        while i < len(ops):
            op = ops[i]
            kind, s, j, back = op.kind, op.stage, op.microbatch, op.backward
            start, blocked = ready_at(needs[kind][s], j, now)
            if back is not None and blocked < 0:
                start, blocked = ready_at(needs[back.kind][back.stage], back.microbatch, start)
            if blocked >= 0:
                waiters.setdefault(blocked, []).append(rank)
                break
            if back is None:
                end = start + duration[kind][s]
                changes = steps[kind][s]
            else:  # the forward's activations are live before the backward frees the other's
                end = start + pair(s, back.stage, back.kind)
                changes = pair_steps(s, back.stage, back.kind)
            for change in changes:
                mem += change
                if mem > top:  # after B too: it adds memory when M_W > M_B
                    top = mem
            if back is None:
                for base in done[kind]:
                    finish(base + s * m + j, end)
            else:
                finish(f_base + s * m + j, end)
                for base in done[back.kind]:  # a BW half finishes W too; a B half leaves it to a W op
                    finish(base + back.stage * m + back.microbatch, end)
            if i == 0:
                first[rank] = start
            if slices is not None:
                if start > now and i > 0:
                    slices.append(Slice(rank, now, start, None, "wait"))
                slices.append(Slice(rank, start, end, op))
            work += end - start
            now = end
            i += 1
        cursor[rank], free[rank], memory[rank], peak[rank], busy[rank] = i, now, mem, top, work
    stuck = [r for r in range(num_ranks) if cursor[r] < len(schedule.ops[r])]
    if stuck:
        raise _deadlock(schedule, stuck, cursor, waiters, n, m)
    ran = [r for r in range(num_ranks) if schedule.ops[r]]  # a rank with no ops has no span
    return Summary(tuple(busy), tuple(first[r] for r in ran), tuple(free[r] for r in ran), tuple(peak))


def _ready_and_finish(ends: list[float], waiters: dict[int, list[int]], runnable: list[int]):
    """The event loop's two steps on ``ends``: when an op's needs are met, and an item's end."""

    def ready_at(item_needs: tuple, j: int, start: float) -> tuple[float, int]:
        """Earliest start given the needs of one simple op, or (start, index of a missing item)."""
        for base, delay in item_needs:
            t = ends[base + j]
            if t < 0:
                return start, base + j
            t += delay
            if t > start:
                start = t
        return start, -1

    def finish(index: int, end: float) -> None:
        ends[index] = end
        if index in waiters:
            runnable.extend(waiters.pop(index))

    return ready_at, finish


def _run_shared(schedule: Schedule, costs: CostModel, slices: list | None) -> Summary:
    """Ranks sharing ``costs.cores`` processors: while k ranks compute, each op advances at
    ``min(1, cores / k)`` of its speed. Time moves from event to event (an op ends, or one's
    inputs arrive); at each, every rank whose next op can start starts it.
    """
    alone = _run(schedule, replace(costs, cores=None), None)  # raises on a deadlock; peaks do not depend on timing
    placement, cores, comm = schedule.placement, costs.cores, float(costs.t_comm)
    alone_time = op_costs(costs, placement.num_stages).time
    needs = dependency_table(placement).needs
    ends: dict[tuple, float] = {}
    num_ranks = placement.num_ranks
    cursor, free, busy, first = [0] * num_ranks, [0.0] * num_ranks, [0.0] * num_ranks, [0.0] * num_ranks
    running: dict[int, list[float]] = {}  # rank -> [work left (seconds alone), start]
    pending = [r for r in range(num_ranks) if schedule.ops[r]]

    def ready_at(rank: int) -> float | None:
        """When the rank's next op can start, or None while a work item it needs is not done."""
        op, start = schedule.ops[rank][cursor[rank]], free[rank]
        for part in op.parts():
            for need in needs[part.kind][part.stage]:
                end = ends.get((need.work, need.stage, part.microbatch))
                if end is None:
                    return None
                start = max(start, end if need.local else end + comm)
        return start

    now = 0.0
    while pending:
        arrival = float("inf")
        for rank in pending:
            start = None if rank in running else ready_at(rank)
            if start is not None and start <= now:
                op = schedule.ops[rank][cursor[rank]]
                running[rank] = [alone_time(op), now]
            elif start is not None:
                arrival = min(arrival, start)
        rate = min(1.0, cores / len(running)) if running else 0.0
        finish = min((now + left / rate for left, _ in running.values()), default=float("inf"))
        later = min(finish, arrival)
        for rank in sorted(running):
            left, start = running[rank]
            if now + left / rate > later:
                running[rank][0] = left - (later - now) * rate
                continue
            op, i = schedule.ops[rank][cursor[rank]], cursor[rank]
            if i == 0:
                first[rank] = start
            if slices is not None:
                if start > free[rank] and i > 0:
                    slices.append(Slice(rank, free[rank], start, None, "wait"))
                slices.append(Slice(rank, start, later, op))
            for item in work_done(op):
                ends[item] = later
            busy[rank] += later - start
            free[rank], cursor[rank] = later, i + 1
            del running[rank]
        pending = [r for r in pending if cursor[r] < len(schedule.ops[r])]
        now = later
    ran = [r for r in range(num_ranks) if schedule.ops[r]]
    return Summary(tuple(busy), tuple(first[r] for r in ran), tuple(free[r] for r in ran), alone.peak)


def _deadlock(schedule: Schedule, stuck: list[int], cursor: list[int], waiters: dict, n: int, m: int) -> ScheduleError:
    """Name every stuck rank, the op it is stuck at and what that op waits for (and who runs it)."""
    owner: dict[tuple[Work, int, int], tuple[int, int]] = {}
    for rank, ops in enumerate(schedule.ops):
        for index, op in enumerate(ops):
            for item in work_done(op):
                owner.setdefault(item, (rank, index))
    waiting_for = {r: index for index, ranks in waiters.items() for r in ranks}
    details = []
    for r in stuck:
        work, rest = divmod(waiting_for[r], n)
        s, j = divmod(rest, m)
        work = Work(work)
        who = owner.get((work, s, j))
        src = f"rank {who[0]} op {who[1]}" if who else "no rank runs it"
        needed = {Work.F: f"{s}F{j}", Work.B: f"{s}B{j} or {s}BW{j}", Work.W: f"{s}W{j} or {s}BW{j}"}[work]
        details.append(f"rank {r} op {cursor[r]} ({schedule.ops[r][cursor[r]]}) waits for {needed} ({src})")
    return ScheduleError("deadlock", "simulation stuck, ranks wait forever: " + "; ".join(details), stuck[0], cursor[stuck[0]])
