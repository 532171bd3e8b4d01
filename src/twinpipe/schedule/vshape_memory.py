"""V-Half and V-Min ("Pipeline Parallelism with Controllable Memory", Qi et al., 2024).

Both run on the V placement (2p stages; rank r holds stages r and 2p-1-r) with B and W split, and
trade a little bubble for much less activation memory than ZB-V / 1F1B:

- V-Half: about (p+2)//2 micro-batches of 1F1B-size activations, bubble about p/(2m);
- V-Min:  about (p+4)//3, bubble about 2p/(3m).

Construction (the authors' ``zbv_greedy``, reimplemented): time is cut into unit *slots*, and
every micro-batch k repeats one building block, shifted by 6k slots: on rank i, its F of the first
stage (chunk 0), F of the second stage (chunk 1), B of chunk 1 and B of chunk 0 sit at fixed slot
offsets. Each rank's four offsets differ mod 6, so blocks never collide, and the distance from a
forward to its backward (in 6-slot blocks: how many micro-batches are in flight) fixes the memory.
Then, on this slot plan:

1. put W's into free slots (each W right after a B frees one, in order);
2. *squeeze*: walk the ops in slot order and move each one (during warm-up and cool-down only)
   to the earliest free slot after its dependencies that does not raise the plan's peak memory;
3. time the plan (unit times) and use the start times as the new slots; drop the W's and squeeze
   the cool-down again, with W's now implicit in free slots;
4. put W's back (those of chunk 1 first), and time the result with the given costs: each rank
   runs its ops in slot order.

As in the authors' code the slots are unit times: the order does not depend on the costs, which
only time it (``options["cost"]``, the largest per-rank span). The squeeze counts memory with
M_W = ``mw``·M_B; the authors count an activation as held whole until its W, which is ``mw=1``.
"""

from __future__ import annotations

import heapq
from functools import lru_cache

from twinpipe import checks
from twinpipe.schedule._args import check_int, check_number, per_stage
from twinpipe.schedule.costs import memory_delta
from twinpipe.schedule.deps import Work, dependency_table
from twinpipe.schedule.ops import B, F, OpKind, Schedule, W
from twinpipe.schedule.placement import vshape

__all__ = ["v_half", "v_min", "block_offsets"]

# Op types of one rank, in the slot plan: F of chunk 0 (stage i), F of chunk 1 (stage 2p-1-i),
# B of chunk 1, B of chunk 0, then W (one list, or one per chunk: W of chunk 1, W of chunk 0).
_F0, _F1, _B1, _B0, _W = 0, 1, 2, 3, 4
_TOL = 1e-9  # memory sums of fractional mw


def block_offsets(num_ranks: int, variant: str) -> list[tuple[int, int, int, int]]:
    """Slot offsets (F-c0, F-c1, B-c1, B-c0) of the 6-slot building block on each rank."""
    p = num_ranks
    if variant == "min":
        d = 2 if p % 3 == 0 else 0
        return [(i, 2 * p - 1 - i, 2 * p + d + i, 4 * p + d - 1 - i) for i in range(p)]
    if variant == "half":
        d = 3 if p % 2 == 0 else 0
        return [(2 * i, 3 * p - 2 - i, 3 * p + d + 2 * i - 1, 6 * p + d - i - 2) for i in range(p)]
    raise checks.bad("variant", variant, "allowed are 'min', 'half'")


def _ordered(plan: list[list[list[int]]]):
    """Every op of the plan as (slot, rank, type, micro-batch), in global slot order.

    A generator: an op's slot is read only when it becomes the next of its (rank, type) list, so
    callers may move ops they have already received (as the squeeze does) but no later ones.
    """
    heap = [(lists[t][0], r, t, 0) for r, lists in enumerate(plan) for t in range(len(lists)) if lists[t]]
    heapq.heapify(heap)
    while heap:
        item = heapq.heappop(heap)
        yield item
        _, r, t, k = item
        if k + 1 < len(plan[r][t]):
            heapq.heappush(heap, (plan[r][t][k + 1], r, t, k + 1))


