"""Small stage models and a single-process reference, shared by the distributed tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import twinpipe
from twinpipe.runtime import run_backward

HIDDEN = 8


class MLPStage(nn.Module):
    """Linear -> GELU -> Linear, with deferred weight gradients (the official example's stage)."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.net = twinpipe.defer_weight_grads(nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)))

    def forward(self, x):
        return self.net(x)


class OverlapStage(MLPStage):
    """The same stage with an ``overlapped_forward_backward`` (run in sequence, like the official example)."""

    calls = 0

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1):
        cls.calls += 1
        outputs0 = [module0(*inputs0)]
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            run_backward(outputs1, output_grads1)
        return outputs0, loss0


class TwoTensorStage(nn.Module):
    """Takes and returns two tensors, so every message carries two."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.a = twinpipe.defer_weight_grads(nn.Linear(hidden, hidden))
        self.b = nn.Linear(hidden, hidden)  # not deferred: its W happens during B

    def forward(self, x, y):
        return torch.tanh(self.a(x) + y), self.b(y) * 0.5 + x


def mse(out, label):
    return F.mse_loss(out, label).clone()


def mse2(out1, out2, label):
    return F.mse_loss(out1 + out2, label).clone()


def make_model(kind, num_stages: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [kind().double() for _ in range(num_stages)]


def reference(model, placement, xs, labels, criterion):
    """Single process: each micro-batch through its chain; returns per-mb losses and outputs."""
    losses, outputs = {}, {}
    for chain_index, chain in enumerate(placement.chains):
        for j in placement.microbatches_of_chain(chain_index, len(xs)):
            out = xs[j]
            for s in chain:
                out = model[placement.model_stage(s)](*out)
                out = out if isinstance(out, tuple) else (out,)
            loss = criterion(*out, labels[j]) if criterion is not None else None
            if loss is not None and torch.is_grad_enabled():
                loss.backward()
            losses[j], outputs[j] = loss, out
    return losses, outputs


def grad_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """The official DualPipe example's metric: 1 - 2*sum(x*y) / sum(x*x + y*y)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return 0.0 if denom == 0 else float(1 - 2 * (x * y).sum() / denom)
