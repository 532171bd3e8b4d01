"""Step agreement: before any message of a step moves, every rank states what it is about to run,
and a mismatch raises a clear error on every rank instead of silently pairing different steps.

Each rank's claim is a few named facts (which pipeline, how many rounds so far, training or
forward-only, micro-batches, schedule, message layouts, the user's ``step_id``) plus its status
(ready, rejected its own inputs, or broken by an earlier failure). Claims travel in
one fixed-size all-gather per step, started when ``step()`` begins and awaited only before the
rank's first message, so on the ranks that compute first its latency hides behind that computation.

Some facts say WHICH step a rank runs (``WHICH_STEP``): when they differ, one rank made a call the
others did not, and skipping the step on every rank would leave the ranks a call apart. Every rank
then marks the pipelines named in the claims out of step, and their ``step()`` raises at once,
without an exchange (exchanges pair the ranks' calls in order, and the ranks' calls no longer
pair), until every rank calls ``resync()``: the first exchange after the mismatch on every rank.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from twinpipe.runtime.collectives import Gathering, decode_frame, encode_frame, padded_frame
from twinpipe.runtime.errors import PipelineAbortedError, PipelineBrokenError, PipelineMismatchError, PipelineOutOfStepError

__all__ = ["Claim", "Venue", "AgreementRound", "disagreements", "short", "which_step", "out_of_step_error", "WHICH_STEP"]

FACT_CHARS = 96  # longer facts are shortened, keeping a checksum so differences still show
REASON_CHARS = 600


def short(text: str, limit: int = FACT_CHARS) -> str:
    """``text``, or its start and a checksum of the whole when it is longer than ``limit``."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 14]}… #{zlib.crc32(text.encode()):08x}"


class Claim:
    """What one rank is about to run. ``facts`` must be equal on every rank; ``status`` is
    ``"ready"``, ``"rejected"`` or ``"broken"`` with ``reason`` saying why;
    ``note`` is said beside the facts and not compared (``resync()``: the rank's step count)."""

    def __init__(self, rank: int, facts: dict[str, str], status: str = "ready", reason: str = "", note: str = ""):
        self.rank, self.facts, self.status, self.reason, self.note = rank, facts, status, reason, note

    def encode(self) -> bytes:
        facts = {k: short(str(v)) for k, v in self.facts.items()}
        reason = short(self.reason, REASON_CHARS)
        return encode_frame([facts, self.status, reason, self.note, self.rank])  # the rank last: see _same

    @classmethod
    def decode(cls, frame: bytes | torch.Tensor, what: str) -> Claim:
        said = decode_frame(frame, what)
        if not (isinstance(said, list) and len(said) == 5 and isinstance(said[0], dict)):  # another exchange's frame
            raise PipelineMismatchError(f"{what}: a rank sent something else than a claim: the ranks' exchanges on this "
                                        "process group are out of step (one rank builds a pipeline or runs another collective)")
        facts, status, reason, note, rank = said
        return cls(rank, facts, status, reason, note)


def _same(frames: list[bytes], mine: bytes) -> bool:
    """Whether every frame says what ``mine`` says but for the rank (the common case, decoded by
    no one: comparing bytes costs less than parsing every rank's claim)."""
    body = mine[: mine.rindex(b",")]
    return all(f.rstrip(b"\0").rsplit(b",", 1)[0] == body for f in frames)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def disagreements(claims: list[Claim], keys) -> list[str]:
    """``"key (rank 0: a; ranks 1, 2: b)"`` for every fact of ``keys`` the claims do not all state alike."""
    problems = []
    for key in keys:
        values: dict[str, list[int]] = {}
        for c in claims:
            values.setdefault(c.facts.get(key, "?"), []).append(c.rank)
        if len(values) > 1:
            said = "; ".join(f"{_ranks(sorted(r))}: {v}" for v, r in sorted(values.items(), key=lambda kv: min(kv[1])))
            problems.append(f"{key} ({said})")
    return problems


# Facts that say which step a rank runs: "call" (step() or resync()), then the pipeline, its
# count of steps, the user's step_id, and the mode. A rank in forward-only mode while the others
# train is what an extra evaluation step looks like, so the mode counts unless every rank gave the
# same step_id (the user then says it is one step). num_chunks and message layouts do not count:
# ranks that differ only there called step() alike with other arguments.
WHICH_STEP = ("call", "pipeline", "step", "step_id", "mode")