def _put_w(lists: list[list[int]], split: bool) -> list[list[int]]:
    """Add W's to one rank's F/B slot lists: one into each free slot while a B awaits its W.

    With ``split`` the W's of chunk 1 (type 4) and chunk 0 (type 5) are separate lists, chunk 1
    first; leftover W's go after the last op.
    """
    taken = {}
    for t in range(4):
        for s in lists[t]:
            taken[s] = t
    end = max(s for t in range(4) for s in lists[t])
    ws: list[list[int]] = [[], []] if split else [[]]
    pending = [0, 0]
    for s in range(end + 1):
        t = taken.get(s)
        if t is not None:
            if t in (_B1, _B0):
                pending[t - _B1 if split else 0] += 1
        else:
            for c in range(2):
                if pending[c]:
                    ws[c].append(s)
                    pending[c] -= 1
                    break
    s = end
    for c in range(len(ws)):
        for _ in range(pending[c]):
            s += 1
            ws[c].append(s)
    return [list(x) for x in lists[:4]] + ws


def _peak(lists: list[list[int]], mw: float) -> float:
    """Peak activation memory of one rank's plan, in units of one stage's M_B.

    Each op changes it by ``costs.memory_delta`` (F adds 1, B keeps ``mw`` of it, W frees that).
    Without W lists, a W is assumed to run in each free slot while a B awaits one (how the authors
    count it).
    """
    delta = {}
    for t, slots in enumerate(lists):
        for s in slots:
            delta[s] = t
    f, b, w = (memory_delta(kind, 1.0, mw) for kind in "FBW")
    change = (f, f, b, b, w, w)  # by op type: F0, F1, B1, B0, then the W lists
    explicit_w = len(lists) > 4
    cur = top = 0.0
    pending = 0
    for s in range(max(delta) + 1):
        t = delta.get(s)
        if t is not None:
            cur += change[t]
            pending += t in (_B1, _B0)
        elif not explicit_w and pending:
            cur += w
            pending -= 1
        top = max(top, cur)
    return top


@lru_cache(maxsize=32)
def _type_needs(p: int) -> tuple[tuple[tuple[tuple[int, int, bool], ...], ...], ...]:
    """``[r][t]``: the (rank, type, local) ops of the same micro-batch that op type t (F0, F1, B1,
    B0) on rank r needs: deps.py's rule on the V placement, in slot-plan terms."""
    table = dependency_table(vshape(p)).needs

    def rank_type(work: Work, stage: int) -> tuple[int, int]:
        if stage < p:  # chunk 0 of rank ``stage``
            return stage, _F0 if work is Work.F else _B0
        return 2 * p - 1 - stage, _F1 if work is Work.F else _B1

    out = []
    for r in range(p):
        kinds = ((OpKind.F, r), (OpKind.F, 2 * p - 1 - r), (OpKind.B, 2 * p - 1 - r), (OpKind.B, r))
        out.append(tuple(tuple((*rank_type(n.work, n.stage), n.local) for n in table[kind][s]) for kind, s in kinds))
    return tuple(out)


def _dep_slots(plan, r: int, t: int, k: int) -> int:
    """The latest slot among what op (type t, micro-batch k) on rank r must wait for (-1: none)."""
    deps = -1
    if t < _W:
        for dr, dt, _ in _type_needs(len(plan))[r][t]:
            deps = max(deps, plan[dr][dt][k])
    else:  # the k-th W follows the k-th B of either chunk
        deps = max(deps, sorted(plan[r][_B1] + plan[r][_B0])[k])
    if k > 0:
        deps = max(deps, plan[r][t][k - 1])
    return deps


def _squeeze(plan: list[list[list[int]]], with_w: bool, mw: float) -> list[list[list[int]]]:
    """Move ops to earlier free slots without raising the plan's peak memory; return unit-timed slots.

    Ops are visited in slot order. Warm-up ops (before rank 0's first chunk-0 B) move only when
    ``with_w``; steady-state ops (until the first last-micro-batch chunk-0 F) never move; the
    cool-down always does. Each op goes to the first free slot after its dependencies for which
    its rank's peak stays within the plan's starting peak.
    """
    if with_w:
        plan = [_put_w(lists, split=False) for lists in plan]
    plan = [[list(x) for x in lists] for lists in plan]
    limit = max(_peak(lists, mw) for lists in plan) + _TOL
    m = len(plan[0][_F0])
    occupied = [set() for _ in plan]
    phase = 0  # 0 warm-up, 1 steady state, 2 cool-down
    for slot, r, t, k in _ordered(plan):
        if t == _B0 and r == 0 and phase == 0:
            phase = 1
        if phase == 1 or (phase == 0 and not with_w):
            if phase == 1 and t == _F0 and k == m - 1:
                phase = 2
            occupied[r].add(slot)
            continue
        lists = plan[r][t]
        for earlier in range(_dep_slots(plan, r, t, k) + 1, slot):
            if earlier in occupied[r]:
                continue
            lists[k] = earlier
            if _peak(plan[r], mw) <= limit:
                break
        else:
            lists[k] = slot
        occupied[r].add(lists[k])
    if not with_w:
        plan = [_put_w(lists, split=False) for lists in plan]
    start = _timed(plan, [[1.0] * 5] * len(plan), 0.0)[0]  # unit times: integral start times
    return [[[int(x) for x in slots] for slots in lists] for lists in start]


