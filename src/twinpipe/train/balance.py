"""Cutting a list of layer weights into contiguous stages whose heaviest stage is as light as possible."""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
from torch import nn

from twinpipe.sim.partition import partition  # pure Python: the planner and simulator cut the GPT the same way

__all__ = ["partition", "param_weights", "time_weights"]


def param_weights(layers: Sequence[nn.Module]) -> list[float]:
    """Each layer's parameter count."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]


def time_weights(layers: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 5) -> list[float]:
    """Each layer's median forward+backward time (s) on ``sample`` (the first layer's input).

    Gradients the measurement leaves are removed again, so the model is as it was.
    """
    saved = {p: p.grad for layer in layers for p in layer.parameters()}
    times, x = [], sample
    try:
        for layer in layers:
            runs = []
            for _ in range(repeats):
                inp = x.detach().requires_grad_(x.is_floating_point())
                start = time.perf_counter()
                out = layer(inp)
                if out.requires_grad:
                    out.backward(torch.ones_like(out))
                if out.device.type == "cuda":
                    torch.cuda.synchronize(out.device)
                runs.append(time.perf_counter() - start)
            times.append(statistics.median(runs))
            x = out.detach()
    finally:
        for p, g in saved.items():
            p.grad = g
    return times
