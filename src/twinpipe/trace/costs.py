"""From a measured Timeline to a CostModel: mean op times per stage and a message latency."""

from __future__ import annotations

import statistics
from collections import defaultdict

from twinpipe.schedule.deps import needs, work_done
from twinpipe.schedule.ops import OpKind
from twinpipe.schedule.costs import CostModel
from twinpipe.timeline import Timeline

__all__ = ["mean_op_times", "estimate_comm", "estimate_costs", "shared_cores", "alone_durations", "PROCESSOR_KEYS"]

# What a traced run records about where each rank ran (``meta[key]``: one entry per rank).
PROCESSOR_KEYS = ("hosts", "cores", "threads")


def shared_cores(timeline: Timeline) -> int | None:
    """How many ranks could compute at full speed at once, when the run had fewer than its ranks.

    All ranks on one host, each running ``threads`` torch threads on the host's ``cores``: that
    many ranks fit at once is ``cores // threads`` (at least 1). None when that covers every rank,
    when the ranks ran on several hosts (not modelled), or when the trace does not say.
    """
    meta = timeline.meta
    if not all(len(meta.get(key) or ()) == timeline.num_ranks for key in PROCESSOR_KEYS) or len(set(meta["hosts"])) != 1:
        return None
    slots = max(1, min(meta["cores"]) // max(1, max(meta["threads"])))
    return slots if slots < timeline.num_ranks else None


def alone_durations(timeline: Timeline, cores: int | None) -> list[float]:
    """Each compute slice's time had its rank had a core of its own: while k ranks computed at once
    on ``cores`` cores, each advanced at ``min(1, cores / k)`` (the simulator's rule, inverted).
    In the order of ``timeline.slices``' compute slices; their durations when ``cores`` is None."""
    compute = [s for s in timeline.slices if s.op is not None]
    if cores is None:
        return [s.duration for s in compute]
    edges = sorted([(s.start, 1) for s in compute] + [(s.end, -1) for s in compute])
    # progress[t]: integral of min(1, cores / k) from the first edge to edge time t
    progress, running, last, total = {}, 0, edges[0][0] if edges else 0.0, 0.0
    for t, step in edges:
        if running:
            total += (t - last) * min(1.0, cores / running)
        progress[t], running, last = total, running + step, t
    return [progress[s.end] - progress[s.start] for s in compute]


def mean_op_times(timeline: Timeline, cores: int | None = None) -> dict[str, dict[int, float]]:
    """``{kind: {stage: mean seconds}}`` for F, B, W, BW, FB and FB_B (an FB whose backward half is
    a B; both keyed by the forward's stage); with ``cores``, the times each op would have taken
    alone (``alone_durations``)."""
    samples: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    compute = [s for s in timeline.slices if s.op is not None]
    for s, duration in zip(compute, alone_durations(timeline, cores)):
        back = s.op.backward
        samples["FB_B" if back is not None and back.kind is OpKind.B else s.op.kind.value][s.op.stage].append(duration)
    return {kind: {stage: statistics.fmean(v) for stage, v in by_stage.items()} for kind, by_stage in samples.items()}


def estimate_comm(timeline: Timeline) -> float:
    """Median delay from a producer's end to its consumer's start, over ops that waited for it.

    The simulator starts an op ``t_comm`` after the last cross-rank op it depends on; for every op
    whose receive wait was still running when that producer finished, the gap measures exactly
    that (plus clock-alignment error). Producers that are FB ops are left out: a real FB sends its
    forward's outputs before its backward half ends, which the simulator does not model. 0.0 when
    no op waited on another rank.
    """
    placement = timeline.placement
    if placement is None:
        return 0.0
    done: dict[tuple, tuple[int, float | None]] = {}  # work item -> (rank, end or None for FB)
    for s in timeline.slices:
        if s.op is not None:
            end = None if s.op.kind is OpKind.FB else s.end
            for item in work_done(s.op):
                done[item] = (s.rank, end)
    gaps = []
    by_rank: list[list] = [[] for _ in range(timeline.num_ranks)]
    for s in timeline.slices:
        by_rank[s.rank].append(s)
    for rank, slices in enumerate(by_rank):
        slices.sort(key=lambda s: (s.start, s.op is not None))  # a wait sorts before the op it precedes
        for wait, s in zip(slices, slices[1:]):
            # The wait right before an op is its receive (measured) or its idle time (simulated).
            if s.op is None or wait.op is not None or wait.duration <= 0:
                continue
            producers = [done.get(k, (rank, 0.0)) for k in needs(placement, s.op)]
            ends = [end for r, end in producers if r != rank]
            if not ends or None in ends:
                continue
            if max(ends) > wait.start:  # the op really waited for that message
                gaps.append(max(0.0, s.start - max(ends)))
    return statistics.median(gaps) if gaps else 0.0


def estimate_costs(timeline: Timeline, comm: bool = True) -> CostModel:
    """Per-stage mean T_F, T_B, T_W, T_FB, T_FB_B (and T_comm if ``comm``) measured on ``timeline``.

    A stage that ran full backwards and no B gets T_B = its mean BW and T_W = 0 (the simulator
    charges T_B + T_W for a BW), whatever other stages ran. T_FB is keyed by its forward half's stage, and given only for the stages
    whose FB ops were measured: another stage's entry is None, so the simulator times its FB ops
    as their halves back to back (``schedule.costs``), the F at that stage and the BW at its own;
    no FB at all gives ``t_fb=None``. The same for ``t_fb_b``, from the FB ops whose backward half
    is a B. Other times missing on a stage fall back to that kind's mean over all stages. A run whose ranks shared fewer cores (``shared_cores``) gives the times of
    each op alone and ``cores``, so the simulator shares them too.
    """
    if timeline.placement is None:
        raise ValueError("timeline has no placement: cannot tell which stage each time belongs to")
    cores = shared_cores(timeline)
    means = mean_op_times(timeline, cores)
    num_stages = timeline.placement.num_stages

    def per_stage(kind: str) -> list[float | None]:
        by_stage = means.get(kind, {})
        fallback = statistics.fmean(by_stage.values()) if by_stage else None
        return [by_stage.get(s, fallback) for s in range(num_stages)]

    f, b, w, bw = (per_stage(k) for k in ("F", "B", "W", "BW"))
    own_b, own_bw = means.get("B", {}), means.get("BW", {})
    t_f, t_b, t_w = [], [], []
    for s in range(num_stages):
        t_f.append(f[s] or 0.0)
        if s not in own_b and s in own_bw:  # its own full backwards, not other stages' B
            t_b.append(own_bw[s])
            t_w.append(0.0)
        elif b[s] is not None:
            t_b.append(b[s])
            t_w.append(w[s] if w[s] is not None else max(0.0, (bw[s] or b[s]) - b[s]))  # a BW is its B and its W
        else:
            t_b.append(bw[s] or 0.0)
            t_w.append(0.0)
    pairs = {name: [means[key].get(s) for s in range(num_stages)] for name, key in (("t_fb", "FB"), ("t_fb_b", "FB_B")) if means.get(key)}
    return CostModel(t_f=t_f, t_b=t_b, t_w=t_w, t_comm=estimate_comm(timeline) if comm else 0.0, cores=cores, **pairs)
