"""Draw timelines (simulated or measured) as PNG/SVG/PDF, one row per rank, time to the right.

matplotlib is imported inside the functions (the Agg canvas, not pyplot): importing twinpipe
never pulls it in, and drawing never touches a global backend or figure registry. Cells are drawn
as a few batched compound paths, so a 64-rank x 512-micro-batch DualPipe takes a second or two;
labels and borders are left out where cells are too small to show them.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Sequence

from twinpipe import checks
from twinpipe.timeline import Timeline
from twinpipe.viz.cells import Cells, time_axis, timeline_cells
from twinpipe.viz.style import KIND_COLOURS, KIND_NAMES, WAIT_COLOUR, WAIT_EDGE, direction_names, text_colour

__all__ = ["draw_timeline", "draw_timelines", "timeline_title", "FORMATS", "MAX_DPI", "MAX_PIXELS", "MAX_SIDE"]

FORMATS = ("png", "svg", "pdf")
_EDGE = "#262626"
_MAX_LABELS = 6000  # more labels than this would be unreadable: then none are drawn
_MIN_FONT = 4.5  # points
_LEFT, _RIGHT, _TOP, _TITLE, _GAP, _XAXIS = 0.85, 0.25, 0.1, 0.32, 0.25, 0.42  # inches
_LEGEND_PAD, _LEGEND_ROW, _LEGEND_TITLE = 0.1, 0.22, 0.16  # inches
_LEGEND_FONT = 7.5  # points
_CAPTION = 0.3  # inches
_CAPTION_LINE = 0.15  # inches per further caption line
# Limits (docs/limits.md): a 36 x 10 inch picture fits at 300 dpi; an Agg canvas of 50 MP takes 200 MB.
MAX_DPI = 2400
MAX_PIXELS = 50_000_000
MAX_SIDE = 2**15


def timeline_title(timeline: Timeline) -> str:
    """Schedule, ranks, micro-batches, bubble rate and peak activation memory."""
    parts = [timeline.name + (" (measured)" if timeline.source == "measured" else "")]
    parts.append(f"{timeline.num_ranks} ranks")
    parts.append(f"{timeline.num_microbatches} micro-batches")
    parts.append(f"bubble {timeline.bubble_rate:.1%}")
    if timeline.peak_activation:
        parts.append(f"peak memory {max(timeline.peak_activation):g} M_B")
    if timeline.meta.get("stage_size"):  # set by `twinpipe simulate/draw --hold model`
        parts.append(f"stage = {timeline.meta['stage_size']} of a 1F1B stage")
    return " · ".join(parts)


def draw_timeline(timeline: Timeline, path: str | Path | None = None, *, title: str | None = None, **options):
    """Draw one timeline; save it to ``path`` (format from the suffix) if given. Returns the Figure."""
    return draw_timelines([timeline], path, titles=None if title is None else [title], **options)


def _checked_timelines(timelines: Sequence[Timeline], titles: Sequence[str] | None) -> list[Timeline]:
    """``draw_timelines``' timelines as a list: at least one, and as many as ``titles`` when given."""
    timelines = list(timelines)
    if not timelines:
        raise ValueError("timelines is empty: give at least one Timeline")
    if titles is not None and len(titles) != len(timelines):
        raise ValueError(f"titles has {len(titles)} entries for {len(timelines)} timelines")
    return timelines


