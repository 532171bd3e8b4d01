"""The schedules weighed at a memory budget, and how the planner gets each one's placement and ops.

A candidate is a registered schedule with options; two of them are about hiding the expert
all-to-all: ``overlap`` (a forward paired with another micro-batch's backward as one F&B op) and
``warmup_extra`` (k more warm-up forwards on every rank before its first backward, Kimi K2's way of
making room for those pairs). DualPipe and DualPipeV have F&B ops built in. The schedule layer
builds both options itself (``schedule/fb_pairing.py``, docs/schedules.md); the planner passes
them through as it passes any other option.
"""

from __future__ import annotations

from twinpipe import checks
from twinpipe.schedule import registry
from twinpipe.schedule.ops import Schedule
from twinpipe.schedule.spec import ScheduleSpec, resolve

__all__ = ["OVERLAP_OPTIONS", "decision_candidates", "spec_of", "build"]

OVERLAP_OPTIONS = registry.FB_OPTIONS


def decision_candidates(max_warmup_extra: int = 2) -> list[tuple[str, dict]]:
    """(schedule, options) rows of the memory-budget question: DualPipe, DualPipeV, interleaved 1F1B
    and ZB-V, each without overlap and with it at k = 0..``max_warmup_extra`` extra warm-up micro-batches."""
    checks.check_int(max_warmup_extra, "max_warmup_extra", low=0)
    return [("dualpipe", {}), ("dualpipev", {}), ("interleaved-1f1b", {}),
            *(("interleaved-1f1b", {"overlap": True, "warmup_extra": k}) for k in range(max_warmup_extra + 1)),
            ("zbv", {}), *(("zbv", {"overlap": True, "warmup_extra": k}) for k in range(max_warmup_extra + 1))]


def spec_of(name: str, p: int, options: dict | None = None) -> ScheduleSpec:
    """The resolved schedule (its placement) of a candidate."""
    return resolve(name, p, **(options or {}))


def build(name: str, p: int, m: int, options: dict | None = None) -> Schedule:
    """The candidate's ops at ``m`` micro-batches."""
    return registry.build(name, p, m, **(options or {}))
