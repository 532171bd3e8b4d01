"""How much communication an F&B op's steps hid: pure arithmetic over its recorded events."""

from __future__ import annotations

__all__ = ["comm_hidden", "fb_chrome_trace"]

_TIDS = {"compute": 0, "F": 1, "B": 2}


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


def fb_chrome_trace(events_by_rank: dict[int, list[list]]) -> dict:
    """Chrome trace-event JSON (Perfetto, chrome://tracing) of F&B ops' steps: per rank (pid), a
    compute lane (every part run: F, B and W) and one communication lane per stream (from a comm's
    start to the return of its wait). ``events_by_rank[rank]`` lists F&B ops' event lists;
    timestamps are ``time.perf_counter()`` seconds, comparable across processes of one host."""
    trace = []
    for rank, ops in sorted(events_by_rank.items()):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for name, tid in (("compute (parts)", 0), ("comm (F)", 1), ("comm (B)", 2)):
            trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        for op_index, events in enumerate(ops):
            started = {}
            for action, stream, part, t0, t1 in events:
                if action == "start":
                    started[(stream, part)] = t0
                    continue
                begin = started.pop((stream, part)) if action == "wait" else t0
                trace.append({"name": f"{part}({stream})", "cat": "comm" if action == "wait" else "compute",
                              "ph": "X", "ts": round(begin * 1e6, 3), "dur": round((t1 - begin) * 1e6, 3), "pid": rank,
                              "tid": _TIDS[stream] if action == "wait" else 0, "args": {"fb_op": op_index}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}
