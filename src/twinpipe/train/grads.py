"""Gradient arithmetic shared by the trainer and the single-process reference (one rule, one place).

A parameter's gradient is ``grad_of(p)``: its FP32 ``main_grad`` under mixed precision, else ``.grad``.

The step's gradient is the mean over every micro-batch of the global batch, summed in this order:
within a pipeline direction over its micro-batches (as the schedule's W ops add them), then the two
directions (DualPipe's mirrored copies), then the data-parallel replicas; then scaled once.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from twinpipe.runtime.collectives import Collective, collective
from twinpipe.runtime.main_grad import grad_of, zeros_if_missing
from twinpipe.sim.shards import BUCKET_BYTES, buckets

__all__ = ["scale_grads", "squared_norms", "clip_coefficient", "clip_grads", "sum_across", "DataParallelReducer"]


def scale_grads(params: Iterable[torch.Tensor], count: int) -> None:
    """Divide every gradient by ``count`` (the number of micro-batches it sums)."""
    for p in params:
        g = grad_of(p)
        if g is not None:
            g.div_(count)


def squared_norms(params: Sequence[torch.Tensor], rows: dict | None = None) -> torch.Tensor:
    """Each gradient's squared 2-norm, in float64 (zero where there is none); ``rows``: ``id(p)`` ->
    the rows of ``p``'s gradient to count (one replica of each expert), all rows where absent."""
    rows = rows or {}

    def counted(p, g):
        return g.index_select(0, rows[id(p)].to(g.device)) if id(p) in rows else g

    return torch.stack([
        counted(p, g).double().pow(2).sum() if g is not None else torch.zeros((), dtype=torch.float64, device=p.device)
        for p, g in ((p, grad_of(p)) for p in params)
    ]) if params else torch.zeros(0, dtype=torch.float64)


def clip_coefficient(norms: torch.Tensor, max_norm: float) -> tuple[float, float]:
    """``(global norm, factor)``: gradients times ``factor`` have a global norm of at most ``max_norm``."""
    total = float(norms.sum().sqrt())
    return total, min(1.0, max_norm / (total + 1e-6))


DP_REDUCE = ("all-reduce", "ordered")


class DataParallelReducer:
    """Sums gradients across data-parallel replicas in flat buckets: one collective per bucket.

    ``parts`` are lists of parameters (one per pipeline stage when reducing during the step, or
    one list of all): each is cut into buckets of up to ``bucket_bytes`` in parameter order, never
    spanning two parts. ``start(i)`` starts part i's collectives (its gradients must be final);
    ``wait`` awaits every started one, ``timeout`` each, and writes the sums back. ``mode="all-reduce"``
    adds in the backend's order (exact for two replicas: a + b == b + a; for more, the order can
    depend on an element's place in its bucket, so other buckets can change the last bits);
    ``"ordered"`` all-gathers the buckets and adds them replica by replica, the same bits for any
    number of replicas, any buckets and any backend, for dp times the memory.
    """

    def __init__(self, parts: Sequence[Sequence[torch.Tensor]], group, timeout: float, bucket_bytes: int = BUCKET_BYTES,
                 mode: str = "all-reduce"):
        if mode not in DP_REDUCE:
            raise ValueError(f"dp_reduce={mode!r}: allowed are {', '.join(map(repr, DP_REDUCE))}")
        self.group, self.timeout, self.mode = group, timeout, mode
        self.parts: list[list[list[torch.Tensor]]] = [self._buckets(list(params), bucket_bytes) for params in parts]
        self._started: list[tuple[list[torch.Tensor], list[torch.Tensor], object, str]] = []

    @staticmethod
    def _buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
        cuts = buckets([p.numel() * p.element_size() for p in params], bucket_bytes)  # twinpipe.sim.shards: the one rule
        return [params[cut.start : cut.stop] for cut in cuts]

    @property
    def mirror_groups(self) -> list:
        """Process groups beyond ``group`` whose collectives this reducer runs (ZeRO-1 over mirrored
        copies; none here): a failing rank's notice goes to them too."""
        return []

    @property
    def active(self) -> bool:
        """Whether there is anything to reduce (more than one replica)."""
        return dist.get_world_size(self.group) > 1

    def start(self, part: int) -> None:
        """Start the collectives of ``part``'s buckets (a copy of its gradients is taken now)."""
        if not self.active:
            return
        for bucket in self.parts[part]:
            flat = torch.cat([zeros_if_missing(p).reshape(-1) for p in bucket])
            if self.mode == "ordered":
                parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(self.group))]
                work = Collective(dist.all_gather, parts, flat, group=self.group, timeout=self.timeout)
            else:
                parts = [flat]
                work = Collective(dist.all_reduce, flat, group=self.group, timeout=self.timeout)
            self._started.append((bucket, parts, work, f"part {part + 1}/{len(self.parts)}"))

    def wait(self, where: str) -> None:
        """Await every started collective and write the sums into the gradients."""
        started, self._started = self._started, []
        for i, (bucket, parts, work, label) in enumerate(started):
            work.wait(f"{where}: data-parallel {self.mode} of gradient bucket {i + 1}/{len(started)} ({label})")
            flat = parts[0]
            for part in parts[1:]:
                flat.add_(part)  # replica 0 + replica 1 + ..., left to right
            offset = 0
            for p in bucket:
                grad_of(p).copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def abandon(self) -> None:
        """Forget started collectives without awaiting them (the step failed; peers time out)."""
        self._started = []

    def all_reduce(self, where: str) -> None:
        """Every part at once: start all, then wait."""
        for part in range(len(self.parts)):
            self.start(part)
        self.wait(where)


def clip_grads(params: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every gradient by ``factor`` when it is below 1 (clipping is active)."""
    if factor < 1.0:
        for p in params:
            g = grad_of(p)
            if g is not None:
                g.mul_(factor)


def sum_across(tensor: torch.Tensor, group, timeout: float, what: str) -> None:
    """All-reduce (sum) ``tensor`` in place over ``group``, bounded by ``timeout``."""
    if group is not None and dist.get_world_size(group) > 1:
        collective(dist.all_reduce, tensor, group=group, timeout=timeout, what=what)
