"""Gradient arithmetic shared by the trainer and the single-process reference (one rule, one place).

The step's gradient is the mean over every micro-batch of the global batch, summed in this order:
within a pipeline direction over its micro-batches (as the schedule's W ops add them), then the two
directions (DualPipe's mirrored copies), then the data-parallel replicas; then scaled once.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from twinpipe.runtime.comm import wait_work

__all__ = ["scale_grads", "squared_norms", "clip_coefficient", "clip_grads", "sum_across", "DataParallelReducer"]


def scale_grads(params: Iterable[torch.Tensor], count: int) -> None:
    """Divide every gradient by ``count`` (the number of micro-batches it sums)."""
    for p in params:
        if p.grad is not None:
            p.grad.div_(count)


def squared_norms(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each gradient's squared 2-norm, in float64 (zero where there is none)."""
    return torch.stack([
        p.grad.double().pow(2).sum() if p.grad is not None else torch.zeros((), dtype=torch.float64, device=p.device) for p in params
    ]) if params else torch.zeros(0, dtype=torch.float64)


def clip_coefficient(norms: torch.Tensor, max_norm: float) -> tuple[float, float]:
    """``(global norm, factor)``: gradients times ``factor`` have a global norm of at most ``max_norm``."""
    total = float(norms.sum().sqrt())
    return total, min(1.0, max_norm / (total + 1e-6))


DP_REDUCE = ("all-reduce", "ordered")


class DataParallelReducer:
    """Sums gradients across data-parallel replicas in flat buckets: one collective per bucket.

    Buckets hold up to ``bucket_bytes`` of gradients in parameter order; all are started at once
    and awaited with ``timeout`` each. ``mode="all-reduce"`` adds in the backend's order (exact for
    two replicas: a + b == b + a); ``"ordered"`` all-gathers the buckets and adds them replica by
    replica, the same bits for any number of replicas and any backend, for dp times the memory.
    """

    def __init__(self, params: Sequence[torch.Tensor], group, timeout: float, bucket_bytes: int = 25 << 20,
                 mode: str = "all-reduce"):
        if mode not in DP_REDUCE:
            raise ValueError(f"dp_reduce={mode!r}: allowed are {', '.join(map(repr, DP_REDUCE))}")
        self.params, self.group, self.timeout, self.mode = list(params), group, timeout, mode
        self.buckets: list[list[torch.Tensor]] = []
        size = bucket_bytes + 1
        for p in self.params:
            nbytes = p.numel() * p.element_size()
            if size + nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes

    def all_reduce(self, where: str) -> None:
        if dist.get_world_size(self.group) == 1:
            return
        flats, works = [], []
        for bucket in self.buckets:
            for p in bucket:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            if self.mode == "ordered":
                parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(self.group))]
                works.append(dist.all_gather(parts, flat, group=self.group, async_op=True))
                flats.append(parts)
            else:
                works.append(dist.all_reduce(flat, group=self.group, async_op=True))
                flats.append([flat])
        for i, (bucket, parts, work) in enumerate(zip(self.buckets, flats, works)):
            wait_work(work, self.timeout, f"{where}: data-parallel {self.mode} of gradient bucket {i + 1}/{len(flats)}")
            flat = parts[0]
            for part in parts[1:]:
                flat.add_(part)  # replica 0 + replica 1 + ..., left to right
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()


def clip_grads(params: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every gradient by ``factor`` when it is below 1 (clipping is active)."""
    if factor < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)


def sum_across(tensor: torch.Tensor, group, timeout: float, what: str) -> None:
    """All-reduce (sum) ``tensor`` in place over ``group``, bounded by ``timeout``."""
    if group is not None and dist.get_world_size(group) > 1:
        wait_work(dist.all_reduce(tensor, group=group, async_op=True), timeout, what)
