"""The planner's stand-in for overlapped 1F1B-family schedules: two transforms of a schedule's op lists.

Until the schedule layer builds them itself (``plan.candidates.schedule_layer_overlaps``), the planner
derives "interleaved 1F1B / ZB-V with the all-to-all hidden" from the plain schedule, as data:

- ``lead_warmup(schedule, k)``: every rank runs k more forwards before each of its backward ops
  (Kimi K2's extra warm-up micro-batches): each backward-side op (B, W, BW) moves k forwards later,
  forwards and backwards each keep their order. k more micro-batches' activations are held.
- ``pair_steady(schedule)``: each forward that sits next to a backward of another micro-batch on
  the same rank becomes one ``FB`` op with it, the op DualPipe's F&B is, so the simulator times it
  with ``t_fb`` (``sim.overlap.predict_fb``'s part order): one cost model for every F&B. Where the
  backward is split (B, then W later), the pair's W runs inside the FB op (an FB's backward half is
  a full backward): ZB-V's steady phase runs its W's within two ops of their B anyway.

A fused op starts only when both halves' inputs are there, so a pair is fused only if the second
op's inputs come, in a valid sequential execution of the schedule (``check.execution_order``),
before the first op: that execution, with the pair run at the first op's place, stays valid, so
fusing never deadlocks. Plain 1F1B's steady pairs fail this rule (the backward waits on the
neighbour's F&B, which waits on this forward): the extra warm-up forwards are what frees them.
"""

from __future__ import annotations

from twinpipe import checks
from twinpipe.schedule.check import execution_order
from twinpipe.schedule.deps import dependency_table, work_done
from twinpipe.schedule.ops import BW, FB, Op, OpKind, Schedule

__all__ = ["lead_warmup", "pair_steady"]


def lead_warmup(schedule: Schedule, extra: int) -> Schedule:
    """``schedule`` with every rank's backward-side ops ``extra`` forwards later (capped at the rank's forwards)."""
    checks.check_int(extra, "warmup_extra", low=0)
    if extra == 0:
        return schedule
    ops = []
    for rank_ops in schedule.ops:
        forwards = [op for op in rank_ops if op.kind is OpKind.F]
        later: list[list[Op]] = [[] for _ in range(len(forwards) + 1)]  # backward-side ops after the i-th forward
        seen = 0
        for op in rank_ops:
            if op.kind is OpKind.F:
                seen += 1
            else:
                later[min(len(forwards), seen + extra)].append(op)
        merged = list(later[0])
        for i, op in enumerate(forwards, 1):
            merged += [op, *later[i]]
        ops.append(tuple(merged))
    return _renamed(schedule, tuple(ops), warmup_extra=extra)


def pair_steady(schedule: Schedule) -> Schedule:
    """``schedule`` with each F next to a backward (BW, or B whose W is folded in) fused into an FB
    op, where the rule of the module docstring allows it."""
    order = {at: n for n, at in enumerate(execution_order(schedule))}
    producer = {key: (rank, index) for rank, rank_ops in enumerate(schedule.ops) for index, op in enumerate(rank_ops)
                for key in work_done(op)}
    needs = dependency_table(schedule.placement).op_needs

    def ready_before(op: Op, rank: int, index: int) -> bool:
        """Whether everything ``op`` needs is done before op ``index`` of ``rank`` in the execution order."""
        return all(order[producer[key]] < order[(rank, index)] for key in needs(op))

    ops = []
    for rank, rank_ops in enumerate(schedule.ops):
        folded: set[tuple[int, int]] = set()  # (stage, micro-batch) whose W now runs inside an FB op
        out: list[Op] = []
        i = 0
        while i < len(rank_ops):
            op = rank_ops[i]
            nxt = rank_ops[i + 1] if i + 1 < len(rank_ops) else None
            pair = None
            if nxt is not None and ready_before(nxt, rank, i):
                if op.kind is OpKind.F and _backward(nxt):
                    pair = (op, nxt)
                elif nxt.kind is OpKind.F and _backward(op):
                    pair = (nxt, op)
            if pair is None:
                if not (op.kind is OpKind.W and (op.stage, op.microbatch) in folded):
                    out.append(op)
                i += 1
                continue
            forward, backward = pair
            if backward.kind is OpKind.B:
                folded.add((backward.stage, backward.microbatch))
            out.append(FB(forward, BW(backward.stage, backward.microbatch)))
            i += 2
        ops.append(tuple(out))
    return _renamed(schedule, tuple(ops), overlap=True)


def _backward(op: Op) -> bool:
    return op.kind in (OpKind.BW, OpKind.B)


def _renamed(schedule: Schedule, ops: tuple, **options) -> Schedule:
    label = " ".join([schedule.name, *(f"{k}={v}" for k, v in sorted(options.items()))])
    return Schedule(label, schedule.placement, schedule.num_microbatches, ops, {**schedule.options, **options})
