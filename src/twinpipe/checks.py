"""Argument checks for every public entry point, in one phrasing: ``name=value: must be ...``.

Pure Python (no torch), so the command line can check its options before any rank starts. The
``name`` is what the user typed: ``"--lr"`` on the command line, ``"max_norm"`` in Python.
The one default for how long any wait for a peer may take lives here too.
"""

from __future__ import annotations

import math
from typing import Iterable

__all__ = [
    "DEFAULT_TIMEOUT", "MIN_TIMEOUT", "MAX_TIMEOUT",
    "bad", "check_int", "check_float", "check_choice", "check_bool", "checked_timeout",
]

DEFAULT_TIMEOUT = 60.0  # seconds any wait for a peer may take, unless the user gives another limit
MIN_TIMEOUT = 1e-3  # gloo counts whole milliseconds, and reads 0 as "wait forever"
MAX_TIMEOUT = 30 * 86400.0  # a month: more does not fit the backends' timers (1e300 overflows them)


def bad(name: str, value, allowed: str) -> ValueError:
    """The error for ``name=value``: ``allowed`` says what it must be (``"must be >= 1"``)."""
    return ValueError(f"{name}={value!r}: {allowed}")


def _bounds(low, high, low_open: bool = False) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"<= {high:g}")
    return " and ".join(parts)


def check_int(value, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int within ``[low, high]`` (either bound may be None), or a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, value, f"must be an int{' ' + _bounds(low, high) if low is not None or high is not None else ''}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad(name, value, f"must be {_bounds(low, high)}")
    return value


def check_float(value, name: str, *, low: float | None = None, high: float | None = None, low_open: bool = False) -> float:
    """``value`` as a finite float within the bounds (``low_open``: strictly above ``low``)."""
    bounds = _bounds(low, high, low_open)
    allowed = f"must be a finite number{' ' + bounds if bounds else ''}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, value, allowed)
    value = float(value)
    if not math.isfinite(value):
        raise bad(name, value, allowed)
    if low is not None and (value <= low if low_open else value < low):
        raise bad(name, value, allowed)
    if high is not None and value > high:
        raise bad(name, value, allowed)
    return value


def check_choice(value, name: str, allowed: Iterable):
    """``value`` if it is one of ``allowed``, else a ValueError listing them."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise bad(name, value, f"allowed are {', '.join(map(repr, allowed))}")
    return value


def check_bool(value, name: str) -> bool:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise bad(name, value, "must be True or False")
    return value


def checked_timeout(timeout, name: str = "timeout") -> float:
    """``timeout`` in seconds as a float, or a ValueError naming it."""
    return check_float(timeout, name, low=MIN_TIMEOUT, high=MAX_TIMEOUT)
