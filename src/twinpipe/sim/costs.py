"""Cost model: how long each op takes and how much activation memory it holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

__all__ = ["CostModel"]

Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]


@dataclass(frozen=True)
class CostModel:
    """Op times and memory, uniform (a number) or per stage (a sequence indexed by global stage).

    ``t_b`` is the input-gradient backward only; a full backward (BW) takes ``t_b + t_w``.
    ``t_fb`` is an F overlapped with a BW (DualPipe's F&B); by default it costs the two run back to
    back, ``t_f + t_b + t_w`` (a per-stage ``t_fb`` is indexed by the forward half's stage).
    ``t_comm`` is paid on every dependency between *different* ranks; a hand-off inside one rank
    (the turn of a V) is free. Memory: F holds ``m_b``; B turns it into ``mw * m_b`` (the inputs
    W still needs); W frees that; BW frees ``m_b`` at once.
    """

    t_f: PerStage = 1.0
    t_b: PerStage = 1.0
    t_w: PerStage = 1.0
    t_fb: PerStage | None = None
    t_comm: Number = 0.0
    m_b: PerStage = 1.0
    mw: Number = 0.5

    def __post_init__(self) -> None:
        for name in ("t_f", "t_b", "t_w", "t_fb", "m_b"):
            value = getattr(self, name)
            if value is None:
                continue
            values = value if isinstance(value, (list, tuple)) else (value,)
            if not values or any(not isinstance(v, (int, float)) or v < 0 for v in values):
                raise ValueError(f"{name}={value!r}: must be a number >= 0 or a non-empty sequence of them")
        for name in ("t_comm", "mw"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}={value!r}: must be a number >= 0")

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
