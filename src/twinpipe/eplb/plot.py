"""Draw per-GPU loads before (no EPLB) and after a placement. matplotlib is imported lazily."""

from __future__ import annotations

from pathlib import Path

from .report import BalanceReport

_MAX_BAR_LAYERS = 4


def plot_balance(report: BalanceReport, path: str | Path, layers: list[int] | None = None) -> Path:
    """Write a PNG (or any format matplotlib knows from the suffix) and return its path.

    One bar chart per layer in ``layers`` (default: all layers when there are at most four, else the
    layer worst balanced after EPLB), with the mean load dashed and node boundaries dotted. With more
    than four layers a last panel shows max/mean per layer before and after.
    """
    # The Agg canvas directly, not pyplot: no global backend switch, no figure registry.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    num_layers, num_gpus = report.gpu_loads_after.shape
    if layers is None:
        layers = list(range(num_layers)) if num_layers <= _MAX_BAR_LAYERS else [report.gpu_after.worst_layer]
    for layer in layers:
        if not 0 <= layer < num_layers:
            raise ValueError(f"layers contains {layer}; allowed: 0 <= layer < {num_layers}")
    show_ratios = num_layers > _MAX_BAR_LAYERS
    panels = len(layers) + int(show_ratios)
    fig = Figure(figsize=(max(6.0, 0.32 * num_gpus + 2), 2.6 * panels))
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, squeeze=False)
    gpus = range(num_gpus)
    width = 0.4
    for ax, layer in zip(axes[:, 0], layers):
        before = report.gpu_loads_before[layer].tolist()
        after = report.gpu_loads_after[layer].tolist()
        ax.bar([g - width / 2 for g in gpus], before, width, color="#bbbbbb", label="before (no EPLB)")
        ax.bar([g + width / 2 for g in gpus], after, width, color="#3b75af", label="after")
        ax.axhline(sum(after) / num_gpus, color="black", linestyle="--", linewidth=0.8, label="mean")
        if report.num_nodes > 1 and num_gpus % report.num_nodes == 0:
            per_node = num_gpus // report.num_nodes
            for boundary in range(per_node, num_gpus, per_node):
                ax.axvline(boundary - 0.5, color="gray", linestyle=":", linewidth=0.8)
        ax.set_title(
            f"layer {layer}: GPU max/mean {report.gpu_before.per_layer[layer]:.3f} (no EPLB)"
            f" -> {report.gpu_after.per_layer[layer]:.3f}",
            fontsize=10,
        )
        ax.set_ylabel("load")
        ax.set_xticks(list(gpus))
        ax.tick_params(axis="x", labelsize=7 if num_gpus > 16 else 9)
        ax.legend(fontsize=8, loc="upper right", ncols=3)
        ax.margins(y=0.25)
    axes[len(layers) - 1, 0].set_xlabel("GPU")
    if show_ratios:
        ax = axes[-1, 0]
        ax.plot(report.gpu_before.per_layer.tolist(), color="#999999", marker=".", label="before (no EPLB)")
        ax.plot(report.gpu_after.per_layer.tolist(), color="#3b75af", marker=".", label="after")
        ax.set_xlabel("layer")
        ax.set_ylabel("GPU max/mean")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path
