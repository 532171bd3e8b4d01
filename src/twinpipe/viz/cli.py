"""``twinpipe draw``: simulate one schedule (or several, stacked) and draw the timeline.

    twinpipe draw dualpipe --pp 8 --microbatches 20 --out dualpipe.png
    twinpipe draw --compare 1f1b,zb-h1,dualpipe --pp 8 --microbatches 20 --out compare.svg

Schedule and cost options are the ``simulate`` command's, taken from its parser, so the two
commands always accept the same ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from twinpipe import checks

__all__ = ["add_draw_parser", "run_draw"]


def _simulate_options() -> argparse.ArgumentParser:
    """The ``simulate`` parser, used as a parent: SCHEDULE, --compare, --pp, cost options, --json."""
    from twinpipe.sim.cli import add_simulate_parser

    return add_simulate_parser(argparse.ArgumentParser().add_subparsers(), gpt=False)


def add_draw_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``draw`` subcommand to ``subparsers`` and return its parser."""
    from twinpipe.viz.draw import FORMATS

    # add_help=False: the parent brings -h (it prints this parser's help).
    parser = subparsers.add_parser(
        "draw",
        parents=[_simulate_options()],
        add_help=False,
        help="draw a simulated schedule (or several, stacked) as PNG/SVG/PDF",
        description="Simulate pipeline schedules under a cost model and draw their timelines: one row per rank, "
        "one colour per op kind, light/dark for DualPipe's two directions. The line above the panels says what "
        "every schedule shares (see --hold).",
        allow_abbrev=False,
    )
    import twinpipe.cli_options as cli_options

    cli_options.add(parser, "out", metavar="FILE",
                    more=f"the picture, required; its suffix picks the format ({', '.join('.' + f for f in FORMATS)})")
    parser.add_argument("--width", type=float, default=None, metavar="INCHES", help="figure width (default: from the number of cells, 7..36)")
    parser.add_argument("--dpi", type=int, default=100, help="resolution of PNG output (default 100; the picture may have at most 50 million pixels)")
    parser.add_argument("--no-labels", action="store_true", help="leave micro-batch numbers out of the cells")
    return parser


def run_draw(args: argparse.Namespace) -> int:
    """Run ``twinpipe draw``; 0 on success, 2 (message on stderr) on bad input."""
    from twinpipe.sim.cli import held_equal, simulate_from_args, summarize
    from twinpipe.viz.draw import FORMATS, MAX_DPI, draw_timelines

    try:
        if args.out is None:
            raise ValueError("missing --out (the picture to write)")
        suffix = Path(args.out).suffix.lower().lstrip(".")
        if suffix not in FORMATS:
            raise checks.bad("--out", args.out, f"must end in one of {', '.join('.' + f for f in FORMATS)}")
        if args.width is not None:
            checks.check_float(args.width, "--width", low=2, low_open=True, why="inches")
        checks.check_int(args.dpi, "--dpi", low=1, high=MAX_DPI)
        timelines = simulate_from_args(args)
        draw_timelines(timelines, args.out, width=args.width, dpi=args.dpi, labels=not args.no_labels, caption=held_equal(args))
    except ValueError as error:
        print(f"twinpipe draw: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        summaries = [summarize(t) | {"output": str(args.out)} for t in timelines]
        print(json.dumps(summaries if args.compare else summaries[0], indent=2))
    else:
        for t in timelines:
            peak = f", peak activation {max(t.peak_activation):g} M_B" if t.peak_activation else ""
            print(f"{t.name}: p={t.num_ranks}, m={t.num_microbatches}, makespan {t.makespan:g}, bubble rate {t.bubble_rate:.2%}{peak}")
        print(f"wrote {args.out}")
    return 0
