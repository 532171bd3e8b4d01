"""Step agreement: before any message of a step moves, every rank states what it is about to run,
and a mismatch raises a clear error on every rank instead of silently pairing different steps.

Each rank's claim is a few named facts (which pipeline, how many rounds so far, training or
forward-only, micro-batches, schedule, message layouts) plus its status (ready, rejected its own
inputs, or broken by an earlier failure). Claims travel in one fixed-size all-gather per step,
started when ``step()`` begins and awaited only before the rank's first message, so on the ranks
that compute first its latency hides behind that computation.
"""

from __future__ import annotations

import zlib

import torch

from twinpipe.runtime.collectives import Gathering, decode_frame, encode_frame, padded_frame
from twinpipe.runtime.errors import PipelineAbortedError, PipelineBrokenError, PipelineMismatchError

__all__ = ["Claim", "AgreementRound", "disagreements", "short"]

FACT_CHARS = 96  # longer facts are shortened, keeping a checksum so differences still show
REASON_CHARS = 600


def short(text: str, limit: int = FACT_CHARS) -> str:
    """``text``, or its start and a checksum of the whole when it is longer than ``limit``."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 14]}… #{zlib.crc32(text.encode()):08x}"


class Claim:
    """What one rank is about to run. ``facts`` must be equal on every rank; ``status`` is
    ``"ready"``, ``"rejected"`` or ``"broken"`` with ``reason`` saying why."""

    def __init__(self, rank: int, facts: dict[str, str], status: str = "ready", reason: str = ""):
        self.rank, self.facts, self.status, self.reason = rank, facts, status, reason

    def encode(self) -> bytes:
        facts = {k: short(str(v)) for k, v in self.facts.items()}
        reason = short(self.reason, REASON_CHARS)
        return encode_frame([facts, self.status, reason, self.rank])  # the rank last: see _same

    @classmethod
    def decode(cls, frame: bytes | torch.Tensor, what: str) -> Claim:
        facts, status, reason, rank = decode_frame(frame, what)
        return cls(rank, facts, status, reason)


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


class AgreementRound:
    """One step's exchange of claims: through ``board`` (a ``SharedBoard``, all ranks on one host)
    or else an all-gather over ``group`` (a CPU-capable group of the pipeline's ranks)."""

    def __init__(self, group, board, claim: Claim, timeout: float, where: str):
        self.claim, self.where = claim, where
        what = f"{where}: waiting for every rank to start the step"
        data = self._mine = claim.encode()
        if board is not None:
            round_ = board.post(data)
            self._frames = lambda: board.collect(round_, timeout, what)
            self._arrived = lambda: board.arrived(round_)
        else:
            gathering = Gathering(group, padded_frame(data), timeout, what)
            self._frames, self._arrived = gathering.result, gathering.done
        self.checked = False

    def arrived(self) -> bool:
        """Whether every rank's claim is in, so that ``confirm()`` will not wait."""
        return self.checked or self._arrived()

    def confirm(self) -> None:
        """Wait for every rank's claim; raise if any rank disagrees, rejected the step or is broken."""
        if self.checked:
            return
        self.checked = True  # whatever happens now, this round is over for this rank
        frames = [f if isinstance(f, bytes) else f.numpy().tobytes() for f in self._frames()]
        if self.claim.status == "ready" and _same(frames, self._mine):
            return
        claims = [Claim.decode(frame, self.where) for frame in frames]
        broken = [c for c in claims if c.status == "broken"]
        if broken:
            reasons = "; ".join(f"rank {c.rank}: {c.reason}" for c in broken)
            raise PipelineBrokenError(
                f"{self.where}: this pipeline cannot run again, an earlier step failed half-way ({reasons}). "
                "Build a new pipeline on every rank, on a new process group (gloo closes a connection whose wait timed out)."
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
                "num_chunks, on pipelines built alike. Nothing was sent; the pipeline is still usable."
            )
