"""ZeRO-1 (``TrainConfig(zero=1)``): each data-parallel rank updates a shard of the parameters.

Shards are whole parameters (as ``torch.distributed.optim.ZeroRedundancyOptimizer`` cuts them),
so the optimizer is any ``torch.optim`` optimizer over real tensors and its state stays keyed by
parameter name in checkpoints (any later layout can load it). Each gradient bucket of
``DataParallelReducer`` is cut into ``dp`` contiguous runs of parameters of nearly equal size
(``balance.partition``); rank i owns run i. The bucket's flat buffer holds run i at offset
``i * C`` (C: the largest run, the rest zero padding), so one ``reduce_scatter_single`` leaves each
rank the summed gradients of its own run, and after the update one ``all_gather_single`` gives
every rank every run's new weights.

``mode="ordered"`` replaces the reduce-scatter by an all-to-all and adds the dp pieces of a run in
replica order, bitwise the same as ``DataParallelReducer``'s ordered sum for any dp; ``"all-reduce"``
is the backend's reduce-scatter, whose order equals the all-reduce's for two replicas (a + b).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from twinpipe.runtime.comm import wait_work
from twinpipe.runtime.main_grad import grad_of, zeros_if_missing
from twinpipe.sim.shards import runs  # the one rule, shared with the planner
from twinpipe.train.grads import DP_REDUCE, DataParallelReducer

__all__ = ["ShardedReducer", "runs"]


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    runs: list[range]  # per rank: its parameters' indices in ``params``
    chunk: int  # elements per rank in the flat buffer (the largest run)

    def flat(self, values, dtype, device, rank: int | None = None) -> torch.Tensor:
        """``values(p)`` of every parameter, rank i's run at offset ``i * chunk`` (zero padded); with
        ``rank``, that rank's run alone."""
        flat = torch.zeros((len(self.runs) if rank is None else 1) * self.chunk, dtype=dtype, device=device)
        for i, run in enumerate(self.runs):
            if rank is not None and i != rank:
                continue
            offset = (i if rank is None else 0) * self.chunk
            for k in run:
                n = self.params[k].numel()
                flat[offset : offset + n].copy_(values(self.params[k]).reshape(-1))
                offset += n
        return flat

    def unflat(self, flat: torch.Tensor, targets, rank: int | None) -> None:
        """Copy ``flat`` (all ranks' runs, or with ``rank`` only that rank's run) into ``targets(p)``."""
        for i, run in enumerate(self.runs):
            if rank is not None and i != rank:
                continue
            offset = (i if rank is None else 0) * self.chunk
            for k in run:
                p = self.params[k]
                targets(p).copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


class ShardedReducer(DataParallelReducer):
    """``DataParallelReducer`` for ZeRO-1: ``start``/``wait`` leave each rank the summed gradients of
    the parameters it owns (``owns``; the others' ``.grad`` is dropped, a ``main_grad`` kept), and
    ``gather`` hands every rank the owners' updated weights."""

    def __init__(self, parts: Sequence[Sequence[torch.Tensor]], group, timeout: float, bucket_bytes: int = 25 << 20,
                 mode: str = "all-reduce"):
        if mode not in DP_REDUCE:
            raise ValueError(f"dp_reduce={mode!r}: allowed are {', '.join(map(repr, DP_REDUCE))}")
        super().__init__(parts, group, timeout, bucket_bytes, mode)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.buckets: list[list[_Bucket]] = []
        self.owner: dict[int, int] = {}
        for buckets in self.parts:
            mine = []
            for params in buckets:
                cut = runs([p.numel() for p in params], self.world)
                mine.append(_Bucket(params, cut, max(sum(params[k].numel() for k in r) for r in cut)))
                self.owner.update((id(params[k]), i) for i, r in enumerate(cut) for k in r)
            self.buckets.append(mine)

    def owns(self, p: torch.Tensor) -> bool:
        return self.owner.get(id(p), self.rank) == self.rank

    def start(self, part: int) -> None:
        if not self.active:
            return
        for i, bucket in enumerate(self.buckets[part]):
            for p in bucket.params:
                zeros_if_missing(p)
            g0 = grad_of(bucket.params[0])
            flat = bucket.flat(grad_of, g0.dtype, g0.device)
            if self.mode == "ordered":
                out = torch.empty_like(flat)
                work = dist.all_to_all_single(out, flat, group=self.group, async_op=True)
            else:
                out = torch.empty(bucket.chunk, dtype=flat.dtype, device=flat.device)
                work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=True)
            self._started.append((bucket, [out], work, f"part {part + 1}/{len(self.parts)}, bucket {i + 1}"))

    def wait(self, where: str) -> None:
        started, self._started = self._started, []
        for i, (bucket, (out,), work, label) in enumerate(started):
            wait_work(work, self.timeout, f"{where}: data-parallel {self.mode} reduce-scatter (ZeRO-1) of gradient bucket "
                      f"{i + 1}/{len(started)} ({label})", self.group)
            if self.mode == "ordered":  # the dp pieces of this rank's run, added replica by replica
                pieces = out.view(self.world, bucket.chunk)
                out = pieces[0].clone()
                for piece in pieces[1:]:
                    out.add_(piece)
            bucket.unflat(out, grad_of, self.rank)
            for k in (k for r, run in enumerate(bucket.runs) if r != self.rank for k in run):
                bucket.params[k].grad = None  # not this rank's to update (a main_grad stays: it is reused)

    def gather(self, where: str) -> None:
        """Every rank's owned weights to every rank (after the update): one all-gather per bucket."""
        if not self.active:
            return
        started = []
        with torch.no_grad():
            for buckets in self.buckets:
                for bucket in buckets:
                    p0 = bucket.params[0]
                    mine = bucket.flat(torch.Tensor.detach, p0.dtype, p0.device, self.rank)
                    out = torch.empty(self.world * bucket.chunk, dtype=p0.dtype, device=p0.device)
                    started.append((bucket, out, dist.all_gather_single(out, mine, group=self.group, async_op=True)))
            for i, (bucket, out, work) in enumerate(started):
                wait_work(work, self.timeout, f"{where}: all-gather of updated weights (ZeRO-1), bucket {i + 1}/{len(started)}",
                          self.group)
                bucket.unflat(out, lambda p: p.data, None)
