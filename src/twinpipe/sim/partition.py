"""Cutting a list of layer weights into contiguous stages whose heaviest stage is as light as
possible (pure Python: the trainer's ``split``, ZeRO-1's shards and the planner's GPT share it)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["partition"]


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
