"""The generators' argument checks: ``twinpipe.checks`` with the schedule's name in front
(``chimera: num_ranks=3: must be >= 2 and a multiple of 2``)."""

from __future__ import annotations

from typing import Sequence

from twinpipe import checks

__all__ = ["check_int", "per_stage", "check_number"]


def check_int(schedule: str, name: str, value, minimum: int = 1, multiple_of: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int >= ``minimum`` (<= ``maximum``, a multiple of ``multiple_of``), else ValueError.

    A bool is not a count: ``True`` is refused.
    """
    why = "see docs/limits.md" if maximum is not None else None
    return checks.check_int(value, f"{schedule}: {name}", low=minimum, high=maximum, multiple_of=multiple_of, why=why)


def check_number(schedule: str, name: str, value, minimum: float = 0.0, strict: bool = False) -> float:
    """``value`` as a finite float >= ``minimum`` (> if ``strict``), else ValueError."""
    return checks.check_float(value, f"{schedule}: {name}", low=minimum, low_open=strict)


def per_stage(schedule: str, name: str, value, num_stages: int, strict: bool = False) -> list[float]:
    """A number or one number per stage, as a list of ``num_stages`` floats."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != num_stages:
            raise checks.bad(f"{schedule}: {name}", value, f"must be one number or {num_stages} (one per stage)")
        return [check_number(schedule, f"{name}[{i}]", v, strict=strict) for i, v in enumerate(value)]
    return [check_number(schedule, name, value, strict=strict)] * num_stages
