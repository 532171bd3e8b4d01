"""Interleaved 1F1B (Megatron-LM's virtual pipeline): v stages per rank on a looped placement.

Rank r holds stages r, r+p, ..., r+(v-1)p. Each rank walks its m*v (stage, micro-batch) pairs in
groups of p micro-batches: p forwards of its first stage, p of its second, ..., then the next p
micro-batches. Backwards use the same walk with the stages reversed.
"""

from __future__ import annotations

from twinpipe.schedule._args import check_int
from twinpipe.schedule.ops import BW, F, Schedule
from twinpipe.schedule.placement import Placement, looped

__all__ = ["interleaved_1f1b", "placement"]

_NAME = "interleaved-1f1b"


def placement(num_ranks: int, stages_per_rank: int = 2) -> Placement:
    """The looped placement: rank r holds stages r, r+p, ..., r+(v-1)p."""
    return looped(num_ranks, check_int(_NAME, "stages_per_rank", stages_per_rank))


def _walk(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """The k-th (chunk, micro-batch) a rank visits."""
    chunk = (k // p) % v
    if backward:
        chunk = v - 1 - chunk
    return chunk, (k // (p * v)) * p + k % p


def interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B with ``stages_per_rank`` = v >= 1 on p ranks (v*p stages).

    ``num_microbatches`` must be a multiple of ``num_ranks`` (as in Megatron-LM): the walk takes
    micro-batches in groups of p.
    """
    name = _NAME
    p = check_int(name, "num_ranks", num_ranks)
    v = check_int(name, "stages_per_rank", stages_per_rank)
    m = check_int(name, "num_microbatches", num_microbatches, minimum=p, multiple_of=p)
    total = m * v
    ops = []
    for r in range(p):
        # Warm-up: (v-1)p forwards bring micro-batch 0 to this rank's last stage; then it travels
        # p-1-r hops on to rank p-1 and its backward p-1-r hops back, and the rank runs one more
        # forward per hop each way instead of waiting.
        warmup = min(2 * (p - 1 - r) + (v - 1) * p, total)
        order = [("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [("F", warmup + k), ("B", k)]
        order += [("B", k) for k in range(total - warmup, total)]
        rank_ops = []
        for kind, k in order:
            chunk, j = _walk(k, p, v, backward=kind == "B")
            stage = chunk * p + r
            rank_ops.append(F(stage, j) if kind == "F" else BW(stage, j))
        ops.append(tuple(rank_ops))
    return Schedule(name, looped(p, v), m, tuple(ops), {"stages_per_rank": v})
