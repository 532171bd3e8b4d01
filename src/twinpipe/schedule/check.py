"""Validation: reject a schedule that misses or repeats an op, runs an op before what it needs,
or can deadlock. Every error names the rank, the op index and the broken rule.
"""

from __future__ import annotations

from collections import defaultdict

from twinpipe.schedule.ops import Op, OpKind, Schedule

__all__ = ["ScheduleError", "validate", "dependencies", "execution_order"]


class ScheduleError(ValueError):
    """A schedule breaks a rule; ``rank``, ``index`` and ``rule`` say where and which."""

    def __init__(self, rule: str, message: str, rank: int | None = None, index: int | None = None):
        where = "" if rank is None else f"rank {rank}" + ("" if index is None else f", op {index}") + ": "
        super().__init__(f"{where}[{rule}] {message}")
        self.rule, self.rank, self.index = rule, rank, index


# Dependency keys: ("F", s, j) forward done; ("B", s, j) input gradient done (by B or BW);
# ("W", s, j) weight gradient done (by W or BW).
Key = tuple[str, int, int]


def _done_keys(op: Op) -> list[Key]:
    keys: list[Key] = []
    for part in op.parts():
        if part.kind is OpKind.F:
            keys.append(("F", part.stage, part.microbatch))
        elif part.kind is OpKind.B:
            keys.append(("B", part.stage, part.microbatch))
        elif part.kind is OpKind.W:
            keys.append(("W", part.stage, part.microbatch))
        else:  # BW
            keys += [("B", part.stage, part.microbatch), ("W", part.stage, part.microbatch)]
    return keys


def dependencies(schedule: Schedule, op: Op) -> list[Key]:
    """What must have run before ``op`` can start (on any rank)."""
    placement = schedule.placement
    needs: list[Key] = []
    for part in op.parts():
        s, j = part.stage, part.microbatch
        if part.kind is OpKind.F:
            prev = placement.prev_stage(s)
            if prev is not None:
                needs.append(("F", prev, j))
        elif part.kind in (OpKind.B, OpKind.BW):
            needs.append(("F", s, j))
            nxt = placement.next_stage(s)
            if nxt is not None:
                needs.append(("B", nxt, j))
        else:  # W
            needs.append(("B", s, j))
    return needs


def _check_membership(schedule: Schedule) -> None:
    placement, m = schedule.placement, schedule.num_microbatches
    if len(schedule.ops) != placement.num_ranks:
        raise ScheduleError("ranks", f"schedule has op lists for {len(schedule.ops)} ranks, placement has {placement.num_ranks}")
    seen: dict[Key, tuple[int, int]] = {}
    for rank, ops in enumerate(schedule.ops):
        for index, op in enumerate(ops):
            for part in op.parts():
                s, j = part.stage, part.microbatch
                if not 0 <= s < placement.num_stages:
                    raise ScheduleError("stage", f"{op} names stage {s}; stages are 0..{placement.num_stages - 1}", rank, index)
                if placement.rank_of(s) != rank:
                    raise ScheduleError("wrong rank", f"{op} runs stage {s}, which rank {placement.rank_of(s)} holds", rank, index)
                if not 0 <= j < m:
                    raise ScheduleError("micro-batch", f"{op} names micro-batch {j}; there are {m}", rank, index)
                chain = placement.chain_of_stage(s)
                if j not in placement.microbatches_of_chain(chain, m):
                    raise ScheduleError("micro-batch", f"{op}: micro-batch {j} does not travel through chain {chain}", rank, index)
            for key in _done_keys(op):
                if key in seen:
                    r0, i0 = seen[key]
                    raise ScheduleError("repeated op", f"{op} repeats work already done at rank {r0}, op {i0}", rank, index)
                seen[key] = (rank, index)
    for chain_index, chain in enumerate(placement.chains):
        for s in chain:
            for j in placement.microbatches_of_chain(chain_index, m):
                for kind in ("F",) if schedule.options.get("forward_only") else ("F", "B", "W"):
                    if (kind, s, j) not in seen:
                        what = {"F": f"{s}F{j}", "B": f"{s}B{j} or {s}BW{j}", "W": f"{s}W{j} or {s}BW{j}"}[kind]
                        raise ScheduleError("missing op", f"no op runs {what}", placement.rank_of(s))


def execution_order(schedule: Schedule) -> list[tuple[int, int]]:
    """A sequential execution of the whole schedule as (rank, op index), dependencies respected.

    Raises ScheduleError if an op depends on something its own rank runs later (a local order
    error) or if the ranks can block each other forever (deadlock).
    """
    ops = schedule.ops
    num_ranks = len(ops)
    position = {}
    for rank, rank_ops in enumerate(ops):
        for index, op in enumerate(rank_ops):
            for key in _done_keys(op):
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
            missing = next((k for k in dependencies(schedule, op) if k not in done), None)
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
            for key in _done_keys(op):
                done.add(key)
                ready.extend(waiters.pop(key, ()))
            order.append((rank, index))
            cursor[rank] += 1
    stuck = [r for r in range(num_ranks) if cursor[r] < len(ops[r])]
    if stuck:
        details = []
        for r in stuck:
            op = ops[r][cursor[r]]
            missing = next(k for k in dependencies(schedule, op) if k not in done)
            owner = position.get(missing)
            src = f"rank {owner[0]} op {owner[1]}" if owner else "no rank"
            details.append(f"rank {r} op {cursor[r]} ({op}) waits for {_key_str(missing)} ({src})")
        raise ScheduleError("deadlock", "no rank can proceed: " + "; ".join(details), stuck[0], cursor[stuck[0]])
    return order


def _key_str(key: Key) -> str:
    kind, s, j = key
    return f"{s}{kind}{j}"


def validate(schedule: Schedule) -> list[tuple[int, int]]:
    """Check every rule; return a valid sequential execution order (used by the lowering)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    _check_membership(schedule)
    return execution_order(schedule)

