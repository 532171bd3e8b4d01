"""What a pipeline raises when ranks fail, disagree or wait too long. Every message names the rank."""

from __future__ import annotations

__all__ = [
    "PipelineError",
    "PipelineCommError",
    "PipelineTimeoutError",
    "PipelinePeerFailedError",
    "PipelineMismatchError",
    "PipelineAbortedError",
    "PipelineBrokenError",
    "PipelineOutOfStepError",
]


class PipelineError(RuntimeError):
    """The base of every error a pipeline raises when ranks fail, disagree or wait too long."""


class PipelineCommError(PipelineError):
    """A message or collective between ranks failed (for example, the peer's process died)."""


class PipelineTimeoutError(PipelineCommError):
    """A wait for a peer did not finish in time (the peer failed, hung, or never sent)."""


class PipelinePeerFailedError(PipelineCommError):
    """A wait for a peer was given up because another rank failed in the middle of its step.

    ``first`` is that rank's own account, published when it failed (``twinpipe.runtime.waits``):
    the first failure of the group, whichever rank waits."""

    def __init__(self, message: str, first: str = ""):
        super().__init__(message)
        self.first = first

    def __reduce__(self):  # keep ``first`` through pickling (errors cross process boundaries)
        return type(self), (str(self), self.first)


class PipelineMismatchError(PipelineError):
    """Ranks disagree on what they run (step, mode, schedule, micro-batches, message layouts).

    Raised on every rank of the pipeline before any message of the step moves. When the ranks
    differ only in how they run the same step (``num_chunks``, message layouts) the pipeline stays
    usable; when they run different steps (an extra ``step()`` on one rank, another ``step_id``)
    it stays out of step until every rank calls ``resync()`` (see ``PipelineOutOfStepError``)."""


class PipelineAbortedError(PipelineError):
    """Another rank rejected this step (or the pipeline's construction) before any message moved.

    The rejecting rank raises its own error; the others raise this one, naming it. The pipeline
    stays usable for the next step."""


class PipelineBrokenError(PipelineError):
    """A rank failed in the middle of an earlier step, so messages may be left half-way: this
    pipeline cannot run again. Build a new one on every rank, on a new process group: gloo closes a
    connection whose wait timed out."""


class PipelineOutOfStepError(PipelineError):
    """The ranks were found running different steps (an extra ``step()`` on one rank, another
    ``step_id``, another pipeline's step), so skipping a step would not realign them: every
    ``step()`` raises this, on every rank, until every rank calls ``pipe.resync()``. Not a
    ``PipelineMismatchError``, so that a loop that skips mismatched steps stops here."""
