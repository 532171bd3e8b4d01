"""Asynchronous all-to-all for comm parts: CPU through the process group's async work handles,
CUDA on a side stream ordered by events.

The CUDA path is small and untested here (no GPU in the test machine): the collective is
launched on a side stream after that stream waits for the compute stream; ``wait()`` polls an event
recorded after it until the limit (the CPU then waits for the all-to-all, as it would for a CPU
one), then makes the compute stream wait for that event; ``record_stream`` keeps both buffers alive
until the side stream is done with them.

An all-to-all waits as long as the limit in force where it starts (``twinpipe.runtime.waits``):
inside ``Pipeline.step`` the pipeline's ``timeout``, else ``twinpipe.checks.DEFAULT_TIMEOUT``,
unless ``timeout=`` says otherwise; it gives up early when an EP peer publishes a failure.
"""

from __future__ import annotations

import sys
import time
import types
import warnings

import torch
import torch.distributed as dist

from twinpipe.checks import DEFAULT_TIMEOUT
from twinpipe.overlap import state
from twinpipe.overlap.parts import Done, Pending
from twinpipe.runtime import waits
from twinpipe.runtime.collectives import Collective
from twinpipe.runtime.errors import PipelineTimeoutError

__all__ = ["all_to_all", "Then", "group_size"]


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


_MOVED = ("twinpipe.overlap.comm.TIMEOUT is deprecated and sets nothing: an EP all-to-all waits as long as the pipeline's timeout= "
          "inside Pipeline.step, else twinpipe.checks.DEFAULT_TIMEOUT; pass all_to_all(..., timeout=) or run the "
          "code inside `with twinpipe.runtime.waits.limit(seconds):`")


class _Module(types.ModuleType):
    """Reading the old ``TIMEOUT`` gives the default (deprecated); setting it raises, as it no
    longer sets anything (a silently ignored setting would be worse)."""

    def __getattr__(self, name):
        if name == "TIMEOUT":
            warnings.warn(_MOVED, DeprecationWarning, stacklevel=2)
            return DEFAULT_TIMEOUT
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name == "TIMEOUT":
            raise AttributeError(_MOVED)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Module


class _Work(Pending):
    def __init__(self, started: Collective, value):
        self.started, self.value = started, value

    def wait(self):
        self.started.wait()
        return self.value


class _CudaWork(Pending):
    """A CUDA all-to-all launched on a side stream, followed by ``event``. Untested on a GPU."""

    def __init__(self, event, value, what: str, group, timeout: float):
        self.event, self.value, self.what, self.group, self.timeout = event, value, what, group, timeout

    def wait(self):
        if not waits.poll(self.event.query, time.monotonic() + self.timeout, self.what, self.group):
            raise PipelineTimeoutError(f"{self.what}: did not complete within {self.timeout:g} s")
        torch.cuda.current_stream(self.value.device).wait_event(self.event)
        return self.value


class Then(Pending):
    """``pending`` followed by ``fn`` of its result, applied on ``wait()``."""

    def __init__(self, pending: Pending, fn):
        self.pending, self.fn = pending, fn

    def wait(self):
        return self.fn(self.pending.wait())


def all_to_all(tensor: torch.Tensor, out_splits: list[int], in_splits: list[int], group, timeout: float | None = None) -> Pending:
    """Start an all-to-all of ``tensor``'s rows (``in_splits`` rows to each rank, ``out_splits``
    from each); ``wait()`` gives the received rows. With one rank it is the tensor itself.
    ``timeout``: seconds ``wait()`` may take (default: the limit in force, see the module's doc)."""
    if group_size(group) == 1:
        return Done(tensor)
    timeout = waits.timeout_for(timeout)
    waits.note(group)  # a failure of the step breaks this group too
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(out_splits), *tensor.shape[1:]))
    peers = [r for r, n in enumerate(out_splits) if n]
    what = f"EP rank {dist.get_rank(group)}: all-to-all receiving from EP ranks {peers}"
    if tensor.is_cuda:
        side = state.side_stream(tensor.device)
        side.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(side):
            dist.all_to_all_single(out, tensor, out_splits, in_splits, group=group)
            event = torch.cuda.Event()
            event.record(side)
        tensor.record_stream(side)
        out.record_stream(side)
        return _CudaWork(event, out, what, group, timeout)
    return _Work(Collective(dist.all_to_all_single, out, tensor, out_splits, in_splits, group=group, timeout=timeout, what=what), out)
