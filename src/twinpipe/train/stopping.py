"""Stopping a run cleanly when the scheduler says so (SIGTERM; SIGINT from a terminal).

A signal reaches ranks at different moments, or only some of them, so a handler only notes it:
the training loop passes ``requested`` to ``Trainer.step(stop=...)``, whose all-reduce tells every
rank alike that some rank was asked to stop; then every rank saves the same step and exits. The
first signal also starts the grace period (``grace`` seconds, the time a scheduler waits before it
kills: SLURM's ``KillWait`` and Kubernetes' ``terminationGracePeriodSeconds`` are 30 s by default).
A second signal (``SAME_SIGNAL_S`` or more after the first: SLURM signals every process of a job,
so a rank hears the scheduler's SIGTERM both directly and as torchrun or ``twinpipe train`` passes
it on, moments apart, and that is one request), or the grace period running out, raises
``StopAbandoned`` wherever the main thread is: a save in progress removes its temporary folder as it unwinds, so the run gives up
without a torn checkpoint, the earlier checkpoints intact.

    with StopOnSignals(grace=25) as stopper:
        for step in range(start, steps):
            result = trainer.step(step, stop=stopper.requested)
            if result.stop:
                stopper.agreed()  # this rank's grace period starts now if no signal reached it
                save_checkpoint(trainer, f"ckpt-step{step + 1}", step + 1)
                break
"""

from __future__ import annotations

import signal
import threading
import time

from twinpipe.checks import check_float
from twinpipe.launch import StartupSignals

__all__ = ["STOPPED_EXIT_CODE", "StopAbandoned", "StopOnSignals"]

# sysexits.h's EX_TEMPFAIL ("try again later"): stopped by a signal with a complete checkpoint of the
# step it reached; a scheduler can requeue on it, and ``--resume auto`` continues from there.
STOPPED_EXIT_CODE = 75
SAME_SIGNAL_S = 1.0  # signals this soon after the first are the same request, passed on by another process


class StopAbandoned(BaseException):
    """A second signal, or the grace period over, while stopping: the run gives up at once. A
    ``BaseException`` (as ``KeyboardInterrupt``), so that handlers of ordinary errors let it pass."""


class StopOnSignals:
    """A context in which ``signals`` (default SIGTERM and SIGINT) ask the run to stop instead of
    ending the process; the handlers before it come back on exit. Main thread only (Python runs
    signal handlers there). ``grace``: seconds from the first signal (or ``agreed()``) until
    ``StopAbandoned``; None: no limit. A signal that a rank's ``launch.StartupSignals`` noted before
    this context (while ``run_local(forward_signals=True)`` started the rank) is the first one."""

    def __init__(self, grace: float | None = 25.0, signals=(signal.SIGTERM, signal.SIGINT)):
        if grace is not None:
            check_float(grace, "grace", low=0, low_open=True)
        self.grace, self.signals = grace, tuple(signals)
        self.signal: int | None = None  # the first signal received
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._timer_started = False

    @property
    def requested(self) -> bool:
        """Whether a signal asked this rank to stop."""
        return self.signal is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def __enter__(self) -> StopOnSignals:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopOnSignals: signal handlers can only be installed in the main thread")
        for signum in self.signals:
            previous = self._previous[signum] = signal.signal(signum, self._on_signal)
            if isinstance(previous, StartupSignals) and signum in previous.heard and self.signal is None:
                self._noted(signum, previous.heard[signum])  # it came while the rank started up
        return self

    def __exit__(self, *exc) -> bool:
        if self._timer_started:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous.pop(signal.SIGALRM))
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        return False

    def agreed(self) -> None:
        """The ranks agreed to stop: start the grace period here too if no signal started it."""
        self._start_grace()

    def _start_grace(self) -> None:
        if self._timer_started or self.grace is None:
            return
        self._timer_started = True
        self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._on_grace_over)
        left = self.grace - (time.monotonic() - self._first_at) if self.signal is not None else self.grace
        signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))  # the grace period runs from the signal

    def _noted(self, signum: int, at: float) -> None:
        """The first signal, which came at ``at`` (``time.monotonic()``): the loop acts on it after the step."""
        self.signal, self._first_at = signum, at
        self._start_grace()

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self._noted(signum, time.monotonic())
            return
        if time.monotonic() - self._first_at < SAME_SIGNAL_S:  # the same request, heard twice
            return
        raise StopAbandoned(f"a second signal ({signal.Signals(signum).name}) while stopping after "
                            f"{self.signal_name}: gave up without finishing")

    def _on_grace_over(self, signum, frame) -> None:
        raise StopAbandoned(f"the grace period of {self.grace:g} s after {self.signal_name or 'the agreed stop'} "
                            "ran out before the checkpoint was written: gave up")
