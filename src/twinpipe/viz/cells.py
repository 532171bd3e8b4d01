"""Timeline -> rectangles, colours and labels in data coordinates (no drawing here).

Row ``r`` is rank ``r``; it spans ``r - ROW/2 .. r + ROW/2`` (the axis is inverted so rank 0 is on
top). An FB op becomes two half-height cells, F on top and BW below, inside one shared outline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twinpipe.schedule.ops import OpKind
from twinpipe.timeline import Timeline
from twinpipe.viz.style import KIND_COLOURS, direction

__all__ = ["Cells", "ROW", "WAIT_ROW", "time_axis", "timeline_cells"]

ROW = 0.8  # height of an op cell, in rows
WAIT_ROW = 0.36  # height of the hatched band of a wait slice


@dataclass(kw_only=True)
class Cells:
    """Everything one timeline panel draws, as arrays ready for matplotlib collections."""

    faces: dict[str, np.ndarray]  # colour -> (n, 4, 2) filled cells of that colour (FB halves included)
    outlines: np.ndarray  # (k, 4, 2) one outline per compute op (an FB pair shares one)
    dividers: np.ndarray  # (d, 2, 2) the line between the halves of an FB pair
    waits: np.ndarray  # (w, 4, 2) wait slices
    labels: list[tuple[float, float, str, float, float, str]] = field(default_factory=list)  # x, y, text, width, height, face
    kinds: set[str] = field(default_factory=set)  # simple kinds present (F, B, W, BW)
    shades: set[int] = field(default_factory=set)  # directions present (0, 1)
    has_fb: bool = False
    span: float = 0.0  # rightmost end, after shifting the first slice to 0
    typical: float = 0.0  # median compute-cell width (time)


def time_axis(timelines: list[Timeline]) -> tuple[float, str]:
    """Factor from timeline time to axis time, and the axis label (seconds are shown as ms)."""
    if any(t.source == "measured" or t.meta.get("time_unit") == "s" for t in timelines):
        return 1e3, "time (ms)"
    return 1.0, "time (cost-model units)"


def _rects(x0: np.ndarray, x1: np.ndarray, y0: np.ndarray, y1: np.ndarray) -> np.ndarray:
    return np.stack([np.stack([x0, y0], -1), np.stack([x0, y1], -1), np.stack([x1, y1], -1), np.stack([x1, y0], -1)], 1)


def timeline_cells(timeline: Timeline, scale: float = 1.0) -> Cells:
    """Cells of ``timeline`` with times shifted so its first slice starts at 0, then scaled."""
    placement = timeline.placement
    origin = min((s.start for s in timeline.slices), default=0.0)
    half = ROW / 2
    num_stages = placement.num_stages if placement is not None else 1 + max((p.stage for s in timeline.slices if s.op for p in s.op.parts()), default=0)
    shade_of = [direction(placement, stage) for stage in range(num_stages)]
    face_rows: dict[str, list] = {}
    outline_rows, dividers, wait_rows, labels = [], [], [], []
    kinds, shades, widths = set(), set(), []
    has_fb = False
    for s in timeline.slices:
        x0, x1 = (s.start - origin) * scale, (s.end - origin) * scale
        r = s.rank
        if s.op is None:
            wait_rows.append((x0, x1, r - WAIT_ROW / 2, r + WAIT_ROW / 2))
            continue
        op = s.op
        widths.append(x1 - x0)
        outline_rows.append((x0, x1, r - half, r + half))
        if op.kind is OpKind.FB:
            has_fb = True
            back = op.backward
            for part, y0, y1 in ((op.forward, r - half, r), (back, r, r + half)):
                shade = shade_of[part.stage]
                colour = KIND_COLOURS[part.kind.value][shade]
                face_rows.setdefault(colour, []).append((x0, x1, y0, y1))
                labels.append((x0, (y0 + y1) / 2, str(part.microbatch), x1 - x0, half, colour))
                kinds.add(part.kind.value)
                shades.add(shade)
            dividers.append(((x0, r), (x1, r)))
        else:
            shade = shade_of[op.stage]
            colour = KIND_COLOURS[op.kind.value][shade]
            face_rows.setdefault(colour, []).append((x0, x1, r - half, r + half))
            labels.append((x0, float(r), str(op.microbatch), x1 - x0, ROW, colour))
            kinds.add(op.kind.value)
            shades.add(shade)

    def as_rects(rows) -> np.ndarray:
        if not rows:
            return np.zeros((0, 4, 2))
        a = np.asarray(rows, dtype=float)
        return _rects(a[:, 0], a[:, 1], a[:, 2], a[:, 3])

    span = max(((s.end - origin) * scale for s in timeline.slices), default=0.0)
    return Cells(
        faces={colour: as_rects(rows) for colour, rows in face_rows.items()},
        outlines=as_rects(outline_rows),
        dividers=np.asarray(dividers, dtype=float).reshape(-1, 2, 2),
        waits=as_rects(wait_rows),
        labels=labels,
        kinds=kinds,
        shades=shades,
        has_fb=has_fb,
        span=span,
        typical=float(np.median(widths)) if widths else 0.0,
    )