def which_step(claims: list[Claim]) -> list[str]:
    """The disagreements that show the ranks are not running the same step (``WHICH_STEP``)."""
    calls = disagreements(claims, ["call"])
    if calls:  # step() against resync(): their other facts mean nothing to each other
        return calls + disagreements(claims, ["pipeline"])
    ids = {c.facts.get("step_id", "none") for c in claims}
    same_id = len(ids) == 1 and ids != {"none"}
    return disagreements(claims, [k for k in WHICH_STEP if k != "call" and not (same_id and k == "mode")])


def out_of_step_error(where: str, reason: str) -> PipelineOutOfStepError:
    return PipelineOutOfStepError(
        f"{where}: this pipeline's ranks fell out of step ({reason}). No step runs until every rank calls "
        "pipe.resync() at the same point of its loop (each rank's next step() is then the same step), "
        "or builds a new pipeline."
    )


@dataclass(frozen=True)
class Venue:
    """Where a pipeline's ranks exchange claims: through ``board`` (a ``SharedBoard``, all ranks on
    one host) or else an all-gather over ``group`` (a CPU-capable group of the pipeline's ranks),
    each wait within ``timeout``. ``on_out_of_step(reason, pipelines)`` is called when the claims
    show the ranks are not on the same step, with the pipelines the claims name."""

    group: object
    board: object
    timeout: float
    on_out_of_step: Callable[[str, set], None] | None = None


class AgreementRound:
    """One step's exchange of claims at ``venue``; ``label`` names this round in an out-of-step reason."""

    def __init__(self, venue: Venue, claim: Claim, where: str, what: str = "start the step", label: str = "this step"):
        self.claim, self.where, self._on_out_of_step, self._label = claim, where, venue.on_out_of_step, label
        what = f"{where}: waiting for every rank to {what}"
        data = self._mine = claim.encode()
        board, timeout = venue.board, venue.timeout
        if board is not None:
            round_ = board.post(data)
            self._frames = lambda: board.collect(round_, timeout, what)
            self._arrived = lambda: board.arrived(round_)
        else:
            gathering = Gathering(venue.group, padded_frame(data), timeout, what)
            self._frames, self._arrived = gathering.result, gathering.done
        self.checked = False

    def arrived(self) -> bool:
        """Whether every rank's claim is in, so that ``confirm()`` will not wait."""
        return self.checked or self._arrived()

    def confirm(self) -> list[Claim] | None:
        """Wait for every rank's claim; raise if any rank disagrees, rejected the step or is broken.
        Returns every rank's claim, or None when all said what this rank said."""
        if self.checked:
            return None
        self.checked = True  # whatever happens now, this round is over for this rank
        frames = [f if isinstance(f, bytes) else f.numpy().tobytes() for f in self._frames()]
        if self.claim.status == "ready" and _same(frames, self._mine):
            return None
        claims = [Claim.decode(frame, self.where) for frame in frames]
        broken = [c for c in claims if c.status == "broken"]
        if broken:
            reasons = "; ".join(f"rank {c.rank}: {c.reason}" for c in broken)
            raise PipelineBrokenError(
                f"{self.where}: this pipeline cannot run again, an earlier step failed half-way ({reasons}). "
                "Build a new pipeline on every rank, on a new process group (gloo closes a connection whose wait timed out)."
            )
        shifted = which_step(claims)
        if shifted:
            said = ", and on ".join(shifted)
            if self._on_out_of_step is not None:
                self._on_out_of_step(f"at {self._label}: ranks disagreed on {said}", {c.facts.get("pipeline") for c in claims})
            hint = " Pass step_id= to step() to have every step's identity checked." if self.claim.facts.get("step_id") == "none" else ""
            raise PipelineMismatchError(
                f"{self.where}: ranks disagree on {said}, so they are not running the same step: one rank called "
                f"{self.claim.facts.get('call', 'step()')} when the others did not (an extra evaluation step?), or "
                "another pipeline's. Nothing was sent. Skipping this step on every rank would leave the ranks a call "
                "apart, so this pipeline runs no step until every rank calls pipe.resync() at the same point of its "
                f"loop, or builds a new pipeline.{hint}"
            )
        rejected = [c for c in claims if c.status == "rejected" and c.rank != self.claim.rank]
        if rejected and self.claim.status != "rejected":
            reasons = "; ".join(f"rank {c.rank} rejected it: {c.reason}" for c in rejected)
            raise PipelineAbortedError(f"{self.where}: step aborted on every rank before any message moved ({reasons})")
        problems = disagreements(claims, self.claim.facts)
        if problems:
            raise PipelineMismatchError(
                f"{self.where}: ranks disagree on " + ", and on ".join(problems)
                + ". Every rank must call step() the same number of times, in the same mode, with the same "
                "num_chunks, on pipelines built alike. Nothing was sent; the ranks still run the same step, so "
                "the pipeline is still usable."
            )
        return claims
