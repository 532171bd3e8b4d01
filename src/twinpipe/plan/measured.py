"""Op times from a traced run (``twinpipe demo --trace DIR`` writes DIR/trace.json) as planner costs.

The Chrome trace is read back into a measured Timeline; ``trace.costs.estimate_costs`` gives the
per-stage means; dividing each by its stage's share of the model (``sim.costs.stage_sizes``) gives
the times of one 1F1B stage at the traced pipeline size, which ``sim.costs.for_model`` scales to
any schedule. At another pipeline size p' the stage holds p/p' as much model: times scale by that.
A schedule on the traced placement itself (the traced one, or another on the same stages) keeps
the per-stage means: the stage that computes the loss is slower than the others.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import KW_ONLY, dataclass, replace
from pathlib import Path

from twinpipe.schedule.spec import resolve
from twinpipe.schedule.ops import parse_op
from twinpipe.sim.costs import CostModel, stage_sizes
from twinpipe.timeline import Slice, Timeline
from twinpipe.trace.chrome import COMPUTE_TID
from twinpipe.trace.costs import PROCESSOR_KEYS, estimate_costs

__all__ = ["Traced", "read_trace", "traced_costs", "load_traced"]


@dataclass(frozen=True)
class Traced:
    """A traced run: its measured timeline and the times of one of its 1F1B stages (seconds)."""

    timeline: Timeline
    schedule: str
    pp: int
    microbatches: int
    costs: CostModel  # one 1F1B stage at pipeline size ``pp``
    _: KW_ONLY
    split_assumed: bool = False  # the run had only full backwards: T_B = T_W = half of one
    per_stage: CostModel | None = None  # the traced schedule's own per-stage means

    def costs_for(self, name: str, pp: int, options: dict | None = None) -> CostModel:
        """The traced per-stage times for a schedule (with ``options``) on the traced placement, else ``costs_at(pp)``."""
        placement = self.timeline.placement
        if self.per_stage is not None and pp == self.pp:
            other = resolve(name, pp, **(options or {})).placement
            if (other.stage_ranks, other.chains) == (placement.stage_ranks, placement.chains):
                return self.per_stage
        return self.costs_at(pp)

    def costs_at(self, pp: int) -> CostModel:
        """The 1F1B-stage costs at pipeline size ``pp``: the model's share per stage scales by self.pp / pp."""
        k = self.pp / pp
        c = self.costs
        return replace(c, t_f=c.t_f * k, t_b=c.t_b * k, t_w=c.t_w * k, **{name: None if getattr(c, name) is None else getattr(c, name) * k
                                                                           for name in ("t_fb", "t_fb_b")})


def read_trace(path: str | Path) -> Timeline:
    """The measured Timeline of a trace.json written by ``trace.write_chrome_trace`` (times in seconds)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        other, events = data["otherData"], data["traceEvents"]
        name, ranks, m = other["schedule"], int(other["ranks"]), int(other["microbatches"])
        scale = float(other.get("us_per_time_unit", 1e6))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"trace={str(path)!r}: not a twinpipe Chrome trace ({type(error).__name__}: {error})") from None
    schedule = name.removesuffix(" (predicted)")
    options = other.get("options") or {}
    try:
        placement = resolve(schedule, ranks, **options).placement
    except (ValueError, TypeError) as error:
        raise ValueError(f"trace={str(path)!r}: schedule {schedule!r} with options {options} on {ranks} ranks: {error}") from None
    slices = []
    for e in events:
        if e.get("ph") != "X":
            continue
        start, end = e["ts"] / scale, (e["ts"] + e["dur"]) / scale
        op = parse_op(e["name"]) if e.get("tid") == COMPUTE_TID else None
        slices.append(Slice(int(e["pid"]), start, end, op, "" if op else e["name"]))
    for piece in slices:
        if piece.op is not None and any(part.stage >= placement.num_stages or placement.rank_of(part.stage) != piece.rank
                                        for part in piece.op.parts()):
            raise ValueError(f"trace={str(path)!r}: op {piece.op} on rank {piece.rank} does not match {schedule}'s placement "
                             f"on {ranks} ranks with options {options} (was it run with other options?)")
    meta = {"time_unit": "s", "options": options, **{key: other[key] for key in PROCESSOR_KEYS if key in other}}
    return Timeline(schedule, ranks, m, slices, placement=placement, source="measured", meta=meta)


def traced_costs(timeline: Timeline) -> tuple[CostModel, bool]:
    """Per-1F1B-stage op times from a measured timeline: each stage's mean divided by its share of the model.

    A run with only full backwards (1F1B, GPipe) cannot tell T_B from T_W: the full backward is
    split in halves (input and weight gradients cost the same matrix products), and the second
    value returned is True. The traced schedule's own prediction does not depend on the split.
    """
    per_stage = estimate_costs(timeline)
    sizes = [float(s) for s in stage_sizes(timeline.placement)]
    n = len(sizes)

    def one(value) -> float | None:
        values = value if isinstance(value, (list, tuple)) else [value] * n
        given = [v / size for v, size in zip(values, sizes) if v is not None]  # T_FB: only the stages that ran one
        return statistics.fmean(given) if given else None

    t_b, t_w = one(per_stage.t_b), one(per_stage.t_w)
    split = t_w == 0 and t_b > 0
    if split:
        t_b = t_w = t_b / 2
    pairs = {name: None if getattr(per_stage, name) is None else one(getattr(per_stage, name)) for name in ("t_fb", "t_fb_b")}
    return replace(per_stage, t_f=one(per_stage.t_f), t_b=t_b, t_w=t_w, **pairs), split


def load_traced(path: str | Path) -> Traced:
    """``read_trace`` and ``traced_costs`` in one."""
    timeline = read_trace(path)
    costs, split = traced_costs(timeline)
    per_stage = estimate_costs(timeline)
    if split:  # the same halves as traced_costs, so that schedules with a separate W can run on these times
        halves = [b / 2 for b in per_stage.t_b]
        per_stage = replace(per_stage, t_b=halves, t_w=halves)
    return Traced(timeline, timeline.name, timeline.num_ranks, timeline.num_microbatches, costs,
                  split_assumed=split, per_stage=per_stage)
