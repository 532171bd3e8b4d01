"""How much communication an F&B op's steps hid: pure arithmetic over its recorded events."""

from __future__ import annotations

__all__ = ["comm_hidden"]


def _overlap(a0: float, a1: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in spans)


def comm_hidden(events) -> tuple[float, float]:
    """``(in_flight, hidden)`` seconds for one F&B op's ``(action, stream, part, start, end)``
    events: how long comm parts were in flight (issued until their wait returned, so an upper
    bound on the transfer), and how much of that time a compute part ran alongside."""
    runs = [(t0, t1) for action, _, _, t0, t1 in events if action == "run"]
    started = {}
    in_flight = hidden = 0.0
    for action, stream, name, t0, t1 in events:
        if action == "start":
            started[(stream, name)] = t0
        elif action == "wait":
            s = started.pop((stream, name))
            in_flight += t1 - s
            hidden += _overlap(s, t1, runs)
    return in_flight, hidden
