"""The same training in one process, for checking a pipelined run bit for bit.

It runs the whole model on each micro-batch in turn and adds gradients in the order the trainer
defines (``twinpipe.train.grads``): per direction, then directions, then replicas, then scaled;
norms, clipping and the optimizer are the trainer's own functions.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from twinpipe.runtime.batches import microbatch_rows
from twinpipe.runtime.weight_grad import defer_weight_grads
from twinpipe.schedule import registry
from twinpipe.train.data import BatchSampler, replica_rows
from twinpipe.train.grads import clip_coefficient, clip_grads, scale_grads, squared_norms
from twinpipe.train.stages import model_layers
from twinpipe.train.trainer import TrainConfig

__all__ = ["ReferenceTrainer"]


class ReferenceTrainer:
    """Single-process twin of ``Trainer`` for ``dp`` replicas of a ``pp``-rank pipeline."""

    def __init__(self, model_fn: Callable[[], nn.Module], sampler: BatchSampler, criterion, optimizer_fn,
                 config: TrainConfig, dp: int, pp: int, dtype: torch.dtype | None = None):
        self.config, self.sampler, self.criterion, self.dp = config, sampler, criterion, dp
        placement = registry.placement_for(config.schedule, pp, **dict(config.schedule_options))
        self.directions = len(placement.chains)
        self.num_chunks = config.num_microbatches(dp)
        torch.manual_seed(config.seed)
        self.model = defer_weight_grads(model_fn()).to(dtype=dtype)
        self.params = [p for _, layer in model_layers(self.model) for p in layer.parameters()]
        self.optimizer = optimizer_fn(self.params)

    def _grads(self, x, y, losses: list) -> list[torch.Tensor]:
        """Summed gradients of one direction's micro-batches (``x``, ``y`` split per micro-batch)."""
        for p in self.params:
            p.grad = None
        for xs, ys in zip(x, y):
            loss = self.criterion(self.model(xs), ys)
            loss.backward()
            losses.append(float(loss.detach()))
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def step(self, step: int) -> tuple[float, torch.Tensor, float | None]:
        """``(mean loss, per-micro-batch losses, global gradient norm or None)`` of batch ``step``."""
        dp, m = self.dp, self.num_chunks
        x, y = self.sampler.batch(step, self.config.batch_size)
        losses: list[float] = []
        total = None
        for d in range(dp):
            rows = replica_rows(self.config.batch_size, dp, d)
            xr, yr = x[rows], y[rows]
            per = m // self.directions
            replica = None
            for c in range(self.directions):
                mbs = [microbatch_rows(xr.shape[0], m, range(j, j + 1)) for j in range(c * per, (c + 1) * per)]
                grads = self._grads([xr[s] for s in mbs], [yr[s] for s in mbs], losses)
                replica = grads if replica is None else [a.add_(b) for a, b in zip(replica, grads)]
            total = replica if total is None else [a.add_(b) for a, b in zip(total, replica)]
        for p, g in zip(self.params, total):
            p.grad = g
        scale_grads(self.params, m * dp)
        norm = None
        if self.config.max_norm is not None:
            norm, factor = clip_coefficient(squared_norms(self.params), self.config.max_norm)
            clip_grads(self.params, factor)
        self.optimizer.step()
        vec = torch.tensor(losses, dtype=torch.float64)
        return float(vec.mean()), vec, norm

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{sub}": p for name, layer in model_layers(self.model) for sub, p in layer.named_parameters()}
