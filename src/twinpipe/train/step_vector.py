"""The step's one vector: what every rank must learn of a step, summed in one all-reduce per mesh dimension.

Entries, in order: squared gradient norms by model parameter (when clipping), the losses of every
micro-batch of the global batch, token copies routed to each expert of every router of the model
(``bias_update_speed``), the number of ranks asking for each request (``step(stop=, save=)``), the
number of ranks whose gradients are not finite, and a 16-bit digest of the global batch and its
square. Each norm and loss entry has one non-zero contribution (its owner's), and the others are
counts: the float64 sums are exact, and every rank decides alike from them. Ranks asked for
different steps (or with other samplers) would pair one batch's inputs with another's labels; n
digests are all equal only when sum**2 == n * (sum of squares): ``PipelineMismatchError`` before
anything is updated.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch

from twinpipe.runtime.errors import PipelineMismatchError
from twinpipe.runtime.main_grad import grad_of
from twinpipe.train.grads import sum_across

__all__ = ["StepVector", "any_nonfinite", "few"]


def any_nonfinite(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """1.0 when a gradient of ``params`` holds inf or NaN, else 0.0 (float64; no host sync).

    A float64 sum of finite float32 (or narrower) values cannot overflow, so it is finite exactly
    when every value is (float64 gradients: unless their sum passes 1.8e308)."""
    sums = [g.sum(dtype=torch.float64) for g in map(grad_of, params) if g is not None]
    if not sums:
        return torch.zeros((), dtype=torch.float64)
    return (~torch.isfinite(torch.stack(sums))).any().to(torch.float64)


def few(items: Sequence, limit: int = 4) -> str:
    """The first ``limit`` items, and how many more."""
    shown = ", ".join(map(str, items[:limit]))
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


class StepVector:
    """One float64 vector of ``norms + losses + loads + requests + 3`` entries on ``device`` (NCCL
    moves no CPU tensors); the named parts are views into it, on the CPU after ``sum``."""

    def __init__(self, norms: int, losses: int, loads: int, requests: int, device):
        self._ends = tuple(itertools.accumulate((norms, losses, loads, requests)))
        self.vec = torch.zeros(self._ends[-1] + 3, dtype=torch.float64, device=device)

    def _part(self, i: int) -> torch.Tensor:
        return self.vec[(self._ends[i - 1] if i else 0) : self._ends[i]]

    norms = property(lambda self: self._part(0))
    losses = property(lambda self: self._part(1))
    loads = property(lambda self: self._part(2))
    requests = property(lambda self: self._part(3))

    @property
    def nonfinite(self) -> torch.Tensor:
        """The entry counting the ranks whose gradients are not finite (a one-element view)."""
        return self.vec[-3:-2]

    def set_digest(self, digest: int) -> None:
        self.vec[-2:] = torch.tensor([digest, digest * digest], dtype=torch.float64)

    def sum(self, groups: Sequence[tuple[object, str]], timeout: float, ranks: int, where: str) -> None:
        """Sum over each ``(group, what)`` in turn, then bring the vector to the CPU; raises
        ``PipelineMismatchError`` when the ``ranks`` ranks' digests differ (``where``: rank and step)."""
        for group, what in groups:
            sum_across(self.vec, group, timeout, f"{where}: {what}")
        self.vec = self.vec.cpu()
        total, squares = (int(v) for v in self.vec[-2:].tolist())
        if total * total != ranks * squares:
            raise PipelineMismatchError(
                f"{where}: the ranks trained on different global batches (other step numbers, samplers or seeds); "
                "every rank must call step() with the same step and build its trainer alike (nothing was updated)")

    def problem(self, parameter_names: Sequence[tuple[str, object]]) -> str | None:
        """What in the summed vector is not finite (the same on every rank), or None."""
        parts = []
        losses, norms = self.losses, self.norms
        bad_losses = [i for i, v in enumerate(losses.tolist()) if not math.isfinite(v)]
        if bad_losses:
            parts.append(f"the loss of global micro-batch(es) {few(bad_losses)} ({losses[bad_losses[0]].item()})")
        bad_norms = [i for i, v in enumerate(norms.tolist()) if not math.isfinite(v)]
        if bad_norms:
            names = [parameter_names[i][0] for i in bad_norms]
            parts.append(f"the gradient norm ({float(norms.sum().sqrt())}; not finite in {few(names)})")
        if self.nonfinite.item():
            parts.append(f"the gradients of {int(self.nonfinite.item())} rank(s)")
        return ", ".join(parts) if parts else None
