"""Validation: reject a schedule that misses or repeats an op, runs an op before what it needs,
or can deadlock. Every error names the rank, the op index and the broken rule.
"""

from __future__ import annotations

from collections import defaultdict

from twinpipe.schedule.deps import WORK_DONE, Work, coupled, dependency_table, needs, required_work, work_done
from twinpipe.schedule.ops import Op, OpKind, Schedule

__all__ = ["ScheduleError", "validate", "check_work", "dependencies", "execution_order"]


class ScheduleError(ValueError):
    """A schedule breaks a rule; ``rank``, ``index`` and ``rule`` say where and which (a deadlock
    also lists every stuck rank's (rank, op index) in ``stuck``)."""

    def __init__(self, rule: str, message: str, rank: int | None = None, index: int | None = None):
        where = "" if rank is None else f"rank {rank}" + ("" if index is None else f", op {index}") + ": "
        super().__init__(f"{where}[{rule}] {message}")
        self.rule, self.rank, self.index = rule, rank, index
        self.stuck: list[tuple[int, int]] = []


Key = tuple[Work, int, int]  # (work, stage, micro-batch), see deps.py


def dependencies(schedule: Schedule, op: Op) -> list[Key]:
    """What must have run before ``op`` can start (on any rank)."""
    return needs(schedule.placement, op)


def check_work(schedule: Schedule) -> None:
    """Every op names a stage its rank holds and a micro-batch of that stage's chain, and the ops
    together do every work item of the schedule exactly once (see ``deps.required_work``)."""
    placement, m = schedule.placement, schedule.num_microbatches
    if len(schedule.ops) != placement.num_ranks:
        raise ScheduleError("ranks", f"schedule has op lists for {len(schedule.ops)} ranks, placement has {placement.num_ranks}")
    forward_only = bool(schedule.options.get("forward_only"))
    chain_of = [placement.chain_of_stage(s) for s in range(placement.num_stages)]
    chain_mbs = [placement.microbatches_of_chain(c, m) for c in chain_of]
    # stage -> (its rank, first and past-last micro-batch of its chain, s*m)
    stage_info = {s: (r, mbs.start, mbs.stop, s * m) for s, (r, mbs) in enumerate(zip(placement.stage_ranks, chain_mbs))}
    done = {work: bytearray(placement.num_stages * m) for work in Work}  # done[work][s*m + j]
    marks = {kind: tuple(done[w] for w in works) for kind, works in WORK_DONE.items()}
    if forward_only:
        marks = {OpKind.F: marks[OpKind.F]}
    count = 0
    for rank, ops in enumerate(schedule.ops):
        for index, op in enumerate(ops):
            if not isinstance(op, Op):
                raise ScheduleError("op", f"{op!r} is not an Op (build ops with F, B, W, BW, FB or parse_op)", rank, index)
            back = op.backward
            for kind, s, j in ((op.kind, op.stage, op.microbatch),) if back is None else ((OpKind.F, op.stage, op.microbatch), (back.kind, back.stage, back.microbatch)):
                info, targets = stage_info.get(s), marks.get(kind)
                if info is None or info[0] != rank or not info[1] <= j < info[2] or targets is None:
                    _refuse_part(schedule, op, kind, s, j, rank, index, forward_only)
                k = info[3] + j
                for flags in targets:
                    if flags[k]:
                        work = next(w for w in Work if done[w] is flags)
                        r0, i0 = _first_doing(schedule, (work, s, j))
                        raise ScheduleError("repeated op", f"{op} repeats work already done at rank {r0}, op {i0}", rank, index)
                    flags[k] = 1
                    count += 1
    # Every item done is a valid, distinct work item: the schedule is complete iff the counts match.
    per_item = 1 if forward_only else len(Work)
    if count == per_item * sum(len(chain) * len(chain_mbs[chain[0]]) for chain in placement.chains):
        return
    for work, s, j in required_work(placement, m, forward_only):
        if not done[work][s * m + j]:
            what = {Work.F: f"{s}F{j}", Work.B: f"{s}B{j} or {s}BW{j}", Work.W: f"{s}W{j} or {s}BW{j}"}[work]
            raise ScheduleError("missing op", f"no op runs {what}", placement.rank_of(s))