def _timed(plan, costs, comm: float):
    """Run each rank's ops in slot order, each as early as its inputs allow.

    ``costs[r][t]``: time of type t on rank r. Returns (start slots per rank/type/micro-batch,
    op order per rank as (type, micro-batch), cost = largest per-rank span).
    """
    p = len(plan)
    end: dict[tuple[int, int, int], float] = {}
    start = [[[0.0] * len(x) for x in lists] for lists in plan]
    order: list[list[tuple[int, int]]] = [[] for _ in plan]
    free = [0.0] * p
    first = [None] * p
    needs = _type_needs(p)
    for _, r, t, k in _ordered(plan):
        ready = free[r]
        if t < _W:  # a W runs after its B in slot order: it waits for nothing else
            for dr, dt, local in needs[r][t]:
                ready = max(ready, end[(dr, dt, k)] + (0.0 if local else comm))
        start[r][t][k] = ready
        free[r] = end[(r, t, k)] = ready + costs[r][t]
        first[r] = ready if first[r] is None else first[r]
        order[r].append((t, k))
    return start, order, max(free[r] - first[r] for r in range(p))


def _build(name: str, variant: str, num_ranks, num_microbatches, t_f, t_b, t_w, t_comm, mw) -> Schedule:
    p = check_int(name, "num_ranks", num_ranks)
    m = check_int(name, "num_microbatches", num_microbatches)
    times = [per_stage(name, arg, value, 2 * p, strict=True) for arg, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w))]
    comm = check_number(name, "t_comm", t_comm)
    ratio = check_number(name, "mw", mw)
    plan = [[list(range(offset, offset + 6 * m, 6)) for offset in offsets] for offsets in block_offsets(p, variant)]
    plan = _squeeze(plan, with_w=True, mw=ratio)
    plan = _squeeze([lists[:4] for lists in plan], with_w=False, mw=ratio)
    plan = [_put_w(lists[:4], split=True) for lists in plan]
    t_f_, t_b_, t_w_ = times
    stage = [(i, 2 * p - 1 - i) for i in range(p)]  # (chunk 0, chunk 1) stages of rank i
    # type -> (kind, stage) on rank i: F0, F1, B1, B0, W of chunk 1, W of chunk 0
    kinds = [((F, c0), (F, c1), (B, c1), (B, c0), (W, c1), (W, c0)) for c0, c1 in stage]
    costs = [[t_f_[c0], t_f_[c1], t_b_[c1], t_b_[c0], t_w_[c1], t_w_[c0]] for c0, c1 in stage]
    _, order, cost = _timed(plan, costs, comm)
    ops = tuple(tuple(kinds[r][t][0](kinds[r][t][1], k) for t, k in rank_order) for r, rank_order in enumerate(order))
    target = 2 * ((p + 4) // 3 if variant == "min" else (p + 2) // 2)
    options = {"cost": cost, "mw": ratio, "target_memory": target}
    return Schedule(name, vshape(p), m, ops, options)


def v_half(num_ranks: int, num_microbatches: int, t_f=1.0, t_b=1.0, t_w=1.0, t_comm: float = 0.0, mw: float = 0.5) -> Schedule:
    """V-Half on any ``num_ranks`` >= 1 and ``num_microbatches`` >= 1.

    Peak activations about (p+2)//2 micro-batches of a 1F1B-size stage (2·((p+2)//2) of its
    half-size V stages); times are numbers or one per stage (2p) and only time the plan.
    """
    return _build("v-half", "half", num_ranks, num_microbatches, t_f, t_b, t_w, t_comm, mw)


def v_min(num_ranks: int, num_microbatches: int, t_f=1.0, t_b=1.0, t_w=1.0, t_comm: float = 0.0, mw: float = 0.5) -> Schedule:
    """V-Min on any ``num_ranks`` >= 1 and ``num_microbatches`` >= 1.

    Peak activations about (p+4)//3 micro-batches of a 1F1B-size stage (2·((p+4)//3) of its
    half-size V stages); times are numbers or one per stage (2p) and only time the plan.
    """
    return _build("v-min", "min", num_ranks, num_microbatches, t_f, t_b, t_w, t_comm, mw)