def draw_timelines(
    timelines: Sequence[Timeline],
    path: str | Path | None = None,
    *,
    titles: Sequence[str] | None = None,
    width: float | None = None,
    dpi: int = 100,
    labels: bool = True,
    caption: str | None = None,
):
    """Stack timelines one above the other on one time axis (for comparisons); see ``draw_timeline``.

    ``width`` is the figure width in inches (default: from the number of cells across, about 7..35);
    ``labels=False`` leaves micro-batch numbers out; ``caption`` is a line of text above the panels
    (what the timelines have in common). The picture may have at most ``MAX_PIXELS`` pixels.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    timelines = _checked_timelines(timelines, titles)
    fmt = _format_of(path) if path is not None else None
    scale, xlabel = time_axis(timelines)
    cells = [timeline_cells(t, scale) for t in timelines]
    span = max(c.span for c in cells) or 1.0
    typical = min((c.typical for c in cells if c.typical > 0), default=span)
    axes_w = width - _LEFT - _RIGHT if width else min(34.0, max(6.0, 0.24 * span / typical))
    rows = [max(1, t.num_ranks) for t in timelines]
    row_in = 0.3 if max(rows) <= 16 else max(0.11, 4.8 / max(rows))
    panel_h = [r * row_in + 0.1 for r in rows]
    fig_w = axes_w + _LEFT + _RIGHT
    legend = _legend_entries(timelines, cells)
    legend_cols, legend_rows = _legend_shape(legend, fig_w)
    legend_h = _LEGEND_PAD + legend_rows * _LEGEND_ROW + (_LEGEND_TITLE if legend[2] else 0.0)
    # The caption wraps to the figure's width (about 0.06 inch per character at 8 points).
    caption_lines = textwrap.wrap(caption, max(20, int((fig_w - _LEFT - _RIGHT) / 0.06))) if caption else []
    caption_h = _CAPTION + _CAPTION_LINE * (len(caption_lines) - 1) if caption_lines else 0.0
    height = _TOP + caption_h + sum(_TITLE + h + _XAXIS for h in panel_h) + _GAP * (len(rows) - 1) + legend_h
    _check_pixels(fig_w, height, dpi)
    fig = Figure(figsize=(fig_w, height), dpi=dpi)
    FigureCanvasAgg(fig)
    px_per_unit = axes_w * dpi / span
    top = height - _TOP
    if caption_lines:
        fig.text(_LEFT / fig_w, (top - 0.05) / height, "\n".join(caption_lines), fontsize=8, ha="left", va="top")
        top -= caption_h
    for i, (timeline, c) in enumerate(zip(timelines, cells)):
        top -= _TITLE
        bottom = top - panel_h[i]
        ax = fig.add_axes((_LEFT / fig_w, bottom / height, axes_w / fig_w, panel_h[i] / height))
        _draw_panel(ax, timeline, c, span, px_per_unit, row_in, dpi, labels)
        ax.set_title(titles[i] if titles else timeline_title(timeline), fontsize=9, loc="left", pad=4)
        ax.set_xlabel(xlabel, fontsize=8, labelpad=2)
        top = bottom - _XAXIS - _GAP
    _legend(fig, legend, legend_cols)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format=fmt, dpi=dpi)
    return fig


def _check_pixels(width_in: float, height_in: float, dpi) -> None:
    """Refuse a picture larger than MAX_PIXELS before any memory is allocated for it."""
    checks.check_float(dpi, "dpi", low=0, low_open=True, high=MAX_DPI)
    w, h = round(width_in * dpi), round(height_in * dpi)
    if w * h > MAX_PIXELS or max(w, h) > MAX_SIDE:
        raise ValueError(
            f"a {width_in:.1f} x {height_in:.1f} inch picture at dpi={dpi} is {w} x {h} pixels; at most {MAX_PIXELS:,} pixels "
            f"and {MAX_SIDE} on a side are allowed (lower the dpi or the width; see docs/limits.md)"
        )


def _format_of(path) -> str:
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise checks.bad("path", str(path), f"must end in one of {', '.join('.' + f for f in FORMATS)}")
    return suffix


def _compound(rects):
    """One Path holding many rectangles: Agg fills it in one call, SVG writes one element."""
    from matplotlib.path import Path as MplPath

    return MplPath.make_compound_path_from_polys(rects)


def _draw_panel(ax, timeline: Timeline, c: Cells, span: float, px_per_unit: float, row_in: float, dpi: int, labels: bool) -> None:
    from matplotlib.collections import LineCollection, PathCollection

    # One compound path per colour instead of one path per cell: several times faster on 10^5 cells.
    big = sum(len(v) for v in c.faces.values()) > 20000  # rasterize huge panels in SVG/PDF
    edges = c.typical * px_per_unit >= 8  # borders on narrow cells would paint them dark
    if len(c.waits):
        waits = PathCollection([_compound(c.waits)], facecolors=WAIT_COLOUR, edgecolors=WAIT_EDGE, hatch="////", linewidths=0, zorder=1)
        ax.add_collection(waits, autolim=False)
    colours = list(c.faces)
    faces = PathCollection([_compound(c.faces[k]) for k in colours], facecolors=colours, edgecolors="none", linewidths=0, zorder=2, rasterized=big)
    ax.add_collection(faces, autolim=False)
    if edges and len(c.outlines):
        outlines = PathCollection([_compound(c.outlines)], facecolors="none", edgecolors=_EDGE, linewidths=0.5, zorder=3, rasterized=big)
        ax.add_collection(outlines, autolim=False)
        if len(c.dividers):
            ax.add_collection(LineCollection(c.dividers, colors=_EDGE, linewidths=0.25, zorder=3, rasterized=big), autolim=False)
    if labels and c.typical * px_per_unit >= 6:
        _labels(ax, c, px_per_unit, row_in, dpi)
    p = max(1, timeline.num_ranks)
    ax.set_xlim(0, span * 1.003)
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top
    step = max(1, -(-p // 16))
    ax.set_yticks(range(0, p, step), [f"rank {r}" for r in range(0, p, step)], fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _labels(ax, c: Cells, px_per_unit: float, row_in: float, dpi: int) -> None:
    """Micro-batch numbers in the cells wide and tall enough for them."""
    chosen = []
    for x0, y, text, w, h, face in c.labels:
        size = min(8.0, 0.62 * h * row_in * 72)  # font size (pt) from the cell height
        if size < _MIN_FONT or w * px_per_unit < len(text) * 0.62 * size * dpi / 72 + 2:
            continue
        chosen.append((x0 + w / 2, y, text, size, face))
        if len(chosen) > _MAX_LABELS:
            return
    for x, y, text, size, face in chosen:
        ax.text(x, y, text, ha="center", va="center", fontsize=size, color=text_colour(face), zorder=4, clip_on=True)


class _FBHandle:
    """Legend stand-in for an FB pair (drawn by ``_FBHandler``)."""


def _fb_handler():
    from matplotlib.legend_handler import HandlerBase
    from matplotlib.patches import Rectangle

    class _FBHandler(HandlerBase):
        def create_artists(self, legend, handle, xd, yd, width, height, fontsize, trans):
            f = Rectangle((-xd, -yd + height / 2), width, height / 2, facecolor=KIND_COLOURS["F"][0], edgecolor="none", transform=trans)
            bw = Rectangle((-xd, -yd), width, height / 2, facecolor=KIND_COLOURS["BW"][0], edgecolor="none", transform=trans)
            border = Rectangle((-xd, -yd), width, height, facecolor="none", edgecolor=_EDGE, linewidth=0.6, transform=trans)
            return [f, bw, border]

    return _FBHandler()


def _legend_entries(timelines: list[Timeline], cells: list[Cells]) -> tuple[list, list[str], str | None]:
    """Legend handles, their names and the title explaining the two shades (if any)."""
    from matplotlib.patches import Patch

    kinds = set().union(*(c.kinds for c in cells))
    two_shades = any(len(c.shades) > 1 for c in cells)
    handles, names = [], []
    for kind in ("F", "B", "W", "BW"):
        if kind in kinds:
            light, dark = (Patch(facecolor=colour, edgecolor=_EDGE, linewidth=0.5) for colour in KIND_COLOURS[kind])
            handles.append((light, dark) if two_shades else light)
            names.append(KIND_NAMES[kind])
    if any(c.has_fb for c in cells):
        handles.append(_FBHandle())
        names.append("FB: F over B/BW (top half F, bottom half its backward)")
    if any(len(c.waits) for c in cells):
        handles.append(Patch(facecolor=WAIT_COLOUR, edgecolor=WAIT_EDGE, hatch="////", linewidth=0))
        names.append("wait for input")
    title = None
    if two_shades:
        words = next((direction_names(t.placement) for t, c in zip(timelines, cells) if len(c.shades) > 1), None)
        if words:
            title = f"light: {words[0]} · dark: {words[1]}"
    return handles, names, title


def _handle_length(handles) -> float:
    return 2.6 if any(isinstance(h, tuple) for h in handles) else 1.6


def _legend_shape(legend, fig_w: float) -> tuple[int, int]:
    """Columns and rows so that the legend fits the figure width (a rough text-width estimate)."""
    handles, names, _ = legend
    if not handles:
        return 1, 0
    em = _LEGEND_FONT / 72  # inches
    widest = max((_handle_length(handles) + 0.8 + 2.0) * em + 0.55 * em * len(n) for n in names)
    cols = max(1, min(len(handles), int(0.95 * fig_w // widest)))
    rows = -(-len(handles) // cols)
    return -(-len(handles) // rows), rows  # balanced: 3 + 3 rather than 5 + 1


def _legend(fig, legend, cols: int) -> None:
    from matplotlib.legend_handler import HandlerTuple

    handles, names, title = legend
    if not handles:
        return
    fig.legend(
        handles, names, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncols=cols, fontsize=_LEGEND_FONT,
        title=title, title_fontsize=_LEGEND_FONT, frameon=False, handlelength=_handle_length(handles),
        handler_map={tuple: HandlerTuple(ndivide=None, pad=0), _FBHandle: _fb_handler()},
    )
