"""Turn the per-rank traces of a real ``Pipeline.step(trace=True)`` into one measured Timeline."""

from __future__ import annotations

import os
import socket

from twinpipe.schedule.lower import forward_only
from twinpipe.schedule.ops import parse_op
from twinpipe.timeline import Slice, Timeline
from twinpipe.trace.clock import estimate_offsets
from twinpipe.trace.costs import PROCESSOR_KEYS

__all__ = ["gather_timeline", "build_timeline"]


def gather_timeline(pipeline, num_chunks: int, name: str | None = None, rounds: int = 16, timeout: float | None = None) -> Timeline | None:
    """Collective: every rank of ``pipeline.group`` calls it after ``step(..., trace=True)``.

    Gathers each rank's ``last_trace`` (and peak live activations) to the rank running pipeline
    rank 0, which returns a measured Timeline (seconds, first slice at 0); the others return None.
    Clocks are aligned by a ping-pong against pipeline rank 0 (``rounds`` round trips per rank,
    the shortest kept): each rank's error is at most half that round trip, recorded in
    ``meta["clock_error_s"]`` (0.1-2 ms over gloo on a busy 2-core host). Every wait is bounded by
    ``timeout`` (default: the pipeline's); ranks that disagree on ``num_chunks``, or that have no
    trace, raise on every rank.
    """
    from twinpipe.runtime.collectives import checked_timeout, cpu_group, release_cpu_group

    timeout = pipeline.timeout if timeout is None else checked_timeout(timeout)
    group = cpu_group(pipeline.group, timeout)  # the pipeline's own, or one shared (given back below)
    try:
        return _gather_timeline(pipeline, group, num_chunks, name, rounds, timeout)
    finally:
        release_cpu_group(group)


def _gather_timeline(pipeline, group, num_chunks, name, rounds, timeout) -> Timeline | None:
    import pickle

    import torch
    import torch.distributed as dist

    from twinpipe.runtime.collectives import Gathering, gather_objects
    from twinpipe.runtime.errors import PipelineMismatchError

    where = f"rank {pipeline.rank}: gather_timeline"
    payload = pickle.dumps((pipeline.rank, pipeline.last_trace, pipeline.last_peak_live, _processors()))
    mine = ["gather_timeline", pipeline.rank, num_chunks if isinstance(num_chunks, int) else repr(num_chunks),
            pipeline.last_trace is not None, len(payload)]
    said = gather_objects(group, mine, timeout, f"{where}: waiting for every rank to call it")
    if any(not isinstance(s, list) or len(s) != len(mine) or s[0] != mine[0] for s in said):
        raise PipelineMismatchError(f"{where}: another rank runs a different collective on this process group now; "
                                    "every rank must call gather_timeline after the same traced step")
    untraced = sorted(s[1] for s in said if not s[3])
    if untraced:
        raise ValueError(f"{where}: rank(s) {', '.join(map(str, untraced))} have no trace: call pipeline.step(..., trace=True) "
                         "on every rank first")
    chunks = {s[2] for s in said}
    if len(chunks) > 1:
        raise ValueError(f"{where}: ranks disagree on num_chunks ({'; '.join(f'rank {s[1]}: {s[2]}' for s in said)})")
    reference = pipeline.global_rank_of[0]
    peers = [pipeline.global_rank_of[r] for r in range(1, pipeline.num_ranks)]
    offsets = estimate_offsets(group, reference, peers, None, rounds, timeout=timeout)
    frame = torch.zeros(max(s[4] for s in said), dtype=torch.uint8)
    frame[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = Gathering(group, frame, timeout, f"{where}: gathering the ranks' traces").result()
    if dist.get_rank() != reference:
        return None
    traces, peaks, clock, processors = {}, {}, {}, {}
    for part in parts:
        pp_rank, events, peak, where_ran = pickle.loads(part.numpy().tobytes())
        traces[pp_rank], peaks[pp_rank], processors[pp_rank] = events, peak, where_ran
        clock[pp_rank] = offsets.get(pipeline.global_rank_of[pp_rank], (0.0, 0.0))
    schedule = pipeline.schedule_for(num_chunks)
    timeline = build_timeline(traces, schedule, name=name, offsets={r: o for r, (o, _) in clock.items()})
    expected = (schedule, forward_only(schedule))
    for rank in range(schedule.num_ranks):
        counts = {len(s.ops[rank]) for s in expected}
        if len(timeline.compute_slices(rank)) not in counts:
            raise ValueError(f"num_chunks={num_chunks!r}: rank {rank} traced {len(timeline.compute_slices(rank))} ops, the schedule has {len(schedule.ops[rank])}")
    timeline.peak_activation = tuple(float(peaks[r]) for r in range(schedule.num_ranks))
    timeline.meta.update(
        clock_method="ping-pong against pipeline rank 0",
        clock_offset_s=[clock[r][0] for r in range(schedule.num_ranks)],
        clock_error_s=[clock[r][1] for r in range(schedule.num_ranks)],
        **{key: [processors[r][key] for r in range(schedule.num_ranks)] for key in PROCESSOR_KEYS},
    )
    return timeline


def _processors() -> dict:
    """This rank's host, the cores it may run on and torch's intra-op threads (see ``trace.costs.shared_cores``)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"hosts": socket.gethostname(), "cores": cores, "threads": torch.get_num_threads()}


def build_timeline(traces: dict[int, list], schedule, name: str | None = None, offsets: dict[int, float] | None = None) -> Timeline:
    """A measured Timeline from per-rank ``(kind, label, start, end)`` lists (``Pipeline.last_trace``).

    ``offsets[rank]`` is subtracted from that rank's times; then all times are shifted so that
    the earliest slice starts at 0. Compute slices carry parsed Ops, wait slices ``op=None``;
    events of kind ``"part:LANE"`` (the parts of overlapped F&B ops) go to ``meta["parts"]``.
    """
    offsets = offsets or {}
    origin = min((start - offsets.get(r, 0.0) for r, events in traces.items() for _, _, start, _ in events), default=0.0)
    slices, parts = [], []
    for rank, events in sorted(traces.items()):
        shift = offsets.get(rank, 0.0) + origin
        for kind, label, start, end in events:
            if kind.startswith("part:"):  # a part of an overlapped F&B op, on a lane of its own
                parts.append([rank, kind[len("part:"):], label, start - shift, end - shift])
                continue
            op = parse_op(label) if kind == "compute" else None
            slices.append(Slice(rank, start - shift, end - shift, op, label))
    meta = {"time_unit": "s", "schedule": schedule.name, "options": dict(schedule.options)}
    if parts:
        meta["parts"] = parts  # [rank, lane, label, start, end]: compute parts and comm in flight
    return Timeline(name or schedule.name, schedule.num_ranks, schedule.num_microbatches, slices, placement=schedule.placement, source="measured", meta=meta)
