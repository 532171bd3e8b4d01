"""Expert parallelism simulated in one process, for references that must do a real run's arithmetic.

``LocalEPGroup(size)`` stands for an EP group whose ranks are copies of a model in one process:
``group.rank(r)`` is what rank r's MoE blocks take as ``ep_group`` (``MoEBlock.shard_experts_``).
Every block then runs the very code it runs over a process group: the same attention, router,
sorting and expert calls on the same rows in the same order, so its results are the real run's
bit for bit on any CPU (an expert's matrix products see the same number of rows, in the same
places, as over processes). Only the all-to-alls are in-process copies.

A rank's all-to-all is posted when its comm part starts and completes when the part is waited
for, which needs every rank to have started it: ``forward`` and ``backward`` drive the ranks in
lock-step, every rank's comm part started before any is waited for.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from twinpipe.checks import check_int
from twinpipe.overlap.graph import Record, capture_backward
from twinpipe.overlap.parts import Comm, Done, Pending, check_parts

__all__ = ["LocalEPGroup", "LocalEPRank", "forward", "backward"]


class LocalEPGroup:
    """``size`` expert-parallel ranks in one process; ``rank(r)`` is rank r's ``ep_group``."""

    def __init__(self, size: int):
        self.size = check_int(size, "size", low=1)
        self._calls = [0] * self.size  # all-to-alls each rank has started
        self._posted: dict[int, dict[int, tuple]] = {}  # call number -> rank -> (rows, out_splits, in_splits)
        self._waited: dict[int, int] = {}

    def rank(self, r: int) -> "LocalEPRank":
        check_int(r, "r", low=0, high=self.size - 1)
        return LocalEPRank(self, r)

    def _start(self, r: int, rows: torch.Tensor, out_splits: list, in_splits: list) -> Pending:
        n = self._calls[r]
        self._calls[r] += 1
        self._posted.setdefault(n, {})[r] = (rows.detach(), list(out_splits), list(in_splits))
        return _Exchange(self, r, n)

    def _finish(self, r: int, n: int) -> torch.Tensor:
        posted = self._posted.get(n, {})
        missing = [s for s in range(self.size) if s not in posted]
        if missing:
            raise RuntimeError(f"LocalEPGroup: rank {r} waits for all-to-all #{n}, which rank(s) {missing} have not "
                               "started; the ranks of a local EP group must run in lock-step (twinpipe.moe.local.forward/backward)")
        rows, out_splits, _ = posted[r]
        chunks = []
        for s in range(self.size):
            theirs, _, their_in = posted[s]
            if their_in[r] != out_splits[s]:
                raise RuntimeError(f"LocalEPGroup all-to-all #{n}: rank {s} sends {their_in[r]} rows to rank {r}, "
                                   f"which expects {out_splits[s]}")
            start = sum(their_in[:r])
            chunks.append(theirs[start : start + their_in[r]])
        self._waited[n] = self._waited.get(n, 0) + 1
        if self._waited[n] == self.size:
            del self._posted[n], self._waited[n]
        # A fresh tensor, as the process group's all-to-all writes into one.
        return torch.cat(chunks) if chunks else rows.new_empty((0, *rows.shape[1:]))


class LocalEPRank:
    """One rank of a ``LocalEPGroup`` (what a block takes as ``ep_group``)."""

    def __init__(self, group: LocalEPGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def all_to_all(self, rows: torch.Tensor, out_splits: list, in_splits: list) -> Pending:
        """As ``twinpipe.overlap.comm.all_to_all``: ``in_splits`` rows to each rank, ``out_splits`` from each."""
        if self.size == 1:
            return Done(rows)
        return self.group._start(self.rank, rows, out_splits, in_splits)

    def __repr__(self) -> str:
        return f"LocalEPRank({self.rank} of {self.size})"


class _Exchange(Pending):
    def __init__(self, group: LocalEPGroup, rank: int, n: int):
        self.group, self.rank, self.n = group, rank, n

    def wait(self):
        return self.group._finish(self.rank, self.n)


def forward(stages: Sequence[nn.Module], inputs: Sequence) -> list:
    """Rank r's ``stages[r]`` on ``inputs[r]`` (a tensor or a tuple of them), for every rank at once.

    Stages that declare ``parts()`` (``twinpipe.overlap.PartedSequential`` of a model's layers, as a
    pipeline stage of MoE blocks is) run part by part, every rank's part k before any rank's part
    k + 1, a comm part started on every rank before it is waited for on any; any other stage is
    called as it is. Returns each rank's output (a tensor, or a tuple of them)."""
    inputs = [x if isinstance(x, tuple) else (x,) for x in inputs]
    if not hasattr(stages[0], "parts"):
        return [stage(*x) for stage, x in zip(stages, inputs)]
    name = type(stages[0]).__name__
    records = [Record(check_parts(stage.parts(), name), x, name) for stage, x in zip(stages, inputs)]
    if len({len(r.parts) for r in records}) != 1:
        raise ValueError(f"local EP: the ranks' stages declare {[len(r.parts) for r in records]} parts; they must match")
    for k, part in enumerate(records[0].parts):
        if isinstance(part, Comm):
            for record in records:
                record.start(k)
            for record in records:
                record.wait(k)
        else:
            for record in records:
                record.run(k)
    outs = [record.outputs() for record in records]
    return [o[0] if len(o) == 1 else tuple(o) for o in outs]


def backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """Backward from each rank's ``roots[r]`` (with ``grads[r]``) through what ``forward`` ran:
    part-declaring stages part by part in lock-step, each part's backward as the rank's own backward
    runs it (``twinpipe.overlap.graph``), then on into whatever computed their inputs."""
    pending = [([root], [grad]) for root, grad in zip(roots, grads)]
    while True:
        # Each rank's backward up to its next parted layer (the engine also passes no gradient on
        # to the layers before it: those are reached next time, from the inputs' gradients).
        captured = [[(rec, g) for rec, g in capture_backward(r, gs) if any(x is not None for x in g)] for r, gs in pending]
        if not any(captured):
            return
        if any(len(c) != 1 for c in captured):
            raise ValueError(f"local EP backward: the ranks reached {[len(c) for c in captured]} part-declaring layers; expected one each")
        records = []
        for [(record, out_grads)] in captured:
            record.state = out_grads
            records.append(record)
        for k in reversed(range(len(records[0].parts))):
            if records[0].parts[k].backward_kind == "comm":
                for record in records:
                    record.start_back(k)
                for record in records:
                    record.wait_back(k)
            else:
                for record in records:
                    record.run_back(k)
        pending = []
        for record in records:
            next_roots, next_grads = [], []
            for x, g in zip(record.inputs, record.input_grads()):
                if g is None:
                    continue
                if x.is_leaf:
                    x.grad = g if x.grad is None else x.grad + g
                else:
                    next_roots.append(x)
                    next_grads.append(g)
            pending.append((next_roots, next_grads))
