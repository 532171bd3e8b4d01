"""Schedules as data (pure Python, no torch): ops, placements, generators, validation, lowering."""

from twinpipe.schedule.torch_csv import from_torch_csv

__all__ = ["from_torch_csv"]
