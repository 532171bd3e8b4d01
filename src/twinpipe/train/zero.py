"""ZeRO-1 (``TrainConfig(zero=1)``): each data-parallel rank updates a shard of the parameters.

Shards are whole parameters (as ``torch.distributed.optim.ZeroRedundancyOptimizer`` cuts them),
so the optimizer is any ``torch.optim`` optimizer over real tensors and its state stays keyed by
parameter name in checkpoints (any later layout can load it). Each gradient bucket of
``DataParallelReducer`` is cut into ``dp`` contiguous runs of parameters of nearly equal size
(``balance.partition``); rank i owns run i. The bucket's flat buffer holds run i at offset
``i * C`` (C: the largest run, the rest zero padding), so one ``reduce_scatter_single`` leaves each
rank the summed gradients of its own run, and after the update one ``all_gather_single`` gives
every rank every run's new weights.

The all-gathers are cut by stage (``stages``: the parameters of each of this rank's stage modules):
one per bucket and set of stages holding its parameters, each rank's owned parameters of it at
offset ``i * C``. ``start_gather`` starts them all after the update and returns; ``wait_gather(j)``
awaits those of stage j only (the trainer calls it before the stage's forward), so a later stage's
all-gather goes on while an earlier stage computes. The same bytes land in the same parameters as
with one all-gather per bucket: only the wait moves.

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
from twinpipe.runtime.errors import PipelineBrokenError
from twinpipe.runtime.main_grad import grad_of, zeros_if_missing
from twinpipe.train.balance import partition
from twinpipe.train.grads import DP_REDUCE, DataParallelReducer

__all__ = ["ShardedReducer", "runs"]


def runs(sizes: Sequence[int], world: int) -> list[range]:
    """Index ranges of ``sizes`` for each of ``world`` ranks: contiguous, the largest as small as
    whole parameters allow (fewer parameters than ranks: one each, the last ranks none)."""
    n = len(sizes)
    if n <= world:
        return [range(i, i + 1) if i < n else range(n, n) for i in range(world)]
    counts, start, out = partition(sizes, world), 0, []
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    runs: list[Sequence[int]]  # per rank: its parameters' indices in ``params``
    chunk: int  # elements per rank in the flat buffer (the largest run)
    stages: frozenset = frozenset()  # an all-gather's: the stage modules holding its parameters (empty: every one)

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
    ``start_gather``/``wait_gather`` (``gather``: both at once) hand every rank the owners' updated weights."""

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
        self._pending: list = []  # started all-gathers: (unit, its input, its output, work, what)
        self._broken: str | None = None  # why the weights are incomplete (a failed or abandoned all-gather)
        self._where = ""  # the last update's (rank and step), for the messages of later waits
        self.units: list[_Bucket] | None = None  # the all-gathers (``set_stages``; else one per bucket)

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

    def _gathers(self, stages: Sequence[Sequence[torch.Tensor]] | None) -> list[_Bucket]:
        """The all-gather units: each bucket's parameters grouped by the stage modules holding them
        (in bucket order; a parameter held by no listed stage, or ``stages`` None: waited by every stage)."""
        holders: dict[int, set[int]] = {}
        for j, params in enumerate(stages or ()):
            for p in params:
                holders.setdefault(id(p), set()).add(j)
        units = []
        for buckets in self.buckets:
            for bucket in buckets:
                groups: dict[frozenset, list[int]] = {}
                for k, p in enumerate(bucket.params):
                    groups.setdefault(frozenset(holders.get(id(p), ())), []).append(k)
                for held, ks in groups.items():
                    params = [bucket.params[k] for k in ks]
                    cut = [[i for i, p in enumerate(params) if self.owner[id(p)] == r] for r in range(self.world)]
                    chunk = max(sum(params[i].numel() for i in run) for run in cut)
                    units.append(_Bucket(params, cut, chunk, held))
        return units

    def set_stages(self, stages: Sequence[Sequence[torch.Tensor]]) -> None:
        """Cut the all-gathers by stage: ``stages[j]`` are the parameters of this rank's stage module j
        (the same cut on every data-parallel rank: they hold the same stages)."""
        self.units = self._gathers(stages)

    @property
    def pending(self) -> int:
        """How many all-gathers of the last update are not yet awaited."""
        return len(self._pending)

    def start_gather(self, where: str) -> None:
        """Start every all-gather of the owners' updated weights (after the update); ``wait_gather``
        awaits them. ``where`` names the step in the waits' messages."""
        if not self.active:
            return
        self.wait_gather(None, "before the next update's all-gathers")  # none pending normally
        if self.units is None:
            self.units = self._gathers(None)
        self._where = where
        peers = dist.get_process_group_ranks(self.group)
        with torch.no_grad():
            for i, unit in enumerate(self.units):
                p0 = unit.params[0]
                mine = unit.flat(torch.Tensor.detach, p0.dtype, p0.device, self.rank)
                out = torch.empty(self.world * unit.chunk, dtype=p0.dtype, device=p0.device)
                work = dist.all_gather_single(out, mine, group=self.group, async_op=True)
                what = (f"{where}: all-gather of updated weights (ZeRO-1) over data-parallel global ranks {peers}, "
                        f"bucket {i + 1}/{len(self.units)}")
                self._pending.append((unit, mine, out, work, what))

    def wait_gather(self, stage: int | None, why: str) -> None:
        """Await the pending all-gathers of stage module ``stage`` (None: all) and write the weights
        into the parameters; ``why`` (e.g. "before the forward of stage 3") completes the messages. After
        an all-gather failed or was abandoned, raises ``PipelineBrokenError``: the weights are incomplete."""
        if self._broken is not None:
            raise PipelineBrokenError(f"{self._where}: {why}: the weights are incomplete: {self._broken}")
        keep = []
        try:
            for entry in self._pending:
                unit, _, out, work, what = entry
                if stage is not None and unit.stages and stage not in unit.stages:
                    keep.append(entry)
                    continue
                wait_work(work, self.timeout, f"{what}, awaited {why}", self.group)
                with torch.no_grad():
                    unit.unflat(out, lambda p: p.data, None)
        except BaseException as exc:
            self._broken = f"an all-gather of updated weights failed ({type(exc).__name__}: {exc})"
            self._pending = []
            raise
        self._pending = keep

    def gather(self, where: str) -> None:
        """Every rank's owned weights to every rank (after the update), awaited now."""
        self.start_gather(where)
        self.wait_gather(None, "at once")

    def abandon(self) -> None:
        """Forget started collectives without awaiting them (the step failed; peers time out). Pending
        all-gathers are dropped too: the weights stay incomplete, and later waits raise."""
        super().abandon()
        if self._pending:
            self._broken = "a failed step abandoned the all-gathers of updated weights"
        self._pending = []
