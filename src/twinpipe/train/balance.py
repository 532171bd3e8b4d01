"""Cutting a list of layer weights into contiguous stages whose heaviest stage is as light as possible."""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
from torch import nn

__all__ = ["partition", "param_weights", "time_weights"]


def partition(weights: Sequence[float], num_stages: int) -> list[int]:
    """Layer counts per stage (each >= 1, contiguous) minimising the largest stage's total weight.

    Exact dynamic programme over cut points; ties go to the earliest cut, so the result is
    deterministic (every rank computes the same split).
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: the smallest possible heaviest stage when the first i layers form k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    counts, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


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
