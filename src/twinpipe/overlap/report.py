"""How much communication an F&B op's steps hid: pure arithmetic over its recorded events; and the
events as a Chrome trace (written by ``twinpipe.trace.chrome``, the one trace writer)."""

from __future__ import annotations

from types import MappingProxyType

from twinpipe.trace.chrome import process, span, thread, trace_document

__all__ = ["comm_hidden", "fb_spans", "fb_chrome_trace"]

_TIDS = MappingProxyType({"parts": 0, "comm F": 1, "comm B": 2})


def _overlap(a0: float, a1: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in spans)


def fb_spans(events) -> list[tuple[str, str, float, float]]:
    """One F&B op's ``(action, stream, part, start, end)`` events as ``(lane, label, start, end)``
    spans: lane ``"parts"`` for every part run (F, B and W), ``"comm F"``/``"comm B"`` for a comm
    from its start to the return of its wait (an upper bound on the transfer); label
    ``"part(stream)"``. The shape of ``Pipeline.last_trace`` entries."""
    started, spans = {}, []
    for action, stream, part, t0, t1 in events:
        if action == "start":
            started[(stream, part)] = t0
        elif action == "wait":
            spans.append((f"comm {stream}", f"{part}({stream})", started.pop((stream, part)), t1))
        else:
            spans.append(("parts", f"{part}({stream})", t0, t1))
    return spans


def comm_hidden(events) -> tuple[float, float]:
    """``(in_flight, hidden)`` seconds for one F&B op's events: how long comm parts were in flight
    (see ``fb_spans``), and how much of that time a compute part ran alongside."""
    spans = fb_spans(events)
    runs = [(t0, t1) for lane, _, t0, t1 in spans if lane == "parts"]
    comms = [(t0, t1) for lane, _, t0, t1 in spans if lane != "parts"]
    return sum(t1 - t0 for t0, t1 in comms), sum(_overlap(t0, t1, runs) for t0, t1 in comms)


def fb_chrome_trace(events_by_rank: dict[int, list[list]]) -> dict:
    """Chrome trace-event JSON (Perfetto, chrome://tracing) of F&B ops' steps: per rank (pid), a
    compute lane (every part run: F, B and W) and one communication lane per stream (from a comm's
    start to the return of its wait). ``events_by_rank[rank]`` lists F&B ops' event lists;
    timestamps are ``time.perf_counter()`` seconds, comparable across processes of one host."""
    trace = []
    for rank, ops in sorted(events_by_rank.items()):
        trace += [*process(rank, f"rank {rank}"), *(thread(rank, tid, lane) for lane, tid in _TIDS.items())]
        for op_index, events in enumerate(ops):
            for lane, label, t0, t1 in fb_spans(events):
                trace.append(span(label, "compute" if lane == "parts" else "comm", t0 * 1e6, t1 * 1e6, rank, _TIDS[lane],
                                  {"fb_op": op_index}))
    return trace_document(trace)
