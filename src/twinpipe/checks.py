"""Argument checks for every public entry point, in one phrasing: ``name=value: must be ...``.

Pure Python (no torch), so the command line can check its options before any rank starts. The
``name`` is what the user typed: ``"--lr"`` on the command line, ``"max_norm"`` in Python; a
prefix may say where (``"chimera: num_ranks"``). ``why`` adds the reason, in parentheses.
``error`` makes the exception (a ValueError or a subclass) from the message: a module whose
errors have their own class (``EplbArgumentError``) keeps it and still speaks this phrasing.
The one default for how long any wait for a peer may take lives here too.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

__all__ = [
    "DEFAULT_TIMEOUT", "MIN_TIMEOUT", "MAX_TIMEOUT",
    "bad", "check_int", "check_ints", "check_float", "check_choice", "check_bool", "checked_timeout",
]

DEFAULT_TIMEOUT = 60.0  # seconds any wait for a peer may take, unless the user gives another limit
MIN_TIMEOUT = 1e-3  # gloo counts whole milliseconds, and reads 0 as "wait forever"
MAX_TIMEOUT = 30 * 86400.0  # a month: more does not fit the backends' timers (1e300 overflows them)

Error = Callable[[str], ValueError]


def bad(name: str, value, allowed: str, error: Error = ValueError) -> ValueError:
    """The error for ``name=value``: ``allowed`` says what it must be (``"must be >= 1"``)."""
    return error(f"{name}={value!r}: {allowed}")


def _rule(low=None, high=None, low_open: bool = False, multiple_of: int | None = None) -> str:
    """``">= 1 and <= 8 and a multiple of 4"`` (``"even"`` for 2): the bounds and the step that are given."""
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {_number(low)}")
    if high is not None:
        parts.append(f"<= {_number(high)}")
    if multiple_of == 2:
        parts.append("even")
    elif multiple_of:
        parts.append(f"a multiple of {multiple_of}")
    return " and ".join(parts)


def _number(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"  # an int in full, a float short


def _say(head: str, rule: str, why: str | None) -> str:
    return f"must be {' '.join(p for p in (head, rule) if p)}{f' ({why})' if why else ''}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # a bool is not a count


def check_int(value, name: str, *, low: int | None = None, high: int | None = None, multiple_of: int | None = None,
              why: str | None = None, error: Error = ValueError) -> int:
    """``value`` as an int within ``[low, high]`` (either may be None) and a multiple of ``multiple_of``.

    Not an int: ``name=value: must be an int >= 1``; out of range: ``name=value: must be >= 1``.
    """
    rule = _rule(low, high, multiple_of=multiple_of)
    if not _is_int(value):
        raise bad(name, value, _say("an int", rule, why), error)
    if (low is not None and value < low) or (high is not None and value > high) or (multiple_of and value % multiple_of):
        raise bad(name, value, _say("", rule, why), error)
    return value


def check_ints(values, name: str, *, low: int | None = None, high: int | None = None, length: int | None = None,
               why: str | None = None, error: Error = ValueError) -> tuple[int, ...]:
    """``values`` as a non-empty tuple of ints within ``[low, high]`` (``length`` of them, if given)."""
    rule = _rule(low, high)
    count = f"{length} " if length is not None else "a non-empty sequence of "
    allowed = _say(f"{count}int{'s' if length != 1 else ''}", rule, why)
    if isinstance(values, (str, bytes)):
        raise bad(name, values, allowed, error)
    try:
        result = tuple(values)
    except TypeError:
        raise bad(name, values, allowed, error) from None
    if not result or (length is not None and len(result) != length):
        raise bad(name, values, allowed, error)
    if not all(_is_int(v) and (low is None or v >= low) and (high is None or v <= high) for v in result):
        raise bad(name, values, allowed, error)
    return result


def check_float(value, name: str, *, low: float | None = None, high: float | None = None, low_open: bool = False,
                why: str | None = None, error: Error = ValueError) -> float:
    """``value`` as a finite float within the bounds (``low_open``: strictly above ``low``)."""
    allowed = _say("a finite number", _rule(low, high, low_open), why)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, value, allowed, error)
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        raise bad(name, value, allowed, error) from None
    if not math.isfinite(number):
        raise bad(name, value, allowed, error)
    if low is not None and (number <= low if low_open else number < low):
        raise bad(name, value, allowed, error)  # the value as given: -1, not -1.0
    if high is not None and number > high:
        raise bad(name, value, allowed, error)
    return number


def check_choice(value, name: str, allowed: Iterable, *, error: Error = ValueError):
    """``value`` if it is one of ``allowed``, else a ValueError listing them."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise bad(name, value, f"allowed are {', '.join(map(repr, allowed))}", error)
    return value


def check_bool(value, name: str, *, error: Error = ValueError) -> bool:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise bad(name, value, "must be True or False", error)
    return value


def checked_timeout(timeout, name: str = "timeout") -> float:
    """``timeout`` in seconds as a float, or a ValueError naming it."""
    return check_float(timeout, name, low=MIN_TIMEOUT, high=MAX_TIMEOUT)
