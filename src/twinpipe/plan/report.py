"""The plan as a rich table (one row per schedule and pipeline size, with what limits it), as JSON-ready
dicts, and as a stacked-bar picture of each step's parts (matplotlib, imported only to draw).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from types import MappingProxyType

from twinpipe.plan.predict import GiB, Prediction

__all__ = ["as_dicts", "print_table", "draw_plan", "verdict", "memory_parts", "PARTS"]

WIDE = 240  # columns of the table when the output is not a terminal

# Parts of a step, in the order they are stacked: attribute -> legend label.
PARTS = MappingProxyType({
    "compute": "compute (busiest rank)",
    "a2a_exposed": "EP all-to-all not hidden",
    "bubble": "bubble and pipeline messages",
    "dp_all_reduce": "data-parallel all-reduce",
    "mirror_all_reduce": "all-reduce between weight copies",
})


def as_dicts(predictions: list[Prediction]) -> list[dict]:
    return [asdict(p) | {"status": p.status, "label": p.label} for p in predictions]


def _seconds(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _source(p: Prediction) -> str:
    if p.extrapolated_from is None:
        return ""
    a, b, *approx = p.extrapolated_from
    return ("~" if approx else "") + f"m={a},{b}→{p.microbatches}"


def memory_parts(p: Prediction) -> str:
    """The fullest rank's memory in GiB as weights + gradients + (FP32 masters and optimizer state) + activations peak."""
    if not p.memory:
        return "-"
    m = {k: v / GiB for k, v in p.memory.items()}
    return f"{m['params']:.1f}+{m['grads']:.1f}+{m['master'] + m['optimizer']:.1f}+{m['activations_peak']:.1f}"


def _hidden_share(p: Prediction) -> float:
    total = p.a2a_hidden + p.a2a_exposed
    return p.a2a_hidden / total if total else 0.0


def _traits(p: Prediction) -> str:
    return (f"step {_seconds(p.step_time)}, bubble {p.bubble / p.step_time:.0%} of it, all-to-all {_hidden_share(p):.0%} hidden, "
            f"{p.memory['total'] / GiB:.1f} GiB")


def verdict(predictions: list[Prediction], budget: float) -> str:
    """One line: which row wins at ``budget`` bytes per GPU and why (its bubble, the all-to-all it
    hides and its memory against the runner-up), and which rows the budget excluded."""
    at = f"at {budget / GiB:g} GiB"
    fitting = [p for p in predictions if p.fits]
    over = [p for p in predictions if not p.fits and p.why.startswith("does not fit: needs")]
    excluded = "; ".join(f"{p.label} pp={p.pp} needs {'over ' if not p.memory['activations_peak'] else ''}"
                         f"{p.memory['total'] / GiB:.1f} GiB = {memory_parts(p)}" + (f" ({p.copies} weight copies)" if p.copies > 1 else "")
                         for p in over)
    if not fitting:
        return f"{at}: nothing fits" + (f" ({excluded})" if excluded else "")
    best = fitting[0]
    line = f"{at}: {best.label} (pp {best.pp} x dp {best.dp}) wins: {_traits(best)}"
    if len(fitting) > 1:
        second = fitting[1]
        why = []
        if best.bubble / best.step_time < second.bubble / second.step_time - 0.005:
            why.append("a smaller bubble")
        if _hidden_share(best) > _hidden_share(second) + 0.005:
            why.append("more all-to-all hidden")
        if best.dp_all_reduce + best.mirror_all_reduce < second.dp_all_reduce + second.mirror_all_reduce:
            why.append("less gradient all-reduce")
        because = " and ".join(why) if why else "less compute on its busiest rank"
        ahead = best.tokens_per_s / second.tokens_per_s if second.tokens_per_s else second.step_time / best.step_time
        line += (f"; {ahead - 1:.0%} ahead of {second.label} (pp {second.pp}) by {because}"
                 f" ({_traits(second)})")
    if excluded:
        line += f"; over the budget: {excluded}"
    return line


def print_table(predictions: list[Prediction], title: str, caption: str, top: int | None = None, console=None) -> None:
    """Fitting rows first, ranked by throughput; then the others with why they do not fit."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption, show_lines=False)
    for column, justify in (("#", "right"), ("schedule", "left"), ("pp x dp", "right"), ("step", "right"), ("tokens/s", "right"),
                            ("bubble", "right"), ("a2a exposed/hidden", "right"), ("DP AR", "right"), ("copies AR", "right"),
                            ("memory GiB", "right"), ("weights+grads+opt+act", "right"), ("simulated", "right"),
                            ("what limits it", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    fitting = [p for p in predictions if p.fits]
    rest = [p for p in predictions if not p.fits]
    shown = fitting[:top] if top else fitting
    for i, p in enumerate(shown, 1):
        a2a = f"{_seconds(p.a2a_exposed)}/{_seconds(p.a2a_hidden)}" if p.a2a_exposed or p.a2a_hidden else "-"
        memory = f"{p.memory['total'] / GiB:.1f}" if p.memory else "-"
        table.add_row(str(i), p.label, f"{p.pp} x {p.dp}", _seconds(p.step_time), f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-",
                      f"{p.bubble / p.step_time:.1%}" if p.step_time else "-", a2a, _seconds(p.dp_all_reduce) if p.dp_all_reduce else "-",
                      _seconds(p.mirror_all_reduce) if p.copies > 1 and p.memory else "-", memory, memory_parts(p), _source(p),
                      p.limit)
    for p in rest:
        table.add_row("-", p.label, f"{p.pp} x {p.dp}", "", "", "", "", "", "", "", memory_parts(p), _source(p), p.why, style="dim")
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or redirected: rich would fold every cell to 80 columns
            console = Console(width=WIDE)
    console.print(table)


def draw_plan(predictions: list[Prediction], path: str | Path, title: str, top: int = 20) -> Path:
    """Horizontal stacked bars of the ``top`` fitting predictions' step parts, fastest on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [p for p in predictions if p.fits][:top]
    if not rows:
        raise ValueError("nothing fits: no picture to draw (see the table for why)")
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.32 * len(rows)))
    labels = [f"{p.label}  pp={p.pp}" for p in rows]
    left = [0.0] * len(rows)
    colors = ("#4c72b0", "#dd8452", "#c0c0c0", "#55a868", "#c44e52")
    for (attr, label), color in zip(PARTS.items(), colors):
        widths = [getattr(p, attr) for p in rows]
        ax.barh(range(len(rows)), widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("predicted step time (s)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
