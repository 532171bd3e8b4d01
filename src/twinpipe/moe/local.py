"""Expert parallelism simulated in one process, for references that must do a real run's arithmetic.

``LocalEPGroup(size)`` stands for an EP group whose ranks are copies of a model in one process:
``group.rank(r)`` is what rank r's MoE blocks take as ``ep_group`` (``MoEBlock.shard_experts_``).
Every block then runs the very code it runs over a process group: the same attention, router,
sorting and expert calls on the same rows in the same order, so its results are the real run's
bit for bit on any CPU (an expert's matrix products see the same number of rows, in the same
places, as over processes). Only the all-to-alls are in-process copies.

A rank's all-to-all is posted when its comm part starts and completes when the part is waited
for, which needs every rank to have started it: ``forward`` and ``backward`` (the overlap
package's lock-step driver, ``twinpipe.overlap.lockstep``) drive the ranks' parts in step, every
rank's comm part started before any is waited for.
"""

from __future__ import annotations

import torch

from twinpipe.checks import check_int
from twinpipe.overlap import lockstep
from twinpipe.overlap.parts import Done, Pending

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


# The ranks' parts in lock-step: the overlap package's part engine (twinpipe.overlap.lockstep).
forward, backward = lockstep.forward, lockstep.backward
