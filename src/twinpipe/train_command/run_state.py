"""What a ``twinpipe train`` run keeps in ``--out`` as it goes, so that a failure or a preemption loses
little: checkpoints every ``--save-every`` steps or ``--save-minutes`` minutes (the older ones pruned
to ``--keep-last``), ``train-log.json`` rewritten atomically, and for ``--resume auto`` the newest
complete checkpoint there. Pure file work (no collectives): the loop in ``cli.py`` decides which rank
calls what.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from twinpipe.train.checkpoint_files import MARKER, CheckpointError, read_checkpoint_info

__all__ = ["AUTO", "FINAL", "LOG", "step_folder", "newest_checkpoint", "prune", "earlier_log",
           "SavePolicy", "TrainLog"]

AUTO = ("auto", "latest")  # --resume values: the newest complete checkpoint in --out, or a fresh start
FINAL = "checkpoint-final"
LOG = "train-log.json"
LOG_SECONDS = 10.0  # train-log.json is rewritten at least this often while steps run (and at every save)
_STEP = re.compile(r"^checkpoint-step(\d+)$")


def step_folder(out, step: int) -> Path:
    """Where the checkpoint of ``step`` (the next step to run) goes: periodic saves and a stop's save."""
    return Path(out) / f"checkpoint-step{step}"


def _checkpoint_folders(out: Path) -> list[Path]:
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.is_dir() and (p.name == FINAL or _STEP.match(p.name)))


def newest_checkpoint(out) -> tuple[str | None, int, list[str]]:
    """The complete checkpoint in ``out`` with the largest step (None and 0 when there is none) and a
    note for each folder that looks like one but cannot be loaded (torn, damaged), which is skipped."""
    best, best_step, notes = None, 0, []
    for folder in _checkpoint_folders(Path(out)):
        try:
            info = read_checkpoint_info(folder)
        except CheckpointError as error:
            notes.append(f"skipped {folder}: {error.problem}")
            continue
        if best is None or info.step > best_step or (info.step == best_step and folder.name == FINAL):
            best, best_step = str(folder), info.step
    return best, best_step, notes


def prune(out, keep: int) -> list[str]:
    """Remove all but the ``keep`` newest complete periodic checkpoints (``checkpoint-stepN``, with a
    completion marker) in ``out``; ``keep`` 0 keeps all. ``checkpoint-final`` and folders without a
    marker are never touched. The names removed."""
    if keep <= 0:
        return []
    complete = sorted((int(m[1]), p) for p in _checkpoint_folders(Path(out))
                      if (m := _STEP.match(p.name)) and (p / MARKER).is_file())
    old = [p for _, p in complete[:-keep]]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in old]


def earlier_log(out, checkpoint: str | None, start: int) -> tuple[list[dict], list[dict]]:
    """(step entries before ``start``, earlier starts) from ``out``'s ``train-log.json``, when the run
    resumes from a checkpoint in ``out`` (the one that log's run wrote); else nothing."""
    if checkpoint is None or Path(checkpoint).resolve().parent != Path(out).resolve():
        return [], []
    try:
        record = json.loads((Path(out) / LOG).read_text())
        steps = [e for e in record["steps"] if e["step"] < start]
        starts = [s for s in record.get("starts", []) if s["step"] < start]
    except (OSError, ValueError, KeyError, TypeError):  # no log, or not one of ours: the steps are not carried
        return [], []
    return steps, starts


class SavePolicy:
    """When the loop saves: after every ``every_steps`` steps, or when ``every_minutes`` have passed
    since the last save (by one rank's clock, agreed through ``Trainer.step(save=...)``); 0 turns
    either off."""

    def __init__(self, every_steps: int, every_minutes: float, clock=time.monotonic):
        self.every_steps, self.every_seconds, self.clock = every_steps, 60.0 * every_minutes, clock
        self._last = clock()

    def clock_due(self) -> bool:
        """Whether this rank's clock says a save is due (only one rank's counts)."""
        return bool(self.every_seconds) and self.clock() - self._last >= self.every_seconds

    def due(self, next_step: int, clock_agreed: bool) -> bool:
        """Whether to save before ``next_step`` (the same answer on every rank)."""
        return clock_agreed or bool(self.every_steps and next_step % self.every_steps == 0)

    def saved(self) -> None:
        self._last = self.clock()


class TrainLog:
    """``train-log.json``: ``header`` (the options, the starts) and every step's entry (the carried
    earlier ones first), rewritten atomically (a temporary file renamed over it) so that a reader,
    or a run killed mid-write, never sees half of it."""

    def __init__(self, path, header: dict, steps: list[dict] | None = None, clock=time.monotonic):
        self.path, self.header, self.steps, self.clock = Path(path), header, list(steps or []), clock
        self._written = clock()

    def add(self, entry: dict) -> None:
        self.steps.append(entry)

    def write_if_due(self, **fields) -> None:
        if self.clock() - self._written >= LOG_SECONDS:
            self.write(**fields)

    def write(self, **fields) -> None:
        """Rewrite the file: the header, ``fields`` and the steps."""
        part = self.path.with_name(f".{self.path.name}.tmp")
        try:
            part.write_text(json.dumps({**self.header, **fields, "steps": self.steps}, indent=1))
            os.replace(part, self.path)
        except BaseException:  # a signal giving up mid-write, a full disk: no half-written file left behind
            part.unlink(missing_ok=True)
            raise
        self._written = self.clock()
