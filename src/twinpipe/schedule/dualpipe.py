"""DualPipe and DualPipeV: DeepSeek's 8-step program, written once, as data.

Both run the same per-rank program over two *phases* (the two stages a rank holds). With H
half-ranks, a rank's half-rank h and C micro-batches per phase:

  1  2(H-h-1) x F0                      warm-up of the first phase
  2  (h+1)    x F0 F1                   both phases start
  3  (H-h-1)  x B1 W F1                 zero bubble: B's weight gradient deferred
  4  C-2H+h+1 x (F0;B1) (F1;B0)         steady state: forward overlapped with full backward
  5  (H-h-1)  x B1 (F1;B0)
  6  (h+1)    x B1 B0                   W deferred from the middle of this step on
  7  (H-h-1)  x W B0                    zero bubble
  8  (h+1)    x W                       drain

On the middle ranks (DualPipe) or the last rank (DualPipeV) the first pair of step 4 runs F0 and
B1 one after the other instead of overlapped: this shortens the bubble. W runs the oldest
deferred weight gradient (the official WeightGradStore is a FIFO queue).

DualPipeV (H = P ranks, "cut in half"): rank r holds stages r and 2P-1-r of one V-shaped chain;
phase 0 is stage r. DualPipe (H = P/2): the same layout split into two chains running in opposite
directions; ranks in the second half start with the reverse direction, so their phase 0 is
their stage 2P-1-r.

The official program needs C >= 2H. For fewer micro-batches we generate the program for 2H and
drop the micro-batches that do not exist; removing work from a valid schedule keeps it valid.
"""

from __future__ import annotations

from collections import deque

from twinpipe import checks

from twinpipe.schedule.ops import BW, FB, Op, Schedule, W, B, F
from twinpipe.schedule.placement import dual, vshape

__all__ = ["dualpipe", "dualpipev"]


def _program(num_half: int, half_rank: int, per_phase: int) -> list[tuple]:
    """The 8 steps as abstract actions: ("F", phase), ("B", phase, deferred_w), ("W",), ("FB", f_phase, b_phase)."""
    H, h, C = num_half, half_rank, per_phase
    acts: list[tuple] = []
    acts += [("F", 0)] * (2 * (H - h - 1))
    acts += [("F", 0), ("F", 1)] * (h + 1)
    acts += [("B", 1, True), ("W",), ("F", 1)] * (H - h - 1)
    for i in range(C - 2 * H + h + 1):
        if i == 0 and h == H - 1:
            acts += [("F", 0), ("B", 1, False)]  # not overlapped, to shorten the bubble
        else:
            acts.append(("FB", 0, 1))
        acts.append(("FB", 1, 0))
    acts += [("B", 1, False), ("FB", 1, 0)] * (H - h - 1)
    deferred = False
    for i in range(h + 1):
        if i == (h + 1) // 2 and h % 2 == 1:
            deferred = True
        acts.append(("B", 1, deferred))
        if i == (h + 1) // 2 and h % 2 == 0:
            deferred = True
        acts.append(("B", 0, deferred))
    acts += [("W",), ("B", 0, True)] * (H - h - 1)
    acts += [("W",)] * (h + 1)
    return acts


def _materialise(acts, stage_of_phase, microbatch_of) -> list[Op]:
    """Turn abstract actions into ops: micro-batches in order per phase, W for the oldest deferred B."""
    next_f = [0, 0]
    next_b = [0, 0]
    pending_w: deque[tuple[int, int]] = deque()
    ops: list[Op] = []

    def forward(phase: int) -> Op:
        op = F(stage_of_phase[phase], microbatch_of(phase, next_f[phase]))
        next_f[phase] += 1
        return op

    def backward(phase: int, deferred: bool) -> Op:
        stage, mb = stage_of_phase[phase], microbatch_of(phase, next_b[phase])
        next_b[phase] += 1
        if deferred:
            pending_w.append((stage, mb))
            return B(stage, mb)
        return BW(stage, mb)

    for act in acts:
        if act[0] == "F":
            ops.append(forward(act[1]))
        elif act[0] == "B":
            ops.append(backward(act[1], act[2]))
        elif act[0] == "W":
            ops.append(W(*pending_w.popleft()))
        else:
            ops.append(FB(forward(act[1]), backward(act[2], False)))
    return ops


def _drop_missing(ops: list[Op], exists) -> list[Op]:
    """Remove work on micro-batches that do not exist; an FB keeps whichever half exists."""
    kept = []
    for op in ops:
        if op.backward is not None:
            f_ok, b_ok = exists(op.microbatch), exists(op.backward.microbatch)
            if f_ok and b_ok:
                kept.append(op)
            elif f_ok:
                kept.append(op.forward)
            elif b_ok:
                kept.append(op.backward)
        elif exists(op.microbatch):
            kept.append(op)
    return kept


def _check_counts(name: str, num_ranks, num_microbatches, even_ranks: bool, even_chunks: bool) -> None:
    even = {"low": 2, "multiple_of": 2}
    checks.check_int(num_ranks, f"{name}: num_ranks", **(even if even_ranks else {"low": 1}))
    checks.check_int(num_microbatches, f"{name}: num_chunks", **(even if even_chunks else {"low": 1}),
                     why="half per direction" if even_chunks else None)


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV on ``num_ranks`` ranks (2P stages) for any ``num_microbatches`` >= 1.

    With ``num_microbatches >= 2 * num_ranks`` the op order equals the official DualPipeV's.
    """
    _check_counts("dualpipev", num_ranks, num_microbatches, even_ranks=False, even_chunks=False)
    p, n = num_ranks, num_microbatches
    n_program = max(n, 2 * p)
    ops = []
    for rank in range(p):
        acts = _program(p, rank, n_program)
        rank_ops = _materialise(acts, (rank, 2 * p - 1 - rank), lambda phase, k: k)
        ops.append(tuple(_drop_missing(rank_ops, lambda mb: mb < n)))
    return Schedule("dualpipev", vshape(p), n, tuple(ops))


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe on an even ``num_ranks`` for an even ``num_microbatches`` (half per direction).

    With ``num_microbatches >= 2 * num_ranks`` the op order equals the official DualPipe's.
    """
    _check_counts("dualpipe", num_ranks, num_microbatches, even_ranks=True, even_chunks=True)
    p, c = num_ranks, num_microbatches // 2
    half = p // 2
    c_program = max(c, p)
    ops = []
    for rank in range(p):
        h = min(rank, p - 1 - rank)
        stages = (rank, 2 * p - 1 - rank)
        if rank >= half:  # the second half starts with the reverse direction
            stages = stages[::-1]
        # Direction d (0: stage < p) carries micro-batches d*c .. d*c + c - 1.
        directions = tuple(int(s >= p) for s in stages)
        rank_ops = _materialise(_program(half, h, c_program), stages, lambda phase, k: directions[phase] * c_program + k)
        kept = _drop_missing(rank_ops, lambda mb: mb % c_program < c)
        ops.append(tuple(_renumber(op, c_program, c) for op in kept))
    return Schedule("dualpipe", dual(p), 2 * c, tuple(ops))


def _renumber(op: Op, old: int, new: int) -> Op:
    """Map micro-batch d*old + k to d*new + k (direction d)."""
    def mb(j: int) -> int:
        return (j // old) * new + j % old

    if op.backward is not None:
        return FB(F(op.stage, mb(op.microbatch)), BW(op.backward.stage, mb(op.backward.microbatch)))
    return Op(op.kind, op.stage, mb(op.microbatch))
