"""Overlapped F&B ops for the 1F1B family: one rule that turns a schedule's steady phase into FB ops.

In the steady phase of 1F1B, interleaved 1F1B, ZB-H1/H2 and ZB-V each rank alternates a forward
and a backward. ``overlap`` pairs each forward with the backward that follows it on the same rank
as one FB op (Megatron-Core's combined 1F1B: the forward of the next micro-batch with the backward
of the oldest; in interleaved 1F1B the two are usually of different chunks). Where the schedule
splits B and W the pair's backward half is the B and the W stays a later op of its own.

A pair whose halves depend on each other cannot run at once (on the last rank of 1F1B the
forward of micro-batch j is followed by its own backward): it stays two ops. ``warmup_extra=k``
(Kimi K2's extra warm-up micro-batches) runs k more forwards before each rank's first backward,
which keeps every later forward k ops earlier, so such pairs come apart and pair with older
backwards (on a V placement, ZB-V's, the forwards of the first leg only). Each extra warm-up
forward holds one more micro-batch's activations on its rank until the end of the steady phase;
the schedule's ops say so, and every memory count reads the ops.
"""

from __future__ import annotations

from dataclasses import replace

from twinpipe.schedule.check import ScheduleError, execution_order
from twinpipe.schedule.deps import coupled
from twinpipe.schedule.ops import FB, Op, OpKind, Schedule
from twinpipe.schedule.placement import Placement

__all__ = ["overlap", "add_warmup", "pair_steady"]

_BACKWARDS = (OpKind.B, OpKind.BW)


def add_warmup(ops: tuple[Op, ...], extra: int, moves=lambda op: True) -> list[Op]:
    """``ops`` with every other op (backwards, W's, the forwards ``moves`` leaves) run after
    ``extra`` more of the forwards ``moves`` picks than before (as many as there are); each keeps
    its order among its kind."""
    forwards = [op for op in ops if op.kind is OpKind.F and moves(op)]
    out: list[Op] = []
    seen = emitted = 0  # moved forwards before the current op in ``ops``; moved forwards already in ``out``
    for op in ops:
        if op.kind is OpKind.F and moves(op):
            seen += 1
            continue
        target = min(seen + extra, len(forwards))
        out += forwards[emitted:target]
        emitted = max(emitted, target)
        out.append(op)
    return out + forwards[emitted:]


def _warmup_leg(placement: Placement):
    """Which forwards the extra warm-up moves: on a V placement those of the first leg (going down
    the ranks; the return leg's forwards wait on the next rank's backwards), else all."""
    if placement.kind == "v":
        return lambda op: placement.stage_chain_position(op.stage) < placement.num_ranks
    return lambda op: True


def pair_steady(placement: Placement, ops: list[Op]) -> list[Op]:
    """Each forward whose next backward (B or BW) follows it with only W's between becomes one FB
    op with it, the W's after, unless the two depend on each other (``deps.coupled``). A W needs
    only its own B, done earlier, so running it one op later keeps every dependency."""
    out: list[Op] = []
    i = 0
    while i < len(ops):
        op = ops[i]
        if op.kind is OpKind.F:
            k = i + 1
            while k < len(ops) and ops[k].kind is OpKind.W:
                k += 1
            if k < len(ops) and ops[k].kind in _BACKWARDS:
                pair = FB(op, ops[k])
                if coupled(placement, pair) is None:
                    out.append(pair)
                    out += ops[i + 1:k]
                    i = k + 1
                    continue
        out.append(op)
        i += 1
    return out


def _split(op: Op) -> tuple[Op, ...]:
    return op.parts() if op.backward is not None else (op,)


def overlap(schedule: Schedule, warmup_extra: int = 0) -> Schedule:
    """``schedule`` with its steady-phase forwards and backwards paired as FB ops, after
    ``warmup_extra`` more warm-up forwards on each rank; its options record both.

    A pair makes its forward wait for its backward's inputs. Where that closes a cycle across ranks
    (a forward at the end of a warm-up cut short by few micro-batches feeds, through the next rank,
    the backward it is paired with), the pair on the lowest stuck rank is split again, until the
    schedule runs (``check.execution_order``); ``schedule``'s own pairs (DualPipe's) stay.
    """
    own = {op for rank_ops in schedule.ops for op in rank_ops if op.backward is not None}
    moves = _warmup_leg(schedule.placement)
    ops = [pair_steady(schedule.placement, add_warmup(rank_ops, warmup_extra, moves)) for rank_ops in schedule.ops]
    options = {**schedule.options, "overlap": True, "warmup_extra": warmup_extra}
    while True:
        paired = replace(schedule, ops=tuple(map(tuple, ops)), options=options)
        try:
            execution_order(paired)
            return paired
        except ScheduleError as error:
            ours = [(r, i) for r, i in error.stuck if ops[r][i].backward is not None and ops[r][i] not in own]
            if not ours:
                raise
            r, i = ours[0]
            ops[r][i:i + 1] = _split(ops[r][i])
