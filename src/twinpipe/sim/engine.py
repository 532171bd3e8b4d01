"""Event simulation: time any schedule under a cost model and return a Timeline.

Each rank runs its ops in order; an op starts at ``max(rank free, every dependency done + comm)``,
where comm is paid only if the dependency ran on another rank. Ranks are advanced one at a time
until they block on a dependency that has not run yet; finishing an op wakes the ranks blocked
on it. Every op is started once, so the run is O(total ops).
"""

from __future__ import annotations

from twinpipe.schedule.check import ScheduleError
from twinpipe.schedule.ops import Op, OpKind, Schedule
from twinpipe.sim.costs import CostModel
from twinpipe.timeline import Slice, Timeline

__all__ = ["simulate"]

_F, _B, _W, _BW, _FB = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.FB


def simulate(schedule: Schedule, costs: CostModel | None = None) -> Timeline:
    """Time ``schedule`` under ``costs`` (default: T_F = T_B = T_W = 1, no comm, M_W = 0.5 M_B).

    Raises ScheduleError (rule "deadlock") naming the stuck ranks and ops if some rank would wait
    forever, and for ops on a wrong rank, out-of-range ops and repeated work.
    """
    costs = CostModel() if costs is None else costs
    placement = schedule.placement
    num_ranks, num_stages, m = placement.num_ranks, placement.num_stages, schedule.num_microbatches
    if len(schedule.ops) != num_ranks:
        raise ScheduleError("ranks", f"schedule has op lists for {len(schedule.ops)} ranks, placement has {num_ranks}")
    per_stage = costs.per_stage(num_stages)
    t_f, t_b, t_w, m_b = per_stage["t_f"], per_stage["t_b"], per_stage["t_w"], per_stage["m_b"]
    t_bw = [b + w for b, w in zip(t_b, t_w)]
    t_fb = per_stage.get("t_fb")
    comm, mw = float(costs.t_comm), float(costs.mw)
    rank_of = placement.stage_ranks
    prev = [placement.prev_stage(s) for s in range(num_stages)]
    nxt = [placement.next_stage(s) for s in range(num_stages)]

    # End times by key s*m + j; -1 = not run yet. "grad" is the input gradient (from B or BW).
    # A blocked rank waits on key k (forward) or n + k (grad).
    n = num_stages * m
    f_end = [-1.0] * n
    grad_end = [-1.0] * n
    w_done = bytearray(n)
    waiters: dict[int, list[int]] = {}

    def check(op: Op, s: int, j: int, rank: int, index: int) -> int:
        if not (0 <= s < num_stages and 0 <= j < m):
            raise ScheduleError("range", f"{op} is outside stages 0..{num_stages - 1} / micro-batches 0..{m - 1}", rank, index)
        if rank_of[s] != rank:
            raise ScheduleError("wrong rank", f"{op} runs stage {s}, which rank {rank_of[s]} holds", rank, index)
        return s * m + j

    def ready_at(kind: OpKind, s: int, j: int, rank: int, start: float) -> tuple[float, int]:
        """Earliest start given the dependencies of one simple op, or (start, blocking key)."""
        if kind is _F:
            ps = prev[s]
            if ps is not None:
                t = f_end[ps * m + j]
                if t < 0:
                    return start, ps * m + j
                t += comm if rank_of[ps] != rank else 0.0
                if t > start:
                    start = t
            return start, -1
        if kind is _W:
            t = grad_end[s * m + j]
            return (start, n + s * m + j) if t < 0 else (max(start, t), -1)
        t = f_end[s * m + j]  # B or BW: own forward (same rank) ...
        if t < 0:
            return start, s * m + j
        if t > start:
            start = t
        ns = nxt[s]  # ... and the gradient from the next stage
        if ns is not None:
            t = grad_end[ns * m + j]
            if t < 0:
                return start, n + ns * m + j
            t += comm if rank_of[ns] != rank else 0.0
            if t > start:
                start = t
        return start, -1

    def wake(key: int) -> None:
        woken = waiters.pop(key, None)
        if woken:
            runnable.extend(woken)

    def repeated(op: Op, rank: int, index: int):
        return ScheduleError("repeated op", f"{op} repeats work that already ran", rank, index)

    cursor = [0] * num_ranks
    free = [0.0] * num_ranks
    memory = [0.0] * num_ranks
    peak = [0.0] * num_ranks
    slices: list[Slice] = []
    runnable = list(range(num_ranks - 1, -1, -1))
    while runnable:
        rank = runnable.pop()
        ops, i, now, mem, top = schedule.ops[rank], cursor[rank], free[rank], memory[rank], peak[rank]
        while i < len(ops):
            op = ops[i]
            kind, s, j = op.kind, op.stage, op.microbatch
            k = check(op, s, j, rank, i)
            if kind is _FB:
                back = op.backward
                kb = check(op, back.stage, back.microbatch, rank, i)
                start, blocked = ready_at(_F, s, j, rank, now)
                if blocked < 0:
                    start, blocked = ready_at(_BW, back.stage, back.microbatch, rank, start)
            else:
                start, blocked = ready_at(kind, s, j, rank, now)
            if blocked >= 0:
                waiters.setdefault(blocked, []).append(rank)
                break
            if kind is _F:
                end = start + t_f[s]
                if f_end[k] >= 0:
                    raise repeated(op, rank, i)
                f_end[k] = end
                mem += m_b[s]
                top = max(top, mem)
                wake(k)
            elif kind is _B or kind is _BW:
                end = start + (t_b[s] if kind is _B else t_bw[s])
                if grad_end[k] >= 0:
                    raise repeated(op, rank, i)
                grad_end[k] = end
                mem += (mw - 1.0) * m_b[s] if kind is _B else -m_b[s]
                w_done[k] |= kind is _BW
                wake(n + k)
            elif kind is _W:
                end = start + t_w[s]
                if w_done[k]:
                    raise repeated(op, rank, i)
                w_done[k] = 1
                mem -= mw * m_b[s]
            else:  # FB: the forward's activations are live before the backward's are freed
                bs = op.backward.stage
                end = start + (t_fb[s] if t_fb is not None else t_f[s] + t_bw[bs])
                if f_end[k] >= 0 or grad_end[kb] >= 0:
                    raise repeated(op, rank, i)
                f_end[k] = grad_end[kb] = end
                w_done[kb] = 1
                mem += m_b[s]
                top = max(top, mem)
                mem -= m_b[bs]
                wake(k)
                wake(n + kb)
            if start > now and i > 0:
                slices.append(Slice(rank, now, start, None, "wait"))
            slices.append(Slice(rank, start, end, op))
            now = end
            i += 1
        cursor[rank], free[rank], memory[rank], peak[rank] = i, now, mem, top

    stuck = [r for r in range(num_ranks) if cursor[r] < len(schedule.ops[r])]
    if stuck:
        raise _deadlock(schedule, stuck, cursor, waiters, n, m)
    meta = {"costs": costs, "options": dict(schedule.options)}
    return Timeline(schedule.name, num_ranks, m, slices, placement, "simulated", tuple(peak), meta)


