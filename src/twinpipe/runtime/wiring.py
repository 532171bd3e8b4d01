"""What one rank's ``Executor`` and its ``Transport`` share for one step: the step's wiring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from twinpipe.runtime.comm import Layout, PointToPoint
from twinpipe.schedule.lower import RankProgram
from twinpipe.schedule.placement import Placement

__all__ = ["StepWiring"]


@dataclass(frozen=True, kw_only=True)
class StepWiring:
    """This rank's program and placement for the step, how it reaches its peers, and the agreement hooks.

    ``layouts`` (stage, micro-batch) -> discovered message layout persists across steps (the
    pipeline owns it); ``declared`` is the declared layout, if any. ``before_first_message()``
    waits for the step agreement before anything is posted; ``agreement_arrived()`` tells, without
    waiting, whether every rank's claim is in (both None on one rank)."""

    program: RankProgram
    placement: Placement
    p2p: PointToPoint
    device: torch.device
    layouts: dict
    declared: Layout | None
    timeout: float
    before_first_message: Callable[[], None] | None = None
    agreement_arrived: Callable[[], bool] | None = None
