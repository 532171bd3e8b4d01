"""Schedule names -> generators, so that every tool can ask for a schedule by name.

A generator is ``fn(num_ranks, num_microbatches, **options) -> Schedule``; its placement function
``placement(num_ranks, **options) -> Placement`` tells users which stages each rank holds before
they build anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from twinpipe.schedule.ops import Schedule
from twinpipe.schedule.placement import Placement

__all__ = ["ScheduleInfo", "register", "get", "names", "build", "placement_for", "stages_of_rank"]


@dataclass(frozen=True)
class ScheduleInfo:
    name: str
    generator: Callable[..., Schedule]
    placement: Callable[..., Placement]
    summary: str
    aliases: tuple[str, ...] = ()


_REGISTRY: dict[str, ScheduleInfo] = {}
_ALIASES: dict[str, str] = {}


def register(name: str, placement: Callable[..., Placement], summary: str, aliases: tuple[str, ...] = ()):
    """Decorator: make a generator available under ``name`` (and ``aliases``)."""

    def wrap(generator: Callable[..., Schedule]) -> Callable[..., Schedule]:
        _REGISTRY[name] = ScheduleInfo(name, generator, placement, summary, aliases)
        for alias in aliases:
            _ALIASES[alias] = name
        return generator

    return wrap


def _load_builtin() -> None:
    # Importing the generator modules registers them.
    from twinpipe.schedule import generators  # noqa: F401


def names() -> list[str]:
    """Registered schedule names (aliases not included)."""
    _load_builtin()
    return list(_REGISTRY)


def get(name: str) -> ScheduleInfo:
    _load_builtin()
    key = _ALIASES.get(name.lower(), name.lower()) if isinstance(name, str) else name
    if key not in _REGISTRY:
        allowed = ", ".join(sorted(_REGISTRY) + sorted(_ALIASES))
        raise ValueError(f"schedule={name!r} is unknown; allowed: {allowed}")
    return _REGISTRY[key]


def build(name: str, num_ranks: int, num_microbatches: int, **options) -> Schedule:
    """Generate the schedule ``name`` for ``num_ranks`` ranks and ``num_microbatches`` micro-batches."""
    return get(name).generator(num_ranks, num_microbatches, **options)


def placement_for(name: str, num_ranks: int, **options) -> Placement:
    return get(name).placement(num_ranks, **options)


def stages_of_rank(name: str, num_ranks: int, rank: int, **options) -> tuple[int, ...]:
    """Which global stages ``rank`` holds under schedule ``name`` (its modules, in order)."""
    placement = placement_for(name, num_ranks, **options)
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank={rank!r}: must lie in 0..{num_ranks - 1}")
    return placement.stages_of(rank)
