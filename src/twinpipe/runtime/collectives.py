"""Collectives with deadlines: every wait names rank, operation and peer, and none waits longer
than the pipeline's ``timeout`` (the process group's own default is 30 minutes)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from twinpipe.checks import MIN_TIMEOUT, checked_timeout  # noqa: F401  (re-exported: older imports)
from twinpipe.runtime import comm
from twinpipe.runtime.errors import PipelineMismatchError

__all__ = ["checked_timeout", "Gathering", "encode_frame", "padded_frame", "decode_frame", "gather_objects", "barrier", "cpu_group"]


class Gathering:
    """An all-gather of one int or byte tensor per rank, started now and awaited with ``result()``."""

    def __init__(self, group, tensor: torch.Tensor, timeout: float, what: str):
        self.group, self.timeout, self.what = group, timeout, what
        size = dist.get_world_size(group)
        self.parts = [torch.empty_like(tensor) for _ in range(size)]
        self.work = dist.all_gather(self.parts, tensor, group=group, async_op=True) if size > 1 else None
        if self.work is None:
            self.parts = [tensor]

    def done(self) -> bool:
        """Whether the all-gather has finished (does not wait)."""
        return self.work is None or self.work.is_completed()

    def result(self) -> list[torch.Tensor]:
        if self.work is not None:
            comm.wait_work(self.work, self.timeout, self.what)
            self.work = None
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


def cpu_group(group, timeout: float):
    """``group`` when it carries CPU tensors (gloo), else a gloo group of the same ranks.

    Agreement messages are a few hundred bytes read on the CPU: on an NCCL-only group they would
    cost a device round trip and a stream synchronisation every step."""
    try:
        group._get_backend(torch.device("cpu"))
        return group
    except Exception:  # no CPU backend on this group (NCCL only)
        pass
    import datetime

    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout), backend="gloo", use_local_synchronization=True)
