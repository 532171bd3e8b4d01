"""What ``twinpipe train`` shows while it runs (rank dp=0 pp=0 only).

On a terminal, rich's progress bar. Anywhere else (nohup, a scheduler's log file, CI) one plain line,
flushed, after the first step, every ``log_every`` steps, at least every ``log_seconds`` seconds
(at the next step's end) and after the last step: the step, the loss, tokens/s since the last line,
elapsed time, the time left at that pace, the skipped steps, and a rank persistently slower than
the others (``stragglers.slow_rank``) when there is one. A held-out evaluation (``--eval-data``)
gets a line of its own: its loss and perplexity.
"""

from __future__ import annotations

import datetime
import sys
import time
from dataclasses import dataclass

from twinpipe.train.mesh import rank_name
from twinpipe.train.report import bits_per_byte
from twinpipe.train_command.stragglers import WINDOW, slow_rank

__all__ = ["LOG_EVERY", "LOG_SECONDS", "ProgressOutput", "TrainProgress"]

LOG_EVERY = 10  # steps between two plain lines (--log-every)
LOG_SECONDS = 30.0  # at most this many seconds without a line, steps permitting


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


@dataclass(frozen=True)
class ProgressOutput:
    """Where and how often progress shows: ``show``: whether this rank shows anything; ``terminal``:
    draw the bar (None: when standard output is a terminal); else a plain line every ``log_every``
    steps and at least every ``log_seconds`` seconds."""

    show: bool = True
    terminal: bool | None = None
    log_every: int = LOG_EVERY
    log_seconds: float = LOG_SECONDS


class TrainProgress:
    """``update(step, result, rank_times, skipped)`` after every step of ``steps``; a context manager
    around the loop. ``pp``: pipeline ranks, to name a rank by its mesh coordinates."""

    def __init__(self, *, title: str, steps: range, unit: str, tokens_per_step: int, pp: int,
                 output: ProgressOutput = ProgressOutput()):
        self.title, self.start, self.total, self.unit, self.tokens, self.pp = title, steps.start, steps.stop, unit, tokens_per_step, pp
        self.show, self.log_every, self.log_seconds = output.show, output.log_every, output.log_seconds
        self.terminal = sys.stdout.isatty() if output.terminal is None else output.terminal
        self.history: list[list[float]] = []
        self._bar = self._task = None
        self._began = self._last_line = time.perf_counter()
        self._since_line = (0, 0.0)  # steps and their seconds since the last line

    def __enter__(self):
        self._began = self._last_line = time.perf_counter()
        if self.show and self.terminal:
            self._bar = _bar(self.unit)
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total, completed=self.start, loss=float("nan"), tps=0.0,
                                            skipped=0, note="")
        elif self.show:
            print(f"twinpipe train: {self.title}; steps {self.start}..{self.total}", flush=True)
        return self

    def __exit__(self, *exc):
        return self._bar.__exit__(*exc) if self._bar is not None else False

    def update(self, step: int, result, rank_times: list[float], skipped: int) -> None:
        self.history = (self.history + [rank_times])[-WINDOW:]
        if not self.show:
            return
        steps, seconds = self._since_line
        self._since_line = (steps + 1, seconds + result.times["total"])
        note = self.straggler_note()
        if self._bar is not None:
            self._bar.update(self._task, advance=1, loss=bits_per_byte(result.loss), tps=self.tokens / result.times["total"],
                             skipped=skipped, note=note)
        elif self._due(step):
            print(self.line(step, result.loss, skipped, note), flush=True)
            self._last_line, self._since_line = time.perf_counter(), (0, 0.0)

    def evaluated(self, done: int, loss: float, perplexity: float) -> None:
        """A held-out evaluation after ``done`` steps (``evaluate.py``): one line, above the bar on a terminal."""
        self.note(self.eval_line(done, loss, perplexity))

    def note(self, line: str) -> None:
        """One line of news (an evaluation, a rebalance), above the bar on a terminal."""
        if not self.show:
            return
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def eval_line(self, done: int, loss: float, perplexity: float) -> str:
        return (f"eval after step {done}/{self.total}  held-out loss {loss:.4f} nats ({bits_per_byte(loss):.3f} "
                f"bits/{self.unit})  perplexity {perplexity:.2f}")

    def _due(self, step: int) -> bool:
        done = step + 1
        return (done == self.start + 1 or done == self.total or (done - self.start) % self.log_every == 0
                or time.perf_counter() - self._last_line >= self.log_seconds)

    def line(self, step: int, loss: float, skipped: int, note: str) -> str:
        """The plain line after ``step``."""
        done, (steps, seconds) = step + 1, self._since_line
        elapsed = time.perf_counter() - self._began
        left = elapsed / (done - self.start) * (self.total - done)
        tps = self.tokens * steps / seconds if seconds > 0 else 0.0
        text = (f"step {done}/{self.total}  loss {bits_per_byte(loss):.3f} bits/{self.unit}  {tps:,.0f} tokens/s  "
                f"elapsed {_clock(elapsed)}  ETA {_clock(left)}  skipped {skipped}")
        return text + (f"  {note}" if note else "")

    def straggler_note(self) -> str:
        """``slow: rank dp=0 pp=1 1.35x the median rank (last 20 steps)``, or "" when no rank is
        (``stragglers.slow_rank``: at least 1.2x)."""
        slow = slow_rank(self.history)
        if slow is None:
            return ""
        rank, slower = slow
        return f"slow: rank {rank_name(rank, self.pp)} {slower:.2f}x the median rank (last {WINDOW} steps)"


def _bar(unit: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn(f"loss {{task.fields[loss]:.3f}} bits/{unit}"), TextColumn("{task.fields[tps]:,.0f} tokens/s"),
                    TextColumn("skipped {task.fields[skipped]}"), TimeElapsedColumn(), TextColumn("{task.fields[note]}"))
