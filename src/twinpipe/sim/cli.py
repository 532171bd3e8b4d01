"""``twinpipe simulate``: time one schedule, or compare several, under a cost model.

    twinpipe simulate zb-h1 --ranks 4 --microbatches 8 --w 0.5
    twinpipe simulate --compare 1f1b,zb-h1,dualpipe --ranks 8 --microbatches 32 --json

Times are per stage (V-shaped and interleaved schedules have more, smaller stages per rank).
``rich`` is imported only to print the table.
"""

from __future__ import annotations

import argparse
import json
import sys

from twinpipe.schedule import registry
from twinpipe.sim.costs import CostModel
from twinpipe.sim.engine import simulate
from twinpipe.timeline import Timeline

__all__ = ["add_simulate_parser", "run_simulate", "summarize"]

# CLI flag -> generator keyword, for the options some generators take.
_OPTIONS = {"mem_limit": "--mem-limit", "stages_per_rank": "--stages-per-rank"}
# CostModel fields that are also generator keywords (heuristics that plan with the costs).
_COST_OPTIONS = ("t_f", "t_b", "t_w", "t_comm", "mw")


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``simulate`` subcommand to ``subparsers`` and return its parser."""
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a schedule: bubble, per-rank idle time, peak activation memory",
        description="Simulate pipeline schedules under a cost model (times per stage, memory in units of M_B).",
        allow_abbrev=False,
    )
    parser.add_argument("schedule", nargs="?", help=f"schedule name: {', '.join(sorted(registry.names()))}")
    parser.add_argument("--compare", metavar="S1,S2,...", help="compare several schedules (comma-separated) instead of one")
    parser.add_argument("--ranks", "-p", type=int, required=True, metavar="P", help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=int, required=True, metavar="M", help="micro-batches")
    parser.add_argument("--f", type=float, default=1.0, metavar="TF", help="forward time T_F (default 1)")
    parser.add_argument("--b", type=float, default=1.0, metavar="TB", help="input-gradient backward time T_B only (default 1)")
    parser.add_argument("--w", type=float, default=1.0, metavar="TW", help="weight-gradient time T_W (default 1); a full backward takes TB+TW")
    parser.add_argument("--fb", type=float, default=None, metavar="TFB", help="overlapped forward+full backward (DualPipe F&B); default TF+TB+TW")
    parser.add_argument("--comm", type=float, default=0.0, metavar="TC", help="time of one message between ranks (default 0)")
    parser.add_argument("--mw", type=float, default=0.5, metavar="RATIO", help="M_W/M_B: memory kept from B until W (default 0.5)")
    parser.add_argument("--mem-limit", type=float, default=None, metavar="X", help="activation limit per rank in units of M_B (zb-auto: default p; zbv: default 2p)")
    parser.add_argument("--stages-per-rank", type=int, default=None, metavar="V", help="stages per rank (interleaved-1f1b; default 2)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def summarize(timeline: Timeline) -> dict:
    """The numbers ``--json`` prints for one simulated schedule."""
    return {
        "schedule": timeline.name,
        "ranks": timeline.num_ranks,
        "microbatches": timeline.num_microbatches,
        "makespan": timeline.makespan,
        "bubble_rate": timeline.bubble_rate,
        "per_rank": [
            {"rank": st.rank, "start": st.start, "end": st.end, "busy": st.busy, "idle": st.idle, "peak_activation": st.peak_activation}
            for st in timeline.per_rank()
        ],
    }


def simulate_from_args(args: argparse.Namespace) -> list[Timeline]:
    """The timelines the simulate options ask for (one, or one per ``--compare`` name).

    Shared by ``twinpipe simulate`` and ``twinpipe draw``; raises ValueError naming the bad option.
    """
    names = _schedule_names(args)
    costs = _costs(args)
    timelines = []
    for name in names:
        try:
            timelines.append(simulate(_build(name, args, costs, strict=len(names) == 1), costs))
        except ValueError as error:
            raise ValueError(f"{name}: {error}" if len(names) > 1 else str(error)) from None
    return timelines


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``twinpipe simulate``; 0 on success, 2 (message on stderr) on bad input."""
    try:
        timelines = simulate_from_args(args)
    except ValueError as error:
        print(f"twinpipe simulate: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        summaries = [summarize(t) for t in timelines]
        print(json.dumps(summaries if args.compare else summaries[0], indent=2))
    elif args.compare:
        _print_comparison(timelines)
    else:
        _print_ranks(timelines[0])
    return 0


def _schedule_names(args) -> list[str]:
    if args.compare and args.schedule:
        raise ValueError(f"give either SCHEDULE ({args.schedule!r}) or --compare ({args.compare!r}), not both")
    if args.compare:
        names = [n.strip() for n in args.compare.split(",") if n.strip()]
        if not names:
            raise ValueError(f"--compare={args.compare!r}: expected schedule names separated by commas")
    elif args.schedule:
        names = [args.schedule]
    else:
        raise ValueError(f"missing SCHEDULE (or --compare); allowed: {', '.join(sorted(registry.names()))}")
    for name in names:
        registry.get(name)  # unknown names fail here, listing the allowed ones
    return names


def _costs(args) -> CostModel:
    for flag, value in (("--f", args.f), ("--b", args.b), ("--w", args.w), ("--fb", args.fb), ("--comm", args.comm), ("--mw", args.mw)):
        if value is not None and not value >= 0:
            raise ValueError(f"{flag}={value:g}: must be a number >= 0")
    return CostModel(t_f=args.f, t_b=args.b, t_w=args.w, t_fb=args.fb, t_comm=args.comm, mw=args.mw)


def _build(name: str, args, costs: CostModel, strict: bool):
    """Build ``name`` with the options its generator takes; in single mode an option it does not take is an error."""
    info = registry.get(name)
    allowed = info.options  # None: the generator takes any option
    options = {}
    for key, flag in _OPTIONS.items():
        value = getattr(args, key)
        if value is None:
            continue
        if allowed is None or key in allowed:
            options[key] = value
        elif strict:
            users = [n for n in registry.names() if key in (registry.get(n).options or ())]
            raise ValueError(f"{flag}={value:g} does not apply to schedule {info.name!r}; it applies to: {', '.join(users)}")
    for key in _COST_OPTIONS:  # heuristics plan with the same costs we simulate
        if allowed is not None and key in allowed:
            options[key] = getattr(costs, key)
    return registry.build(info.name, args.ranks, args.microbatches, **options)


def _print_ranks(timeline: Timeline) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{timeline.name}: p={timeline.num_ranks}, m={timeline.num_microbatches}, "
                        f"makespan {timeline.makespan:g}, bubble rate {timeline.bubble_rate:.2%}")
    for column in ("rank", "start", "end", "busy", "idle", "peak activation (M_B)"):
        table.add_column(column, justify="right")
    for st in timeline.per_rank():
        table.add_row(str(st.rank), f"{st.start:g}", f"{st.end:g}", f"{st.busy:g}", f"{st.idle:g}", f"{st.peak_activation:g}")
    Console().print(table)


def _print_comparison(timelines: list[Timeline]) -> None:
    from rich.console import Console
    from rich.table import Table

    first = timelines[0]
    table = Table(title=f"p={first.num_ranks}, m={first.num_microbatches}")
    for column in ("schedule", "stages", "makespan", "bubble rate", "max idle", "peak activation (M_B)"):
        table.add_column(column, justify="right")
    for t in timelines:
        stats = t.per_rank()
        table.add_row(t.name, str(t.placement.num_stages), f"{t.makespan:g}", f"{t.bubble_rate:.2%}",
                      f"{max(st.idle for st in stats):g}", f"{max(t.peak_activation):g}")
    Console().print(table)