def _refuse_part(schedule: Schedule, op: Op, kind: OpKind, s: int, j: int, rank: int, index: int, forward_only: bool):
    """Raise the ScheduleError for a part of ``op`` that is out of place (the slow path of check_work)."""
    placement, m = schedule.placement, schedule.num_microbatches
    if not isinstance(s, int) or not 0 <= s < placement.num_stages:
        raise ScheduleError("stage", f"{op} names stage {s}; stages are 0..{placement.num_stages - 1}", rank, index)
    if placement.rank_of(s) != rank:
        raise ScheduleError("wrong rank", f"{op} runs stage {s}, which rank {placement.rank_of(s)} holds", rank, index)
    if not 0 <= j < m:
        raise ScheduleError("micro-batch", f"{op} names micro-batch {j}; there are {m}", rank, index)
    if forward_only and kind is not OpKind.F:
        raise ScheduleError("forward only", f"{op} is backward work in a forward-only schedule", rank, index)
    chain = placement.chain_of_stage(s)
    raise ScheduleError("micro-batch", f"{op}: micro-batch {j} does not travel through chain {chain}", rank, index)


def _first_doing(schedule: Schedule, item: Key) -> tuple[int, int]:
    """(rank, op index) of the first op that does work ``item`` (for error messages)."""
    return next((rank, index) for rank, ops in enumerate(schedule.ops) for index, op in enumerate(ops) if item in work_done(op))


def execution_order(schedule: Schedule) -> list[tuple[int, int]]:
    """A sequential execution of the whole schedule as (rank, op index), dependencies respected.

    Raises ScheduleError if an op depends on something its own rank runs later (a local order
    error) or if the ranks can block each other forever (deadlock).
    """
    ops = schedule.ops
    num_ranks = len(ops)
    dependencies_of = dependency_table(schedule.placement).op_needs
    position = {}
    for rank, rank_ops in enumerate(ops):
        for index, op in enumerate(rank_ops):
            if op.backward is not None:
                _check_pairing(schedule, op, rank, index)
            for key in work_done(op):
                position[key] = (rank, index)
    done: set[Key] = set()
    waiters: dict[Key, list[int]] = defaultdict(list)
    cursor = [0] * num_ranks
    ready = list(range(num_ranks - 1, -1, -1))
    order: list[tuple[int, int]] = []
    while ready:
        rank = ready.pop()
        while cursor[rank] < len(ops[rank]):
            index = cursor[rank]
            op = ops[rank][index]
            missing = next((k for k in dependencies_of(op) if k not in done), None)
            if missing is not None:
                owner = position.get(missing)
                if owner is not None and owner[0] == rank and owner[1] >= index:
                    raise ScheduleError(
                        "dependency order",
                        f"{op} needs {_key_str(missing)}, which this rank runs later (op {owner[1]})",
                        rank,
                        index,
                    )
                waiters[missing].append(rank)
                break
            for key in work_done(op):
                done.add(key)
                ready.extend(waiters.pop(key, ()))
            order.append((rank, index))
            cursor[rank] += 1
    stuck = [r for r in range(num_ranks) if cursor[r] < len(ops[r])]
    if stuck:
        details = []
        for r in stuck:
            op = ops[r][cursor[r]]
            missing = next(k for k in dependencies_of(op) if k not in done)
            owner = position.get(missing)
            src = f"rank {owner[0]} op {owner[1]}" if owner else "no rank"
            details.append(f"rank {r} op {cursor[r]} ({op}) waits for {_key_str(missing)} ({src})")
        error = ScheduleError("deadlock", "no rank can proceed: " + "; ".join(details), stuck[0], cursor[stuck[0]])
        error.stuck = [(r, cursor[r]) for r in stuck]  # (rank, op index) where each stuck rank stopped
        raise error
    return order


def _check_pairing(schedule: Schedule, op: Op, rank: int, index: int) -> None:
    """An FB op's halves run at once: neither may need what the other completes."""
    found = coupled(schedule.placement, op)
    if found is not None:
        waiting, item = found
        raise ScheduleError("FB pairing", f"{op} overlaps {waiting} with the op it needs ({_key_str(item)}); "
                            "pair a forward with the backward of another micro-batch (or add warm-up forwards)",
                            rank, index)


def _key_str(key: Key) -> str:
    work, s, j = key
    return f"{s}{work.name}{j}"


def validate(schedule: Schedule) -> list[tuple[int, int]]:
    """Check every rule; return a valid sequential execution order (used by the lowering)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    check_work(schedule)
    return execution_order(schedule)

