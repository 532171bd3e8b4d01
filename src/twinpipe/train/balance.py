"""Cutting a list of layer weights into contiguous stages whose heaviest stage is as light as possible,
and the weights: parameter counts, or measured times (one measurement, the same on every rank)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.runtime.collectives import collective

from twinpipe.sim.partition import partition  # pure Python: the planner and simulator cut the GPT the same way

__all__ = ["partition", "param_weights", "time_weights", "measured_once"]


def param_weights(layers: Sequence[nn.Module]) -> list[float]:
    """Each layer's parameter count."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]


def time_weights(layers: Sequence[Callable], sample: torch.Tensor, repeats: int = 5, *, holder: nn.Module | None = None) -> list[float]:
    """Each layer's median forward+backward time (s) on ``sample`` (the first layer's input; each
    next layer gets the previous one's output).

    ``layers``: modules, or callables of one input whose parameters ``holder`` holds. Gradients the
    measurement leaves are removed again, so the model is as it was.
    """
    params = holder.parameters() if holder is not None else (p for layer in layers for p in layer.parameters())
    saved = {p: p.grad for p in params}
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


def measured_once(measure: Callable[[], list[float]], count: int, group, timeout: float, what: str,
                  device: torch.device | str = "cpu") -> list[float]:
    """``measure()``'s ``count`` weights, measured on the first rank of ``group`` only and sent to every
    rank: one measurement, so every rank cuts alike (ranks' clocks and devices differ). Without an
    initialised process group, ``measure()`` here. ``device``: where the weights travel (CUDA for NCCL)."""
    if not dist.is_initialized():
        return measure()
    first = dist.get_global_rank(group, 0) if group is not None else 0
    weights = torch.zeros(count, dtype=torch.float64, device=device)
    if dist.get_rank() == first:
        weights = torch.tensor(measure(), dtype=torch.float64, device=device)
    collective(dist.broadcast, weights, src=first, group=group, timeout=timeout,
               what=f"rank {dist.get_rank()}: {what} (rank {first} measures the times)")
    return weights.tolist()
