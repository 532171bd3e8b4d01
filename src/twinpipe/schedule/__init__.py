"""Schedules as data (pure Python, no torch): ops, placements, generators, validation, lowering.

``resolve(schedule, num_ranks, **options)`` turns a name, a generator or a fixed ``Schedule`` into a
``ScheduleSpec`` (placement now, ``build(m)`` later): resolve once and pass the spec on.
"""

from twinpipe.schedule.spec import ScheduleSpec, resolve
from twinpipe.schedule.torch_csv import from_torch_csv

__all__ = ["ScheduleSpec", "from_torch_csv", "resolve"]
