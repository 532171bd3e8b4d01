"""Every rank's step time, brought to every rank once per step (for the log and the straggler note).

A rank's time is what it spent running its own ops in the step (``StepResult.times["busy"]``), not
its wall time: the step ends in collectives every rank waits for, so wall times are alike and a slow
rank makes all of them slow; busy times show which one is. One all-gather of a small frame per
step, within the run's ``--timeout``, on a CPU (gloo) group of the whole world.
"""

from __future__ import annotations

import torch.distributed as dist

from twinpipe.runtime.collectives import cpu_group, gather_objects, release_cpu_group

__all__ = ["RankTimes"]


class RankTimes:
    """``gather(step, seconds)`` -> every rank's ``seconds``, by global rank (collective: every rank calls it)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.group = cpu_group(dist.group.WORLD, timeout)

    def gather(self, step: int, seconds: float) -> list[float]:
        return gather_objects(self.group, round(seconds, 6), self.timeout,
                              f"step {step}: gathering every rank's step time (rank {dist.get_rank()})")

    def close(self) -> None:
        """Give the CPU group back (collective; after the run's last step, not after a failure)."""
        release_cpu_group(self.group)
