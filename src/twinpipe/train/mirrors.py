"""Whether the mirrored copies of every model stage (DualPipe, Chimera, BitPipe) are bitwise equal."""

from __future__ import annotations

import hashlib

import torch

from twinpipe.runtime.collectives import gather_objects
from twinpipe.runtime.pipeline import Pipeline
from twinpipe.schedule.placement import Placement

__all__ = ["mirrors_equal"]


def mirrors_equal(pipe: Pipeline, placement: Placement, pp_rank: int, group, timeout: float, where: str) -> bool:
    """Whether every copy of every model stage is bitwise equal across the pipeline: each rank's
    digests of its stages, gathered over ``group`` (a CPU group of the pipeline; collective)."""
    digests = []
    for s, module in zip(placement.stages_of(pp_rank), pipe.module):
        data = b"".join(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() for p in module.parameters())
        digests.append((placement.model_stage(s), hashlib.sha1(data).hexdigest()[:16]))
    seen: dict[int, set[str]] = {}
    for claims in gather_objects(group, digests, timeout, f"{where}: comparing mirrored copies"):
        for k, digest in claims:
            seen.setdefault(k, set()).add(digest)
    return all(len(d) == 1 for d in seen.values())
