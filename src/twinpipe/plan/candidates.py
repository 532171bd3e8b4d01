"""The schedules weighed at a memory budget, and how the planner gets each one's placement and ops.

A candidate is a registered schedule with options; two of them are about hiding the expert
all-to-all: ``overlap`` (a forward paired with another micro-batch's backward as one F&B op) and
``warmup_extra`` (k more warm-up forwards on every rank before its first backward, Kimi K2's way of
making room for those pairs). DualPipe and DualPipeV have F&B ops built in.

The schedule layer is to build those options itself (``resolve(name, p, overlap=True,
warmup_extra=k)``); until it does, the planner derives them from the plain schedule
(``plan.paired``). ``schedule_layer_overlaps`` is the one switch between the two.
"""

from __future__ import annotations

from functools import lru_cache

from twinpipe import checks
from twinpipe.plan.paired import lead_warmup, pair_steady
from twinpipe.schedule import registry
from twinpipe.schedule.ops import Schedule
from twinpipe.schedule.spec import ScheduleSpec, resolve

__all__ = ["OVERLAP_OPTIONS", "decision_candidates", "schedule_layer_overlaps", "spec_of", "build"]

OVERLAP_OPTIONS = ("overlap", "warmup_extra")
_PLANNER_BUILDS = ("interleaved-1f1b", "zbv")  # the stand-in's schedules; warm-up lead only on interleaved's loop
_PROBE_RANKS = 4


def decision_candidates(max_warmup_extra: int = 2) -> list[tuple[str, dict]]:
    """(schedule, options) rows of the memory-budget question: DualPipe, DualPipeV, interleaved 1F1B
    without overlap and with it at k = 0..``max_warmup_extra`` extra warm-up micro-batches, ZB-V without and with."""
    checks.check_int(max_warmup_extra, "max_warmup_extra", low=0)
    return [("dualpipe", {}), ("dualpipev", {}), ("interleaved-1f1b", {}),
            *(("interleaved-1f1b", {"overlap": True, "warmup_extra": k}) for k in range(max_warmup_extra + 1)),
            ("zbv", {}), ("zbv", {"overlap": True})]


_NEUTRAL = {"overlap": False, "warmup_extra": 0}


@lru_cache(maxsize=None)
def schedule_layer_overlaps(name: str, options: tuple[str, ...] = ("overlap",)) -> bool:
    """THE SWITCH: whether the schedule layer builds ``name`` with these ``OVERLAP_OPTIONS`` itself.

    Feature-tested: ``resolve`` is asked for their neutral values (no overlap, no extra warm-up);
    once it accepts them (issue 32 item 1), the planner passes the options through and
    ``plan.paired`` is no longer used for ``name`` with them.
    """
    try:
        resolve(name, _PROBE_RANKS, **{k: _NEUTRAL[k] for k in options})
    except (TypeError, ValueError):
        return False
    return True


def _split(name: str, options: dict) -> tuple[dict, dict]:
    """(the schedule's own options, the overlap options the planner applies itself)."""
    options = dict(options or {})
    mine = {k: options.pop(k) for k in OVERLAP_OPTIONS if k in options}
    if not mine or schedule_layer_overlaps(name, tuple(sorted(mine))):
        return {**options, **mine}, {}
    canonical = registry.get(name).name
    if canonical not in _PLANNER_BUILDS:
        raise ValueError(f"schedule {canonical!r} with {mine}: until the schedule layer builds overlapped schedules, the planner "
                         f"builds them for {', '.join(_PLANNER_BUILDS)} only")
    checks.check_bool(mine.get("overlap", False), "overlap")
    extra = checks.check_int(mine.get("warmup_extra", 0), "warmup_extra", low=0)
    if extra and canonical != "interleaved-1f1b":
        raise checks.bad("warmup_extra", extra, "must be 0 for ZB-V (its V turn fixes each rank's warm-up)")
    return options, mine


def spec_of(name: str, p: int, options: dict | None = None) -> ScheduleSpec:
    """The resolved schedule (its placement) of a candidate; the overlap options do not change the placement."""
    own, _ = _split(name, options or {})
    return resolve(name, p, **own)


def build(name: str, p: int, m: int, options: dict | None = None) -> tuple[Schedule, bool]:
    """The candidate's ops at ``m`` micro-batches, and whether the planner derived them (then unvalidated)."""
    own, mine = _split(name, options or {})
    schedule = registry.build(name, p, m, **own)
    if not mine:
        return schedule, False
    schedule = lead_warmup(schedule, mine.get("warmup_extra", 0))
    return (pair_steady(schedule) if mine.get("overlap", False) else schedule), True
