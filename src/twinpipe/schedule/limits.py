"""Size limits for schedules built by name (``registry.build``: the runtime, ``twinpipe simulate``
and ``draw``). An absurd size, such as ``num_chunks=10**5`` on 8 ranks, fails at once with a clear
error instead of allocating gigabytes or running for minutes. docs/limits.md explains the values.
"""

from __future__ import annotations

from twinpipe import checks
from twinpipe.schedule._args import check_int

__all__ = ["MAX_RANKS", "MAX_MICROBATCHES", "MAX_STAGE_MICROBATCHES", "MAX_PLANNED_STAGE_MICROBATCHES", "check_counts", "check_size"]

MAX_RANKS = 1024
MAX_MICROBATCHES = 16384
# Stages times micro-batches: each (stage, micro-batch) pair is at most three ops (F, B, W).
MAX_STAGE_MICROBATCHES = 2**17
# The same for the schedules that search or squeeze a plan (zb-auto, zbv, v-half, v-min): their
# work grows faster than the number of ops.
MAX_PLANNED_STAGE_MICROBATCHES = 2**13


def check_counts(schedule: str, num_ranks, num_microbatches) -> tuple[int, int]:
    """``(num_ranks, num_microbatches)`` as ints within the limits, else ValueError (bools are refused)."""
    p = check_int(schedule, "num_ranks", num_ranks, maximum=MAX_RANKS)
    m = check_int(schedule, "num_microbatches", num_microbatches, maximum=MAX_MICROBATCHES)
    return p, m


def check_size(schedule: str, num_stages: int, num_microbatches: int, maximum: int = MAX_STAGE_MICROBATCHES) -> None:
    """Refuse a schedule of more than ``maximum`` (stage, micro-batch) pairs."""
    pairs = num_stages * num_microbatches
    if pairs > maximum:
        raise checks.bad(
            f"{schedule}: num_microbatches", num_microbatches,
            f"must be <= {maximum // num_stages} on {num_stages} stages ({num_stages} stages x num_microbatches={num_microbatches} "
            f"= {pairs} (stage, micro-batch) pairs; at most {maximum}, see docs/limits.md)",
        )
