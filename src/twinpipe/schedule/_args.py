"""Argument checks shared by the generators: errors name the argument, the value and what is allowed."""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["check_int", "per_stage", "check_number"]


def check_int(schedule: str, name: str, value, minimum: int = 1, multiple_of: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int >= ``minimum`` (<= ``maximum``, a multiple of ``multiple_of``), else ValueError.

    A bool is not a count: ``True`` is refused.
    """
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    if ok and multiple_of and value % multiple_of:
        ok = False
    if ok and maximum is not None and value > maximum:
        ok = False
    if not ok:
        allowed = f"an integer >= {minimum}" + (f" and a multiple of {multiple_of}" if multiple_of else "")
        allowed += f" and <= {maximum} (see docs/limits.md)" if maximum is not None else ""
        raise ValueError(f"{schedule}: {name}={value!r} is not allowed; it must be {allowed}")
    return value


def check_number(schedule: str, name: str, value, minimum: float = 0.0, strict: bool = False) -> float:
    """``value`` as a finite float >= ``minimum`` (> if ``strict``), else ValueError."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > minimum if strict else value >= minimum)
    if not ok:
        raise ValueError(f"{schedule}: {name}={value!r} is not allowed; it must be a finite number {'>' if strict else '>='} {minimum:g}")
    return float(value)


def per_stage(schedule: str, name: str, value, num_stages: int, strict: bool = False) -> list[float]:
    """A number or one number per stage, as a list of ``num_stages`` floats."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != num_stages:
            raise ValueError(f"{schedule}: {name} has {len(value)} entries; it must be one number or {num_stages} (one per stage)")
        return [check_number(schedule, name, v, strict=strict) for v in value]
    return [check_number(schedule, name, value, strict=strict)] * num_stages
