"""Chrome trace-event JSON (opens in Perfetto and chrome://tracing): the one writer of it.

``process``, ``thread`` and ``span`` make its events, ``trace_document`` the document and
``write_trace`` the file; ``chrome_trace`` exports a Timeline with them, and
``twinpipe.overlap.fb_chrome_trace`` the parts of overlapped F&B ops.

One process per rank (pid = rank) with two threads: tid 0 "compute" (one ``X`` event per op, named
as ``str(op)``, the same name ``torch.profiler.record_function`` gives it) and tid 1 "wait / comm"
(wait slices), and, for stages that report the parts of their overlapped F&B ops, one thread per
part lane from tid 2 on ("F&B parts", "F&B comm F", "F&B comm B"). Timestamps are microseconds: measured timelines are in seconds (x 10^6);
simulated ones are in cost-model units, drawn as 1 unit = 1 ms unless ``us_per_unit`` says otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

from twinpipe import checks
from twinpipe.timeline import Slice, Timeline
from twinpipe.trace.costs import PROCESSOR_KEYS

__all__ = ["chrome_trace", "write_chrome_trace", "COMPUTE_TID", "WAIT_TID",
           "process", "thread", "span", "trace_document", "write_trace"]

COMPUTE_TID, WAIT_TID, PART_TID = 0, 1, 2


def process(pid: int, name: str, sort_index: int | None = None) -> list[dict]:
    """Metadata events naming process ``pid`` (and placing it at ``sort_index``)."""
    events = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}]
    if sort_index is not None:
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": sort_index}})
    return events


def thread(pid: int, tid: int, name: str) -> dict:
    """The metadata event naming thread ``tid`` of process ``pid``."""
    return {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def span(name: str, cat: str, start_us: float, end_us: float, pid: int, tid: int, args: dict) -> dict:
    """A complete (``X``) event from ``start_us`` to ``end_us``. The ends are rounded, not the duration:
    rounding is monotone, so slices that touch never overlap."""
    ts, end = round(start_us, 3), round(end_us, 3)
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": round(end - ts, 3), "pid": pid, "tid": tid, "args": args}


def trace_document(events: list[dict], other: dict | None = None) -> dict:
    """The JSON document: ``{"traceEvents": events, "displayTimeUnit": "ms"[, "otherData": other]}``."""
    document = {"traceEvents": events, "displayTimeUnit": "ms"}
    if other is not None:
        document["otherData"] = other
    return document


def write_trace(document: dict, path: str | Path) -> Path:
    """Write a trace document to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))
    return path


def _us_per_unit(timeline: Timeline, us_per_unit: float | None) -> float:
    if us_per_unit is not None:
        return checks.check_float(us_per_unit, "us_per_unit", low=0, low_open=True)
    measured = timeline.source == "measured" or timeline.meta.get("time_unit") == "s"
    return 1e6 if measured else 1e3


def _args(s: Slice, timeline: Timeline) -> dict:
    if s.op is None:
        return {"label": s.label} if s.label else {}
    placement, op = timeline.placement, s.op
    chain = (lambda stage: placement.chain_of_stage(stage)) if placement is not None else (lambda stage: 0)
    args = {"kind": op.kind.value, "stage": op.stage, "microbatch": op.microbatch, "chain": chain(op.stage)}
    if op.backward is not None:
        args.update(backward_stage=op.backward.stage, backward_microbatch=op.backward.microbatch, backward_chain=chain(op.backward.stage))
    return args


def chrome_trace(timeline: Timeline, us_per_unit: float | None = None) -> dict:
    """The trace as a JSON-ready dict: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``."""
    scale = _us_per_unit(timeline, us_per_unit)
    events: list[dict] = []
    for rank in range(timeline.num_ranks):
        events += [*process(rank, f"rank {rank}", rank), thread(rank, COMPUTE_TID, "compute"), thread(rank, WAIT_TID, "wait / comm")]
    for s in sorted(timeline.slices, key=lambda s: (s.rank, s.op is None, s.start)):
        events.append(span(str(s.op) if s.op is not None else (s.label or "wait"), s.op.kind.value if s.op is not None else "wait",
                           s.start * scale, s.end * scale, s.rank, COMPUTE_TID if s.op is not None else WAIT_TID,
                           _args(s, timeline)))
    # Parts of overlapped F&B ops (measured runs of stages that report them): one lane each.
    lanes = sorted({lane for _, lane, _, _, _ in timeline.meta.get("parts", ())})
    for rank, lane, label, start, end in timeline.meta.get("parts", ()):
        events.append(span(label, "part", start * scale, end * scale, rank, PART_TID + lanes.index(lane), {"lane": lane}))
    for rank in sorted({p[0] for p in timeline.meta.get("parts", ())}):
        events += [thread(rank, PART_TID + i, f"F&B {lane}") for i, lane in enumerate(lanes)]
    other = {
        "schedule": timeline.name, "source": timeline.source, "ranks": timeline.num_ranks,
        "microbatches": timeline.num_microbatches, "bubble_rate": timeline.bubble_rate,
        "makespan": timeline.makespan, "us_per_time_unit": scale,
    }
    if timeline.peak_activation:
        other["peak_activation"] = list(timeline.peak_activation)
    if timeline.meta.get("options"):
        other["options"] = timeline.meta["options"]  # how the schedule was built: its placement depends on them
    for key in ("clock_method", "clock_error_s", *PROCESSOR_KEYS):
        if key in timeline.meta:
            other[key] = timeline.meta[key]
    return trace_document(events, other)


def write_chrome_trace(timeline: Timeline, path: str | Path, us_per_unit: float | None = None) -> Path:
    """Write ``chrome_trace(timeline)`` to ``path`` (parents created); returns the path."""
    return write_trace(chrome_trace(timeline, us_per_unit), path)
