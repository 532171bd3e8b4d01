"""Collectives with deadlines: every wait names rank, operation and peer, none waits longer than
the pipeline's ``timeout`` (the process group's own default is 30 minutes), and each gives up early
when another rank publishes a failure that breaks it (``twinpipe.runtime.waits``)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from twinpipe.checks import MIN_TIMEOUT, checked_timeout  # noqa: F401  (re-exported: older imports)
from twinpipe.runtime import comm
from twinpipe.runtime.errors import PipelineMismatchError

__all__ = ["checked_timeout", "Collective", "collective", "Gathering", "encode_frame", "padded_frame", "decode_frame", "gather_objects", "barrier", "cpu_group",
           "release_cpu_group"]


class Collective:
    """``op`` (a ``torch.distributed`` collective such as ``dist.all_reduce``) over ``group``,
    started now and awaited by ``wait()`` within ``timeout`` seconds: the one way twinpipe runs a
    collective within the user's limit. ``wait()`` raises PipelineTimeoutError naming ``what`` at
    the limit, PipelinePeerFailedError at a peer's published failure, PipelineCommError when the
    collective fails; a late peer is waited for (``comm.wait_work``). ``group`` None: the default group."""

    def __init__(self, op, *args, group, timeout: float, what: str = "", **kwargs):
        self.group = group if group is not None else dist.group.WORLD
        self.timeout, self.what = timeout, what
        self.work = op(*args, group=self.group, async_op=True, **kwargs)

    def done(self) -> bool:
        """Whether the collective has finished (does not wait)."""
        return self.work is None or self.work.is_completed()

    def wait(self, what: str | None = None) -> None:
        """Wait for it (once; later calls return at once). ``what``: the wait's name when it is
        known only now (else the one given at the start)."""
        if self.work is not None:
            work, self.work = self.work, None
            comm.wait_work(work, self.timeout, self.what if what is None else what, self.group)


def collective(op, *args, group, timeout: float, what: str, **kwargs) -> None:
    """Run ``op`` over ``group`` and wait for it within ``timeout`` seconds (``Collective``)."""
    Collective(op, *args, group=group, timeout=timeout, what=what, **kwargs).wait()


class Gathering:
    """An all-gather of one int or byte tensor per rank, started now and awaited with ``result()``."""

    def __init__(self, group, tensor: torch.Tensor, timeout: float, what: str):
        size = dist.get_world_size(group)
        self.parts = [torch.empty_like(tensor) for _ in range(size)]
        self.started = (Collective(dist.all_gather, self.parts, tensor, group=group, timeout=timeout, what=what)
                        if size > 1 else None)
        if self.started is None:
            self.parts = [tensor]

    def done(self) -> bool:
        """Whether the all-gather has finished (does not wait)."""
        return self.started is None or self.started.done()

    def result(self) -> list[torch.Tensor]:
        if self.started is not None:
            self.started.wait()
        return self.parts


FRAME_BYTES = 2048


def encode_frame(obj) -> bytes:
    """``obj`` (JSON-able) as the bytes of one frame (at most ``FRAME_BYTES``).

    Every collective twinpipe runs on a group moves frames padded to this one size, so ranks that
    fall out of step pair frames that fail to decode (a clear error) instead of buffers of
    different sizes (which gloo answers by aborting the process)."""
    data = json.dumps(obj).encode()
    if len(data) > FRAME_BYTES:
        raise ValueError(f"a {len(data)}-byte agreement message exceeds the {FRAME_BYTES}-byte frame")
    return data


def padded_frame(data: bytes) -> torch.Tensor:
    """A frame's bytes as the fixed-size tensor a collective moves."""
    frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    frame[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return frame


def decode_frame(frame: bytes | torch.Tensor, what: str):
    data = frame.numpy().tobytes() if isinstance(frame, torch.Tensor) else frame
    try:
        return json.loads(data.rstrip(b"\0").decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise PipelineMismatchError(
            f"{what}: a rank sent something else than this exchange expects, so the ranks' collectives on "
            "this process group are out of step (one rank called step() or built a pipeline that the others did not)"
        ) from None


def gather_objects(group, obj, timeout: float, what: str) -> list:
    """Every rank's JSON-able ``obj`` (tuples come back as lists), in group-rank order; bounded by ``timeout``."""
    return [decode_frame(f, what) for f in Gathering(group, padded_frame(encode_frame(obj)), timeout, what).result()]


def barrier(group, timeout: float, what: str) -> None:
    """Wait until every rank of ``group`` arrives, or raise after ``timeout``."""
    gather_objects(group, None, timeout, what)


_CPU_GROUPS: dict = {}  # (ranks, timeout) -> [gloo group, pipelines using it]


def cpu_group(group, timeout: float):
    """``group`` when it carries CPU tensors (gloo), else a gloo group of the same ranks.

    Agreement messages are a few hundred bytes read on the CPU: on an NCCL-only group they would
    cost a device round trip and a stream synchronisation every step. The gloo group is made once
    per set of ranks (and timeout: gloo's own timer) and shared: every caller must give it back
    with ``release_cpu_group`` (``Pipeline.close()`` does), and the last one destroys it. Made
    and released collectively: every rank of ``group`` calls both alike."""
    try:
        group._get_backend(torch.device("cpu"))
        return group
    except Exception:  # no CPU backend on this group (NCCL only)
        pass
    import datetime

    key = (tuple(dist.get_process_group_ranks(group)), float(timeout))
    entry = _CPU_GROUPS.get(key)
    if entry is None:
        made = dist.new_group(list(key[0]), timeout=datetime.timedelta(seconds=timeout), backend="gloo",
                              use_local_synchronization=True)
        entry = _CPU_GROUPS[key] = [made, 0]
    entry[1] += 1
    return entry[0]


def release_cpu_group(group) -> None:
    """Give back a group ``cpu_group`` returned; the last user of a gloo group it made destroys it
    (a group it did not make, the caller's own, is left alone)."""
    for key, entry in list(_CPU_GROUPS.items()):
        if entry[0] is group:
            entry[1] -= 1
            if entry[1] <= 0:
                del _CPU_GROUPS[key]
                dist.destroy_process_group(group)
            return
