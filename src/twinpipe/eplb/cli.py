"""``twinpipe eplb``: place replicas for a loads file, print the placement and the balance.

The top-level CLI wires it with ``add_eplb_parser(subparsers)``; ``run_eplb(args)`` returns the exit
code (2 for bad input, with a message naming the argument). rich and matplotlib load lazily.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import MappingProxyType

import twinpipe.cli_options as cli_options

from .checks import EplbArgumentError

# Library parameter -> the command-line argument that feeds it.
_FLAGS = MappingProxyType({
    "weight": "LOADS",
    "loads": "LOADS",
    "num_replicas": "--replicas",
    "num_groups": "--groups",
    "num_nodes": "--nodes",
    "num_gpus": "--gpus",
    "distinct_per_gpu": "--distinct",
    "refine": "--refine",
    "previous_phy2log": "--previous",
    "plot": "--plot",
})

# Print the per-GPU placement only when it fits on a screen.
_MAX_SHOWN_LAYERS = 8
_MAX_SHOWN_GPUS = 16


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an int >= 1") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def add_eplb_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``eplb`` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "eplb",
        help="balance MoE expert replicas across GPUs (DeepSeek EPLB)",
        description="Replicate and place MoE experts on GPUs from per-layer expert loads "
        "(hierarchical policy when --nodes divides --groups, else global), then report "
        "GPU max/mean load before (no EPLB: experts split contiguously, no copies) and after.",
    )
    parser.add_argument("loads", metavar="LOADS", help=".csv, .json or .pt file of [layers, experts] loads")
    parser.add_argument("--replicas", type=_positive_int, required=True, metavar="R", help="physical experts per layer")
    parser.add_argument("--groups", type=_positive_int, required=True, metavar="G", help="expert groups")
    parser.add_argument("--nodes", type=_positive_int, required=True, metavar="N", help="server nodes")
    cli_options.add(parser, "gpus", type=_positive_int, required=True, metavar="P")
    parser.add_argument("--refine", action="store_true", help="local search after the greedy (lower max load)")
    parser.add_argument("--distinct", action="store_true", help="never two replicas of one expert on a GPU")
    parser.add_argument(
        "--previous", metavar="FILE", help="current phy2log [layers, R] (.csv/.json/.pt): keep replicas in place"
    )
    cli_options.add(parser, "json")
    cli_options.add(parser, "plot", more="per-GPU loads before and after (e.g. .png)")
    parser.set_defaults(func=run_eplb)
    return parser


def run_eplb(args: argparse.Namespace) -> int:
    """Run the subcommand; 0 on success, 2 on bad input."""
    from . import rebalance_experts
    from .io import read_table
    from .migrate import replicas_to_move
    from .report import balance_report

    try:
        weight = read_table(args.loads, "loads")
        previous = read_table(args.previous, "previous_phy2log") if args.previous else None
        hierarchical = args.groups % args.nodes == 0
        layout = (weight, args.replicas, args.groups, args.nodes, args.gpus)
        options = dict(refine=args.refine, distinct_per_gpu=args.distinct)
        phy2log, log2phy, logcnt = rebalance_experts(*layout, **options, previous_phy2log=previous)
        report = balance_report(weight, phy2log, args.gpus, args.nodes if hierarchical else 1)
        plot_path = _plot(report, args.plot) if args.plot else None
    except EplbArgumentError as exc:
        print(f"twinpipe eplb: error: argument {_FLAGS.get(exc.argument, exc.argument)}: {exc}", file=sys.stderr)
        return 2
    moves = None
    if previous is not None:
        unaligned = rebalance_experts(*layout, **options)[0]
        moves = {
            "replicas_to_move": replicas_to_move(previous, phy2log, args.gpus),
            "without_previous": replicas_to_move(previous, unaligned, args.gpus),
        }
    if args.json:
        out = {
            "policy": "hierarchical" if hierarchical else "global",
            "phy2log": phy2log.tolist(),
            "log2phy": log2phy.tolist(),
            "logcnt": logcnt.tolist(),
            "balance": report.to_dict(),
        }
        if moves:
            out["migration"] = moves
        if plot_path:
            out["plot"] = str(plot_path)
        print(json.dumps(out))
        return 0
    _print_tables(args, hierarchical, phy2log, logcnt, report, moves, plot_path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m twinpipe.eplb.cli LOADS --replicas ...``."""
    parser = argparse.ArgumentParser(prog="twinpipe")
    add_eplb_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eplb", *(sys.argv[1:] if argv is None else argv)])
    return run_eplb(args)


