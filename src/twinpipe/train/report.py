"""What a training run shows at the end: a loss-curve picture and a summary table."""

from __future__ import annotations

import math
import statistics
from typing import Sequence

__all__ = ["bits_per_byte", "plot_losses", "summary_rows", "memory_rows", "print_summary"]


def bits_per_byte(loss_nats: float) -> float:
    return loss_nats / math.log(2)


def plot_losses(steps: Sequence[int], losses: Sequence[float], path: str, title: str, *, unit: str = "byte",
                vocab: int = 256, held_out: Sequence[tuple[int, float]] = ()) -> None:
    """Training loss (bits per ``unit``: a byte, or a token of a ``vocab``-word vocabulary) per step,
    with a 10-step running mean, and the ``held_out`` losses ``(steps trained, loss)`` when given,
    saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bpb = [bits_per_byte(v) for v in losses]
    window = 10
    smooth = [statistics.fmean(bpb[max(0, i - window + 1) : i + 1]) for i in range(len(bpb))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, bpb, color="#9ecae1", linewidth=1, label="loss per step")
    ax.plot(steps, smooth, color="#08519c", linewidth=2, label=f"mean of the last {window} steps")
    if held_out:
        ax.plot([s for s, _ in held_out], [bits_per_byte(v) for _, v in held_out], color="#d94801", linewidth=2, marker="o",
                markersize=4, label="held-out loss (--eval-data)")
    ax.axhline(math.log2(vocab), color="#999999", linestyle=":", linewidth=1,
               label=f"uniform over {vocab} {unit}s ({math.log2(vocab):.3g} bits)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{'loss' if held_out else 'training loss'} (bits per {unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summary_rows(losses: Sequence[float], step_times: dict[str, list[float]], tokens_per_step: int, *,
                 mirrored: bool = True, replicas: int = 2, unit: str = "byte") -> list[tuple[str, str]]:
    """(label, value) rows: bits per ``unit`` (byte or token) at the start and end, throughput and where time went
    (the mirrored exchange only with two model copies, the all-reduce only with replicas)."""
    head = losses[: min(10, len(losses))]
    tail = losses[-min(10, len(losses)) :]
    total = step_times["total"]
    median = statistics.median(total)
    rows = [
        (f"bits per {unit}, first step", f"{bits_per_byte(losses[0]):.3f}"),
        (f"bits per {unit}, mean of first {len(head)} steps", f"{bits_per_byte(statistics.fmean(head)):.3f}"),
        (f"bits per {unit}, mean of last {len(tail)} steps", f"{bits_per_byte(statistics.fmean(tail)):.3f}"),
        ("tokens per step", f"{tokens_per_step}"),
        ("tokens/s (median step)", f"{tokens_per_step / median:,.0f}"),
        ("step time, median", f"{median * 1e3:.1f} ms"),
    ]
    for part, label in (("pipeline", "pipeline step()"), ("mirror", "mirrored-copy exchange"),
                        ("dp", "data-parallel all-reduce"), ("update", "norms, losses, clipping, optimizer")):
        if (part == "mirror" and not mirrored) or (part == "dp" and replicas < 2):
            continue
        rows.append((f"  {label}", f"{statistics.median(step_times[part]) * 1e3:.2f} ms"))
    return rows


def memory_rows(entries) -> list[tuple[str, str]]:
    """(label, value) rows: per rank, the activation peak and the total, measured / predicted
    (``twinpipe.sim.memory.RankMemory`` entries)."""
    from twinpipe.sim.memory import format_bytes

    rows = []
    for e in entries:
        m, p = e.measured, e.predicted
        rows.append((f"memory, rank {e.rank} (pp {e.pp_rank}, dp {e.dp_rank})",
                     f"activations {format_bytes(m.activations_peak)} / {format_bytes(p.activations_peak)} predicted, "
                     f"total {format_bytes(m.total)} / {format_bytes(p.total)}"))
    return rows


def print_summary(title: str, rows: list[tuple[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("")
    table.add_column("value", justify="right")
    for label, value in rows:
        table.add_row(label, value)
    Console().print(table)
