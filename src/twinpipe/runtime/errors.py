"""What a pipeline raises when ranks fail, disagree or wait too long. Every message names the rank."""

from __future__ import annotations

__all__ = [
    "PipelineCommError",
    "PipelineTimeoutError",
    "PipelineMismatchError",
    "PipelineAbortedError",
    "PipelineBrokenError",
]


class PipelineCommError(RuntimeError):
    """A message or collective between ranks failed (for example, the peer's process died)."""


class PipelineTimeoutError(PipelineCommError):
    """A wait for a peer did not finish in time (the peer failed, hung, or never sent)."""


class PipelineMismatchError(RuntimeError):
    """Ranks disagree on what they run (step, mode, schedule, micro-batches, message layouts).

    Raised on every rank of the pipeline before any message of the step moves, so the pipeline
    stays usable once the ranks agree again."""


class PipelineAbortedError(RuntimeError):
    """Another rank rejected this step (or the pipeline's construction) before any message moved.

    The rejecting rank raises its own error; the others raise this one, naming it. The pipeline
    stays usable for the next step."""


class PipelineBrokenError(RuntimeError):
    """A rank failed in the middle of an earlier step, so messages may be left half-way: this
    pipeline cannot run again. Build a new one on every rank, on a new process group: gloo closes a
    connection whose wait timed out."""
