"""The one hook through which a step's memory is observed, below everything that reports to it.

A meter (``runtime/memory.py``'s ``ActivationMeter``) installs itself for the step it measures
(``observing``); the executor, the transport and the weight-gradient store report to whatever is
installed in their thread (``note``, ``note_closures``, ``sample``) without importing the meter.
With nothing installed every report is a no-op.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Protocol

import torch

__all__ = ["StepObserver", "observing", "installed", "note", "note_closures", "sample"]


class StepObserver(Protocol):
    def track(self, t) -> None:
        """Count ``t``'s storage from now until it is freed."""

    def sample(self) -> int:
        """The live total now (the observer keeps its peak)."""


_local = threading.local()


def installed() -> StepObserver | None:
    """The observer installed in this thread, if any."""
    return getattr(_local, "observer", None)


@contextmanager
def observing(observer: StepObserver):
    """Install ``observer`` in this thread while inside (the previous one is restored after)."""
    previous = installed()
    _local.observer = observer
    try:
        yield observer
    finally:
        _local.observer = previous


def sample() -> None:
    """Let the installed observer take the live total (after an op, a receive)."""
    observer = installed()
    if observer is not None:
        observer.sample()


def note(tensors) -> None:
    """Count ``tensors`` (receive buffers) in the step being observed, if any."""
    observer = installed()
    if observer is not None:
        for t in tensors:
            observer.track(t)


def note_closures(funcs) -> None:
    """Count the tensors deferred weight-gradient closures captured (kept until their W)."""
    observer = installed()
    if observer is None:
        return
    for func in funcs:
        for cell in getattr(func, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, torch.Tensor):
                observer.track(value)
