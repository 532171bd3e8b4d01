"""The part order of an overlapped F&B op, and its predicted time (pure Python, no torch).

An F&B op runs the forward parts of one micro-batch (stream ``F``) against the backward parts of
another (stream ``B``, in backward order), plus the weight-gradient parts (``W``) that B's compute
parts leave behind. Every part is ``"compute"`` or ``"comm"``. ``fb_order`` fixes one order of
steps from the parts' kinds alone, so every rank of an expert-parallel group derives the same
order and issues its collectives in the same sequence. ``predict_fb`` times that order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Step", "fb_order", "predict_fb", "KINDS"]

KINDS = ("compute", "comm")


@dataclass(frozen=True)
class Step:
    """One step of an F&B op: ``run`` a compute part, ``start``/``wait`` a comm part.

    ``stream`` is ``F``, ``B`` or ``W``; ``index`` counts that stream's parts (W shares B's
    indices: ``W k`` is the weight gradient left by ``B k``).
    """

    action: str  # run | start | wait
    stream: str  # F | B | W
    index: int

    def __str__(self) -> str:
        return f"{self.action} {self.stream}{self.index}"


def _check(kinds: Sequence[str], name: str) -> None:
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"{name}={list(kinds)!r}: part kinds must be one of {KINDS}, got {bad[0]!r}")


def fb_order(forward: Sequence[str], backward: Sequence[str], overlap: bool = True) -> list[Step]:
    """Steps for an F&B op whose F parts have kinds ``forward`` and B parts ``backward``.

    With ``overlap``: a comm part starts as soon as its stream reaches it; while one stream's comm
    is in flight the other stream computes; when both wait on comm, pending W parts fill the gap;
    otherwise the oldest comm is waited for. B goes first on ties (DeepSeek's layer order starts
    with combine(B)). Without ``overlap``: F, then B with each W right after its B part.
    """
    _check(forward, "forward")
    _check(backward, "backward")
    parts = {"F": list(forward), "B": list(backward)}
    if not overlap:
        steps = []
        for stream in ("F", "B"):
            for i, kind in enumerate(parts[stream]):
                if kind == "comm":
                    steps += [Step("start", stream, i), Step("wait", stream, i)]
                else:
                    steps.append(Step("run", stream, i))
                    if stream == "B":
                        steps.append(Step("run", "W", i))
        return steps
    cursor = {"F": 0, "B": 0}
    flying: deque[tuple[str, int]] = deque()  # comm parts started and not yet waited for, oldest first
    pending_w: deque[int] = deque()
    steps: list[Step] = []

    def busy(stream: str) -> bool:
        return any(s == stream for s, _ in flying)

    def done(stream: str) -> bool:
        return cursor[stream] >= len(parts[stream])

    while not (done("F") and done("B")) or flying or pending_w:
        for stream in ("B", "F"):
            if not busy(stream) and not done(stream) and parts[stream][cursor[stream]] == "comm":
                steps.append(Step("start", stream, cursor[stream]))
                flying.append((stream, cursor[stream]))
                cursor[stream] += 1
        ready = [s for s in ("B", "F") if not busy(s) and not done(s)]
        if ready:
            # Prefer the stream whose partner has a comm in flight: that compute hides it.
            stream = next((s for s in ready if busy("F" if s == "B" else "B")), ready[0])
            steps.append(Step("run", stream, cursor[stream]))
            if stream == "B":
                pending_w.append(cursor[stream])
            cursor[stream] += 1
        elif pending_w:
            steps.append(Step("run", "W", pending_w.popleft()))
        else:
            stream, index = flying.popleft()
            steps.append(Step("wait", stream, index))
    return steps


def predict_fb(
    forward: Sequence[tuple[str, float]],
    backward: Sequence[tuple[str, float]],
    weight: Sequence[float] | None = None,
    overlap: bool = True,
    order: Sequence[Step] | None = None,
) -> float:
    """Predicted time of an F&B op from per-part ``(kind, seconds)`` lists (B in backward order).

    ``weight[k]`` is the time of W k (B k's deferred weight gradient; entries for comm parts are
    not used; 0 by default). Compute parts run one at a time; comm parts share one link, one at a
    time in the order started, and a comm starts when it is issued and the link is free. Issuing
    and waiting cost nothing. ``order`` times another order of the same steps (default:
    ``fb_order``).
    """
    fk, bk = [k for k, _ in forward], [k for k, _ in backward]
    times = {"F": [t for _, t in forward], "B": [t for _, t in backward]}
    if any(t < 0 for t in times["F"] + times["B"]):
        raise ValueError("part times must be >= 0")
    times["W"] = list(weight) if weight is not None else [0.0] * len(bk)
    if len(times["W"]) != len(bk):
        raise ValueError(f"weight has {len(times['W'])} entries; backward has {len(bk)} parts")
    now, link_free = 0.0, 0.0
    ends: dict[tuple[str, int], float] = {}
    steps = fb_order(fk, bk, overlap)
    if order is not None:
        if sorted(map(str, order)) != sorted(map(str, steps)):
            raise ValueError("order: must hold exactly the steps of fb_order for these parts")
        steps = list(order)
    for step in steps:
        key = (step.stream, step.index)
        if step.action == "run":
            now += times[step.stream][step.index]
        elif step.action == "start":
            begin = max(now, link_free)
            link_free = ends[key] = begin + times[step.stream][step.index]
        elif key not in ends:
            raise ValueError(f"order: {step} comes before its start")
        else:
            now = max(now, ends[key])
    return now
