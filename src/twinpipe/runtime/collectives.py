"""Collectives with deadlines: every wait names rank, operation and peer, and none waits longer
than the pipeline's ``timeout`` (the process group's own default is 30 minutes)."""

from __future__ import annotations

import math
import pickle

import torch
import torch.distributed as dist

from twinpipe.runtime import comm

__all__ = ["checked_timeout", "Gathering", "gather_objects", "barrier", "cpu_group"]

MIN_TIMEOUT = 1e-3  # gloo counts whole milliseconds, and reads 0 as "wait forever"


def checked_timeout(timeout, name: str = "timeout") -> float:
    """``timeout`` in seconds as a float, or a ValueError naming it."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"{name}={timeout!r}: must be a number of seconds (int or float)")
    if not math.isfinite(timeout) or timeout < MIN_TIMEOUT:
        raise ValueError(f"{name}={timeout!r}: must be finite and at least {MIN_TIMEOUT:g} s")
    return float(timeout)


class Gathering:
    """An all-gather of one int or byte tensor per rank, started now and awaited with ``result()``."""

    def __init__(self, group, tensor: torch.Tensor, timeout: float, what: str):
        self.group, self.timeout, self.what = group, timeout, what
        size = dist.get_world_size(group)
        self.parts = [torch.empty_like(tensor) for _ in range(size)]
        self.work = dist.all_gather(self.parts, tensor, group=group, async_op=True) if size > 1 else None
        if self.work is None:
            self.parts = [tensor]

    def result(self) -> list[torch.Tensor]:
        if self.work is not None:
            comm.wait_work(self.work, self.timeout, self.what)
            self.work = None
        return self.parts


def gather_objects(group, obj, timeout: float, what: str) -> list:
    """Every rank's picklable ``obj``, in group-rank order; bounded by ``timeout``."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = Gathering(group, torch.tensor([data.numel()], dtype=torch.int64), timeout, what).result()
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = Gathering(group, padded, timeout, what).result()
    return [pickle.loads(bytes(p[: int(n)].tolist())) for p, n in zip(parts, sizes)]


def barrier(group, timeout: float, what: str) -> None:
    """Wait until every rank of ``group`` arrives, or raise after ``timeout``."""
    Gathering(group, torch.zeros(1, dtype=torch.int64), timeout, what).result()


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