def _plot(report, path):
    from pathlib import Path

    from .plot import plot_balance

    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # as `twinpipe draw --out` and `plan --plot` do
        return plot_balance(report, path)
    except (OSError, ValueError) as exc:
        raise EplbArgumentError("plot", f"cannot write the plot to {path!r}: {exc}") from None


def _print_tables(args, hierarchical, phy2log, logcnt, report, moves, plot_path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    num_layers, num_replicas = phy2log.shape
    num_experts = logcnt.size(1)
    slots = num_replicas // args.gpus
    per_gpu = phy2log.view(num_layers, args.gpus, slots)
    duplicates = int((per_gpu.sort(dim=-1).values.diff(dim=-1) == 0).any(dim=-1).sum())

    summary = Table(title="EPLB placement", show_header=False)
    summary.add_column(style="bold")
    summary.add_column()
    policy = (
        f"hierarchical ({args.groups} groups -> {args.nodes} nodes -> {args.gpus} GPUs)"
        if hierarchical
        else f"global ({args.nodes} nodes do not divide {args.groups} groups)"
    )
    summary.add_row("loads", f"{num_layers} layers x {num_experts} experts")
    summary.add_row("policy", policy)
    summary.add_row("replicas", f"{num_replicas} per layer ({slots} per GPU, {num_replicas - num_experts} copies)")
    summary.add_row("max replicas/expert", str(int(logcnt.max())))
    summary.add_row("duplicates", f"{duplicates} of {num_layers * args.gpus} (layer, GPU) pairs")
    flags = (("refine", args.refine), ("distinct", args.distinct), ("previous", bool(args.previous)))
    options = [name for name, on in flags if on]
    summary.add_row("options", ", ".join(options) or "none (reference greedy)")
    if moves:
        summary.add_row(
            "replicas to move",
            f"{moves['replicas_to_move']} (plain placement: {moves['without_previous']})",
        )
    console.print(summary)

    if num_layers <= _MAX_SHOWN_LAYERS and args.gpus <= _MAX_SHOWN_GPUS:
        placement = Table(title="Logical experts on each GPU (slot order)")
        placement.add_column("layer", justify="right")
        for gpu in range(args.gpus):
            placement.add_column(f"GPU {gpu}", justify="center")
        for layer in range(num_layers):
            placement.add_row(str(layer), *(" ".join(map(str, row)) for row in per_gpu[layer].tolist()))
        console.print(placement)
    else:
        console.print("(placement too large to show: use --json for phy2log, log2phy and logcnt)")

    balance = Table(title="Balance: max/mean load, mean over layers (worst layer)")
    balance.add_column("")
    balance.add_column("before (no EPLB)", justify="right")
    balance.add_column("after", justify="right")
    balance.add_row("GPU", _ratio(report.gpu_before), _ratio(report.gpu_after))
    if report.node_after is not None:
        balance.add_row("node", _ratio(report.node_before), _ratio(report.node_after))
    console.print(balance)
    if plot_path:
        console.print(f"plot written to {plot_path}")


def _ratio(x) -> str:
    return f"{x.mean:.4f} ({x.worst:.4f}, layer {x.worst_layer})"


if __name__ == "__main__":
    sys.exit(main())