def _deadlock(schedule: Schedule, stuck: list[int], cursor: list[int], waiters: dict, n: int, m: int) -> ScheduleError:
    """Name every stuck rank, the op it is stuck at and what that op waits for (and who runs it)."""
    owner: dict[tuple[str, int, int], tuple[int, int]] = {}
    for rank, ops in enumerate(schedule.ops):
        for index, op in enumerate(ops):
            for part in op.parts():
                kind = "F" if part.kind is _F else "B" if part.kind in (_B, _BW) else None
                if kind:
                    owner.setdefault((kind, part.stage, part.microbatch), (rank, index))
    waiting_for = {r: key for key, ranks in waiters.items() for r in ranks}
    details = []
    for r in stuck:
        key = waiting_for[r]
        kind, rest = ("B", key - n) if key >= n else ("F", key)
        s, j = divmod(rest, m)
        who = owner.get((kind, s, j))
        src = f"rank {who[0]} op {who[1]}" if who else "no rank runs it"
        needed = f"{s}F{j}" if kind == "F" else f"{s}B{j} or {s}BW{j}"
        details.append(f"rank {r} op {cursor[r]} ({schedule.ops[r][cursor[r]]}) waits for {needed} ({src})")
    return ScheduleError("deadlock", "simulation stuck, ranks wait forever: " + "; ".join(details), stuck[0], cursor[stuck[0]])
