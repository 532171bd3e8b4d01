"""Schedules as data (pure Python, no torch): ops, placements, generators, validation, lowering.

For: building, checking and naming schedules. ``resolve(schedule, num_ranks, **options)`` turns a
name, a generator or a fixed ``Schedule`` into a ``ScheduleSpec`` (placement now, ``build(m)``
later): resolve once and pass the spec on. ``register`` adds a schedule of your own.
"""

from twinpipe.schedule.check import ScheduleError, validate
from twinpipe.schedule.ops import Op, OpKind, Schedule
from twinpipe.schedule.registry import build, names, register, stages_of_rank
from twinpipe.schedule.spec import ScheduleSpec, resolve
from twinpipe.schedule.torch_csv import from_torch_csv

__all__ = ["Op", "OpKind", "Schedule", "ScheduleSpec", "ScheduleError", "resolve", "build", "names", "register",
           "stages_of_rank", "validate", "from_torch_csv"]
