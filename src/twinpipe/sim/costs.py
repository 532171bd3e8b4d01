"""Costs scaled to a placement (``for_model``, ``stage_sizes``). The cost model itself and the
rules of what each op costs live in ``twinpipe.schedule.costs`` (re-exported here)."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from twinpipe import checks
from twinpipe.schedule.costs import PER_STAGE, CostModel, check_cost
from twinpipe.schedule.placement import Placement

__all__ = ["CostModel", "check_cost", "stage_sizes", "for_model"]


def stage_sizes(placement: Placement) -> list[Fraction]:
    """Each stage's share of the model, in units of a 1F1B stage (1/p of the model).

    Every chain carries one whole copy of the model, so a stage of a chain of L stages is p/L of
    a 1F1B stage: 1 on a linear placement and for DualPipe's two full-size copies, 1/2 on a V,
    1/v when interleaving v stages per rank.
    """
    sizes = [Fraction(0)] * placement.num_stages
    for chain in placement.chains:
        for stage in chain:
            sizes[stage] = Fraction(placement.num_ranks, len(chain))
    return sizes


def for_model(costs: CostModel, placement: Placement) -> CostModel:
    """``costs`` of one 1F1B stage, as the per-stage costs of ``placement``'s stages for the same model.

    Times and activation memory scale with each stage's share (``stage_sizes``); ``t_comm`` (one
    message between stages) and ``mw`` (a ratio) do not. So schedules compare on one model.
    """
    sizes = stage_sizes(placement)
    scaled = {}
    for name in PER_STAGE:
        value = getattr(costs, name)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            raise checks.bad(name, value, "must be one number (the time of a 1F1B stage), not one per stage, to scale to a model")
        scaled[name] = [float(value * size) for size in sizes] if len(set(sizes)) > 1 else float(value * sizes[0])
    return replace(costs, **scaled)
