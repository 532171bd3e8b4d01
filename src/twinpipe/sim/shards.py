"""How the data-parallel reducers cut gradients, as pure Python: the one rule that the trainer's
reducers (``twinpipe.train.grads``, ``twinpipe.train.zero``) follow and that ``twinpipe.sim.gpt``
predicts ZeRO-1's shards with.

Parameters are cut into buckets of up to ``BUCKET_BYTES`` in order (``buckets``); ZeRO-1 cuts each
bucket into one contiguous run of whole parameters per data-parallel rank (``runs``). With mirrored
copies of the stages (DualPipe, Chimera, BitPipe: ``mirror_copies``) the buckets are per model stage
and each rank's run is cut again into one sub-run per copy (``runs`` again): copy c of the stage on
data-parallel rank i updates sub-run c of run i, so each parameter has one owner among the
``dp * copies`` ranks holding it.
"""

from __future__ import annotations

from collections.abc import Sequence

from twinpipe.sim.partition import partition

__all__ = ["BUCKET_BYTES", "buckets", "mirror_copies", "runs"]

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


def mirror_copies(placement) -> dict[int, list[int]] | None:
    """ZeRO-1 over mirrored copies: model stage -> the pipeline ranks of its copies, in chain order
    (copy c is chain c's); None when the stages have one copy, or copies of one stage share a rank
    (then each copy shards over data parallel alone)."""
    if len(placement.chains) < 2:
        return None
    copies: dict[int, list[int]] = {}
    for chain in placement.chains:
        for stage in chain:
            copies.setdefault(placement.model_stage(stage), []).append(placement.rank_of(stage))
    if any(len(set(ranks)) < len(ranks) for ranks in copies.values()):
        return None
    return copies
