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

Mirrored copies (DualPipe, Chimera, BitPipe; ``copies``): a part is one model stage, and every copy
of it cuts its buckets alike. The reduce-scatter is unchanged (each copy over its data-parallel
group, of the copies' summed gradients), but each rank's run is cut again into one sub-run per copy
(``twinpipe.sim.shards``): copy c updates sub-run c only, and the all-gathers run over the
``dp * copies`` ranks holding the stage (``Copies.group``, the same on every one of them, issued in
model-stage order), so the optimizer state and masters of a stage exist once, not once per copy.

``mode="ordered"`` replaces the reduce-scatter by an all-to-all and adds the dp pieces of a run in
replica order, bitwise the same as ``DataParallelReducer``'s ordered sum for any dp; ``"all-reduce"``
is the backend's reduce-scatter, whose order equals the all-reduce's for two replicas (a + b).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from twinpipe.runtime.collectives import Collective
from twinpipe.runtime.errors import PipelineBrokenError
from twinpipe.runtime.main_grad import grad_of, zeros_if_missing
from twinpipe.schedule.ops import Op, OpKind
from twinpipe.sim.shards import BUCKET_BYTES, runs  # the one rule, shared with the planner
from twinpipe.train.grads import DP_REDUCE, DataParallelReducer

__all__ = ["Copies", "ShardedReducer", "runs", "first_forward_in_fb"]


@dataclass(frozen=True)
class Copies:
    """A part's mirrored copies (one model stage): this rank holds copy ``copy`` of ``count``;
    ``group`` holds every copy on every data-parallel rank, ``position[i][c]`` being the group rank
    of copy c on data-parallel rank i; ``stage`` (the model stage) orders the all-gathers."""
    copy: int
    count: int
    group: object
    position: tuple[tuple[int, ...], ...]
    stage: int


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    runs: list[Sequence[int]]  # per rank: its parameters' indices in ``params``
    chunk: int  # elements per rank in the flat buffer (the largest run)
    stages: frozenset = frozenset()  # an all-gather's: the stage modules holding its parameters (empty: every one)
    group: object = None  # an all-gather's: its process group, and this rank's place in it
    rank: int = 0

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

    def __init__(self, parts: Sequence[Sequence[torch.Tensor]], group, timeout: float, bucket_bytes: int = BUCKET_BYTES,
                 mode: str = "all-reduce", copies: Sequence[Copies | None] | None = None):
        if mode not in DP_REDUCE:
            raise ValueError(f"dp_reduce={mode!r}: allowed are {', '.join(map(repr, DP_REDUCE))}")
        super().__init__(parts, group, timeout, bucket_bytes, mode)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.copies: list[Copies | None] = list(copies) if copies is not None else [None] * len(self.parts)
        self.buckets: list[list[_Bucket]] = []
        self.owner: dict[int, tuple[int, int]] = {}  # parameter -> (data-parallel rank, copy) updating it
        self._copy: dict[int, int] = {}  # parameter -> this rank's copy index of its part
        for buckets, cp in zip(self.parts, self.copies):
            mine = []
            for params in buckets:
                cut = runs([p.numel() for p in params], self.world)
                mine.append(_Bucket(params, cut, max(sum(params[k].numel() for k in r) for r in cut)))
                for i, r in enumerate(cut):
                    subs = runs([params[k].numel() for k in r], cp.count) if cp else [range(len(r))]
                    self.owner.update((id(params[r[j]]), (i, c)) for c, sub in enumerate(subs) for j in sub)
                self._copy.update((id(p), cp.copy if cp else 0) for p in params)
            self.buckets.append(mine)
        self._pending: list = []  # started all-gathers: (unit, its input, its output, work, what)
        self._broken: str | None = None  # why the weights are incomplete (a failed or abandoned all-gather)
        self._where = ""  # the last update's (rank and step), for the messages of later waits
        self.units: list[_Bucket] | None = None  # the all-gathers (``set_stages``; else one per bucket)

    @property
    def mirror_groups(self) -> list:
        """The process groups of the all-gathers over mirrored copies (each once): a failing rank's
        notice goes to them too."""
        return list({id(cp.group): cp.group for cp in self.copies if cp}.values())

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank updates ``p`` (a parameter it does not reduce: yes)."""
        return id(p) not in self.owner or self.owner[id(p)] == (self.rank, self._copy[id(p)])

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
                work = Collective(dist.all_to_all_single, out, flat, group=self.group, timeout=self.timeout)
            else:
                out = torch.empty(bucket.chunk, dtype=flat.dtype, device=flat.device)
                work = Collective(dist.reduce_scatter_single, out, flat, group=self.group, timeout=self.timeout)
            self._started.append((bucket, [out], work, f"part {part + 1}/{len(self.parts)}, bucket {i + 1}"))

    def wait(self, where: str) -> None:
        started, self._started = self._started, []
        for i, (bucket, (out,), work, label) in enumerate(started):
            work.wait(f"{where}: data-parallel {self.mode} reduce-scatter (ZeRO-1) of gradient bucket "
                      f"{i + 1}/{len(started)} ({label})")
            if self.mode == "ordered":  # the dp pieces of this rank's run, added replica by replica
                pieces = out.view(self.world, bucket.chunk)
                out = pieces[0].clone()
                for piece in pieces[1:]:
                    out.add_(piece)
            bucket.unflat(out, grad_of, self.rank)
            for p in bucket.params:
                if not self.owns(p):
                    p.grad = None  # not this rank's to update (a main_grad stays: it is reused)

    def _gathers(self, stages: Sequence[Sequence[torch.Tensor]] | None) -> list[_Bucket]:
        """The all-gather units: each bucket's parameters grouped by the stage modules holding them
        (in bucket order; a parameter held by no listed stage, or ``stages`` None: waited by every stage)."""
        holders: dict[int, set[int]] = {}
        for j, params in enumerate(stages or ()):
            for p in params:
                holders.setdefault(id(p), set()).add(j)
        units = []
        for buckets, cp in zip(self.buckets, self.copies):
            group, size = (cp.group, self.world * cp.count) if cp else (self.group, self.world)
            where = (lambda i, c, cp=cp: cp.position[i][c]) if cp else (lambda i, c: i)  # an owner's rank in the group
            me = where(self.rank, cp.copy if cp else 0)
            for bucket in buckets:
                groups: dict[frozenset, list[int]] = {}
                for k, p in enumerate(bucket.params):
                    groups.setdefault(frozenset(holders.get(id(p), ())), []).append(k)
                for held, ks in groups.items():
                    params = [bucket.params[k] for k in ks]
                    cut = [[i for i, p in enumerate(params) if where(*self.owner[id(p)]) == r] for r in range(size)]
                    chunk = max(sum(params[i].numel() for i in run) for run in cut)
                    units.append((cp.stage if cp else -1, len(units), _Bucket(params, cut, chunk, held, group, me)))
        # Every holder of a model stage issues its all-gathers in model-stage order (a copy's modules
        # are in another order on each rank); the data-parallel ones keep theirs.
        return [unit for *_, unit in sorted(units, key=lambda u: u[:2])]

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
        awaits them. ``where`` names the step in the waits' messages. When starting them fails, the
        weights are incomplete here as on the peers: later waits raise ``PipelineBrokenError``."""
        if not self.active:
            return
        self.wait_gather(None, "before the next update's all-gathers")  # none pending normally
        self._where = where
        try:
            self._start_gathers(where)
        except BaseException as exc:
            self._broken = f"starting the all-gathers of updated weights failed ({type(exc).__name__}: {exc})"
            self._pending = []
            raise

    def _start_gathers(self, where: str) -> None:
        if self.units is None:
            self.units = self._gathers(None)
        with torch.no_grad():
            for i, unit in enumerate(self.units):
                p0 = unit.params[0]
                mine = unit.flat(torch.Tensor.detach, p0.dtype, p0.device, unit.rank)
                out = torch.empty(len(unit.runs) * unit.chunk, dtype=p0.dtype, device=p0.device)
                work = Collective(dist.all_gather_single, out, mine, group=unit.group, timeout=self.timeout)
                over = "data-parallel global ranks" if unit.group is self.group else "global ranks (every copy, every replica)"
                what = (f"{where}: all-gather of updated weights (ZeRO-1) over {over} {dist.get_process_group_ranks(unit.group)}, "
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
                work.wait(f"{what}, awaited {why}")
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

    def refuse_weights(self, where: str, why: str) -> None:
        """The update failed on this rank before its all-gathers started (``optimizer.step``, the
        precision refresh): its weights are stale and its peers' all-gathers unmatched, so every later
        wait raises ``PipelineBrokenError`` naming ``where`` (rank and step) and ``why`` (a first reason,
        e.g. a failed start, stays)."""
        if self._broken is None:
            self._where, self._broken = where, why
        self._pending = []

    def abandon(self) -> None:
        """Forget started collectives without awaiting them (the step failed; peers time out). Pending
        all-gathers are dropped too: the weights stay incomplete, and later waits raise."""
        super().abandon()
        if self._pending:
            self._broken = "a failed step abandoned the all-gathers of updated weights"
        self._pending = []


def first_forward_in_fb(ops: Sequence[Op]) -> bool:
    """Whether some stage's first forward in one rank's ``ops`` is the forward half of an F&B op: the
    forward pre-hook that awaits a stage's all-gathers does not see it, so the trainer awaits them all
    before such a step."""
    seen: set[int] = set()
    for op in ops:
        if op.kind in (OpKind.F, OpKind.FB) and op.stage not in seen:
            if op.kind is OpKind.FB:
                return True
            seen.add(op.stage)
    return False
