"""Cost model: how long each op takes and how much activation memory it holds."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Sequence, Union

from twinpipe.schedule.placement import Placement

__all__ = ["CostModel", "check_cost", "stage_sizes", "for_model"]

Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]


def check_cost(name: str, value) -> float:
    """``value`` as a finite float >= 0, else ValueError naming ``name`` (a bool is not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r}: must be a finite number >= 0")
    return float(value)


@dataclass(frozen=True)
class CostModel:
    """Op times and memory, uniform (a number) or per stage (a sequence indexed by global stage).

    ``t_b`` is the input-gradient backward only; a full backward (BW) takes ``t_b + t_w``.
    ``t_fb`` is an F overlapped with a BW (DualPipe's F&B); by default it costs the two run back to
    back, ``t_f + t_b + t_w`` (a per-stage ``t_fb`` is indexed by the forward half's stage).
    ``t_comm`` is paid on every dependency between *different* ranks; a hand-off inside one rank
    (the turn of a V) is free. Memory: F holds ``m_b``; B turns it into ``mw * m_b`` (the inputs
    W still needs); W frees that; BW frees ``m_b`` at once. Every value is finite and >= 0.

    ``cores``: how many ranks can compute at full speed at once (None: every rank has its own
    processor). A CPU run with more ranks than cores shares them: while k > ``cores`` ranks
    compute, each runs at ``cores / k`` of its speed (op times are the times of an op alone).
    """

    t_f: PerStage = 1.0
    t_b: PerStage = 1.0
    t_w: PerStage = 1.0
    t_fb: PerStage | None = None
    t_comm: Number = 0.0
    m_b: PerStage = 1.0
    mw: Number = 0.5
    cores: int | None = None

    def __post_init__(self) -> None:
        if self.cores is not None and (isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1):
            raise ValueError(f"cores={self.cores!r}: must be an integer >= 1, or None (every rank its own processor)")
        for name in _PER_STAGE:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, (list, tuple)):
                if not value:
                    raise ValueError(f"{name}={value!r}: must be a finite number >= 0 or a non-empty sequence of them")
                for i, v in enumerate(value):
                    check_cost(f"{name}[{i}]", v)
            else:
                check_cost(name, value)
        for name in ("t_comm", "mw"):
            check_cost(name, getattr(self, name))

    def per_stage(self, num_stages: int) -> dict[str, list[float]]:
        """Every per-stage quantity as a list of ``num_stages`` floats (``t_fb`` filled in)."""
        out = {name: self._expand(name, getattr(self, name), num_stages) for name in ("t_f", "t_b", "t_w", "m_b")}
        if self.t_fb is not None:
            out["t_fb"] = self._expand("t_fb", self.t_fb, num_stages)
        return out

    @staticmethod
    def _expand(name: str, value: PerStage, num_stages: int) -> list[float]:
        if isinstance(value, (list, tuple)):
            if len(value) != num_stages:
                raise ValueError(f"{name} has {len(value)} entries; the schedule has {num_stages} stages (give one per stage or a single number)")
            return [float(v) for v in value]
        return [float(value)] * num_stages


_PER_STAGE = ("t_f", "t_b", "t_w", "t_fb", "m_b")  # what grows with a stage's share of the model


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
    for name in _PER_STAGE:
        value = getattr(costs, name)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            raise ValueError(f"{name}={value!r}: scaling to a model needs one number per cost (the time of a 1F1B stage), not one per stage")
        scaled[name] = [float(value * size) for size in sizes] if len(set(sizes)) > 1 else float(value * sizes[0])
    return replace(costs, **scaled)
