"""Which part of a full batch each rank passes to ``step()``, and which micro-batches its losses are.

Micro-batch j of a full batch is ``torch.tensor_split(batch, num_chunks, dim)[j]``. A schedule's
chains (one for most schedules, two for DualPipe) take equal, contiguous runs of micro-batches,
chain 0 first. A rank passes the inputs of the chain whose first stage it holds and the labels of
the chain whose last stage it holds; the losses ``step()`` returns there are one per micro-batch
of that chain, in order.

DualPipe on P ranks with C = num_chunks / 2: rank 0 passes the inputs of micro-batches 0..C-1
(the first half of the batch) and the labels of C..2C-1 (the second half), and gets the losses of
C..2C-1; rank P-1 the other way round. DualPipeV and one-chain schedules: the rank holding the first
stage passes every input, the one holding the last stage every label and gets every loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twinpipe.checks import bad, check_int
from twinpipe.schedule.ops import Schedule
from twinpipe.schedule.placement import Placement
from twinpipe.schedule.spec import ScheduleSpec, resolve

__all__ = ["BatchLayout", "batch_layout", "microbatch_rows"]


def microbatch_rows(batch_size: int, num_chunks: int, microbatches: range) -> slice:
    """The rows of a ``batch_size`` batch that contiguous ``microbatches`` cover (as ``tensor_split``)."""
    check_int(batch_size, "batch_size", low=num_chunks, why=f"num_chunks={num_chunks}: one row per micro-batch at least")
    if not microbatches:
        return slice(0, 0)
    base, extra = divmod(batch_size, num_chunks)  # the first `extra` micro-batches have one row more

    def start(j: int) -> int:
        return j * base + min(j, extra)

    return slice(start(microbatches[0]), start(microbatches[-1] + 1))


@dataclass(frozen=True)
class BatchLayout:
    """One rank's share of a step: the micro-batches whose inputs and labels it passes.

    ``label_microbatches`` also says which micro-batches the losses (and outputs) ``step()`` returns
    on this rank belong to, in order. An empty range: this rank passes none.
    """

    rank: int
    num_chunks: int
    input_microbatches: range
    label_microbatches: range

    def inputs(self, *tensors: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, ...]:
        """This rank's rows of the full-batch ``tensors``: ``step(*layout.inputs(x), ...)``."""
        return self._rows(tensors, self.input_microbatches, dim)

    def labels(self, *tensors: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, ...]:
        """This rank's rows of the full-batch label ``tensors``: ``step(..., labels=layout.labels(y))``."""
        return self._rows(tensors, self.label_microbatches, dim)

    def _rows(self, tensors, microbatches: range, dim: int) -> tuple[torch.Tensor, ...]:
        if not microbatches:
            return ()
        picked = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"tensors[{i}] is a {type(t).__name__}; pass the full-batch tensors")
            if not -t.dim() <= dim < t.dim():
                raise ValueError(f"dim={dim!r}: tensors[{i}] has {t.dim()} dimension(s)")
            rows = microbatch_rows(t.shape[dim], self.num_chunks, microbatches)
            picked.append(t.narrow(dim, rows.start, rows.stop - rows.start))
        return tuple(picked)


def _placement(schedule, num_ranks: int, num_chunks: int, options: dict) -> Placement:
    fixed = schedule.source if isinstance(schedule, ScheduleSpec) else schedule
    if isinstance(fixed, Schedule) and (fixed.num_ranks, fixed.num_microbatches) != (num_ranks, num_chunks):
        raise ValueError(
            f"schedule is for {fixed.num_ranks} ranks and {fixed.num_microbatches} micro-batches; "
            f"asked for num_ranks={num_ranks}, num_chunks={num_chunks}"
        )
    return resolve(schedule, num_ranks, **options).placement


def _chain_ends(placement: Placement, rank: int, end: int, what: str) -> int | None:
    """The chain whose first (end=0) or last (end=-1) stage ``rank`` holds, if any."""
    mine = set(placement.stages_of(rank))
    chains = [c for c, chain in enumerate(placement.chains) if chain[end] in mine]
    if len(chains) > 1:
        raise ValueError(f"rank {rank} holds the {what} stages of chains {chains}; step() takes one {what} tuple per rank")
    return chains[0] if chains else None


def batch_layout(schedule: str | Schedule | ScheduleSpec, num_ranks: int, rank: int, num_chunks: int, **options) -> BatchLayout:
    """Which micro-batches ``rank`` passes inputs and labels for (and gets losses of) under ``schedule``.

    ``schedule`` is what ``Pipeline`` takes: a registered name (with its ``options``), a generator,
    a ``Schedule``, or a ``ScheduleSpec`` (``twinpipe.schedule.resolve``); ``rank`` is the pipeline
    rank. For any pipeline: ``batch_layout(pipe.schedule_for(n), pipe.num_ranks, pipe.rank, n)``.
    """
    check_int(num_ranks, "num_ranks", low=1)
    check_int(num_chunks, "num_chunks", low=1)
    check_int(rank, "rank", low=0, high=num_ranks - 1)
    placement = _placement(schedule, num_ranks, num_chunks, options)
    chains = len(placement.chains)
    if num_chunks % chains:
        raise bad("num_chunks", num_chunks, f"must be a multiple of {chains}, one equal share per chain of this schedule")
    empty = range(0)
    first = _chain_ends(placement, rank, 0, "first")
    last = _chain_ends(placement, rank, -1, "last")
    return BatchLayout(
        rank,
        num_chunks,
        empty if first is None else placement.microbatches_of_chain(first, num_chunks),
        empty if last is None else placement.microbatches_of_chain(last, num_chunks),
    )
