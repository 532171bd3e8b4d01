"""A schedule resolved once: ``resolve(schedule, num_ranks, **options) -> ScheduleSpec``.

Every tool that needs a schedule's placement or its op lists (the Pipeline, the batch layout, the
trainer, the planner, the command lines) resolves what the user named once and passes the spec on,
instead of asking the registry again. ``schedule`` is a registered name (any alias or case), a
generator ``fn(num_ranks, num_microbatches, **options) -> Schedule``, a fixed ``Schedule``, or a
``ScheduleSpec`` already resolved (returned as it is). Resolving checks what the registry checks
(counts, option names); ``build(m)`` checks the size limits of ``limits.py`` before generating.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import KW_ONLY, dataclass, field, fields
from types import MappingProxyType
from typing import Callable, Mapping

from twinpipe import checks
from twinpipe.schedule import limits, registry
from twinpipe.schedule.ops import Schedule
from twinpipe.schedule.placement import Placement

__all__ = ["ScheduleSpec", "resolve"]


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule on ``num_ranks`` ranks with its ``options``: its ``placement`` now, its ops by ``build``.

    ``name`` is the registered name, ``module.qualname`` of a generator, or ``fixed schedule
    #<crc32 of its ops>``; ``source`` is what ``build`` generates from (the registered name, the
    generator or the fixed ``Schedule``); ``info`` is the registry's entry (None unless registered).
    """

    name: str
    num_ranks: int
    placement: Placement
    options: Mapping[str, object]
    _: KW_ONLY
    source: str | Callable[..., Schedule] | Schedule = field(compare=False, repr=False)
    info: registry.ScheduleInfo | None = field(default=None, compare=False, repr=False)
    # A generator's schedule built to learn its placement, reused when asked for the same size.
    _probe: Schedule | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))  # read-only

    def __hash__(self) -> int:  # options may hold lists (per-stage costs): hash what equality is sure of
        return hash((self.name, self.num_ranks))

    def __reduce__(self):  # a mappingproxy does not pickle: copy and pickle the options as a dict
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return (_from_fields, ({**values, "options": dict(self.options)},))

    @property
    def kind(self) -> str:
        """``"registered"``, ``"generator"`` or ``"fixed"``."""
        if self.info is not None:
            return "registered"
        return "fixed" if isinstance(self.source, Schedule) else "generator"

    def build(self, num_microbatches: int) -> Schedule:
        """The schedule for ``num_microbatches`` micro-batches (the registry's size limits checked first)."""
        options = dict(self.options)
        if self.info is not None:
            return registry._generate(self.info, self.num_ranks, num_microbatches, options, self.placement.num_stages)
        if isinstance(self.source, Schedule):
            if num_microbatches != self.source.num_microbatches:
                raise ValueError(f"num_chunks={num_microbatches!r}: must be {self.source.num_microbatches}, the fixed schedule's micro-batches")
            return self.source
        # A user's generator: the same size limits as a registered schedule, before it runs.
        label = getattr(self.source, "__name__", "schedule")
        limits.check_counts(label, self.num_ranks, num_microbatches)
        limits.check_size(label, self.placement.num_stages, num_microbatches)
        if self._probe is not None and self._probe.num_microbatches == num_microbatches:
            return self._probe
        return self.source(self.num_ranks, num_microbatches, **options)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The global stages pipeline ``rank`` holds (its modules, in order)."""
        checks.check_int(rank, "rank", low=0, high=self.num_ranks - 1)
        return self.placement.stages_of(rank)

    def with_options(self, **options) -> ScheduleSpec:
        """The same schedule with ``options`` added (or replaced), resolved again."""
        return resolve(self.source, self.num_ranks, **{**self.options, **options})

    def describe(self) -> str:
        """``name(option=value, ...)``: how ranks compare the schedules they built."""
        return describe(self.name, self.options)


def _from_fields(values: dict) -> ScheduleSpec:
    """``ScheduleSpec.__reduce__``'s way back: every field by name."""
    return ScheduleSpec(**values)


def describe(name: str, options: Mapping[str, object]) -> str:
    """``name(option=value, ...)``, the options sorted."""
    text = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
    return f"{name}({text})" if text else name


def name_of(schedule) -> str:
    """The name a spec of ``schedule`` gets, without resolving it (a registered name is looked up)."""
    if isinstance(schedule, ScheduleSpec):
        return schedule.name
    if isinstance(schedule, str):
        return registry.get(schedule).name
    if isinstance(schedule, Schedule):
        return f"fixed schedule #{zlib.crc32(repr(schedule.ops).encode()):08x}"
    if isinstance(schedule, functools.partial):  # its arguments are part of what it builds
        bound = [repr(a) for a in schedule.args] + [f"{k}={v!r}" for k, v in sorted(schedule.keywords.items())]
        return f"{name_of(schedule.func)}[{', '.join(bound)}]"
    # A function by its qualified name; a callable object by its class (its repr may hold an address,
    # which differs between processes).
    named = schedule if hasattr(schedule, "__qualname__") else type(schedule)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def _resolved(spec: ScheduleSpec, num_ranks, options: dict) -> ScheduleSpec:
    """``spec`` itself, if ``num_ranks`` and ``options`` (when given) agree with it."""
    if num_ranks is not None and num_ranks != spec.num_ranks:
        raise ValueError(f"num_ranks={num_ranks!r}: the schedule {spec.name} was resolved for {spec.num_ranks} ranks")
    if options and options != dict(spec.options):
        raise ValueError(f"options {describe('', options)} given with a resolved schedule {spec.describe()}: "
                         "pass them to resolve() instead")
    return spec


def resolve(schedule: str | Callable[..., Schedule] | Schedule | ScheduleSpec, num_ranks: int | None = None,
            **options) -> ScheduleSpec:
    """``schedule`` on ``num_ranks`` ranks with ``options``, resolved once (see the module docstring).

    ``num_ranks`` may be left out for a fixed ``Schedule`` or a ``ScheduleSpec`` (theirs is used).
    """
    if isinstance(schedule, ScheduleSpec):
        return _resolved(schedule, num_ranks, options)
    if isinstance(schedule, Schedule):
        if num_ranks is not None and num_ranks != schedule.num_ranks:
            raise ValueError(f"schedule is for {schedule.num_ranks} ranks but num_ranks={num_ranks!r} "
                             "(a Pipeline's is its process group's size)")
        return ScheduleSpec(name_of(schedule), schedule.num_ranks, schedule.placement, options, source=schedule)
    if isinstance(schedule, str):
        info = registry.get(schedule)
        placement = registry.placement_for(info.name, num_ranks, **options)
        return ScheduleSpec(info.name, num_ranks, placement, options, source=info.name, info=info)
    if not callable(schedule):
        raise ValueError(f"schedule={schedule!r}: must be a registered name (twinpipe.schedule_names()), "
                         "a generator fn(num_ranks, num_microbatches, **options) or a Schedule")
    label = getattr(schedule, "__name__", "schedule")
    p, m = limits.check_counts(label, num_ranks, 2 * num_ranks if isinstance(num_ranks, int) else 1)
    probe = schedule(p, m, **options)  # any valid micro-batch count shows a generator's placement
    if not isinstance(probe, Schedule):
        raise ValueError(f"schedule={label}: a generator must return a Schedule; it returned a {type(probe).__name__}")
    return ScheduleSpec(name_of(schedule), p, probe.placement, options, source=schedule, _probe=probe)
