"""How the data-parallel reducers cut gradients, as pure Python: the one rule that the trainer's
reducers (``twinpipe.train.grads``, ``twinpipe.train.zero``) follow and that ``twinpipe.sim.gpt``
predicts ZeRO-1's shards with.

Parameters are cut into buckets of up to ``BUCKET_BYTES`` in order (``buckets``); ZeRO-1 cuts each
bucket into one contiguous run of whole parameters per data-parallel rank (``runs``).
"""

from __future__ import annotations

from collections.abc import Sequence

from twinpipe.sim.partition import partition

__all__ = ["BUCKET_BYTES", "buckets", "runs"]

BUCKET_BYTES = 25 << 20  # the data-parallel reducer's gradient buckets


def buckets(nbytes: Sequence[int], bucket_bytes: int = BUCKET_BYTES) -> list[range]:
    """Index ranges of consecutive parameters (``nbytes`` each) whose sum stays within
    ``bucket_bytes``; a parameter larger than that is a bucket of its own."""
    out: list[range] = []
    start, size = 0, bucket_bytes + 1
    for i, n in enumerate(nbytes):
        if size + n > bucket_bytes:
            if i:
                out.append(range(start, i))
            start, size = i, 0
        size += n
    if len(nbytes):
        out.append(range(start, len(nbytes)))
    return out


def runs(sizes: Sequence[int], world: int) -> list[range]:
    """Index ranges of ``sizes`` for each of ``world`` ranks: contiguous, the largest as small as
    whole parameters allow (fewer parameters than ranks: one each, the last ranks none)."""
    n = len(sizes)
    if n <= world:
        return [range(i, i + 1) if i < n else range(n, n) for i in range(world)]
    counts, start, out = partition(sizes, world), 0, []
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out
