"""``twinpipe simulate``: time one schedule, or compare several, under a cost model.

    twinpipe simulate zb-h1 --pp 4 --microbatches 8 --w 0.5
    twinpipe simulate --compare 1f1b,zb-h1,dualpipe --pp 8 --microbatches 32 --json

By default every schedule runs the same model: the times (and M_B) are those of one 1F1B stage,
1/p of the model, and a schedule's stages get their share of them (``--hold model``; a V or
interleaved rank's stages are 1/v of that, DualPipe's two stages are full-size copies).
``--hold stage`` gives every stage the costs as given. ``rich`` is imported only to print the table.

With ``--gpt`` (and ``twinpipe train``'s model options) each rank's memory is also predicted in
bytes, by part, as ``twinpipe train`` predicts it for its GPT (``twinpipe.sim.gpt``): a second
table, and ``"memory"`` per rank in the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from types import MappingProxyType

import twinpipe.cli_options as cli_options
from twinpipe import checks
from twinpipe.schedule import registry
from twinpipe.schedule.spec import resolve
from twinpipe.sim.costs import CostModel, check_cost, for_model, stage_sizes
from twinpipe.sim.engine import simulate
from twinpipe.sim.gpt_cli import BOUND_NOTE, add_gpt_options, check_gpt_options, gpt_run, gpt_settings, memory_table
from twinpipe.timeline import Timeline

__all__ = ["add_simulate_parser", "run_simulate", "summarize", "simulate_from_args", "held_equal"]

# CLI flag -> generator keyword, for the options some generators take.
_OPTIONS = MappingProxyType({"mem_limit": "--mem-limit", "stages_per_rank": "--stages-per-rank", "pairs": "--pairs",
                             "overlap": "--overlap", "warmup_extra": "--overlap-warmup"})
# CostModel fields that are also generator keywords (heuristics that plan with the costs).
_COST_OPTIONS = ("t_f", "t_b", "t_w", "t_comm", "mw")
HOLD = ("model", "stage")


def add_simulate_parser(subparsers, *, gpt: bool = True) -> argparse.ArgumentParser:
    """Add the ``simulate`` subcommand to ``subparsers`` and return its parser (with ``--gpt`` and
    its options unless ``gpt`` is False: ``twinpipe draw`` takes the rest)."""
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a schedule: bubble, per-rank idle time, peak activation memory",
        description="Simulate pipeline schedules under a cost model (times per stage, memory in units of M_B).",
        allow_abbrev=False,
    )
    parser.add_argument("schedule", nargs="?", help=f"schedule name: {', '.join(sorted(registry.names()))}")
    parser.add_argument("--compare", metavar="S1,S2,...", help="compare several schedules (comma-separated) instead of one")
    # dest "ranks": the name Timeline and the JSON use for p
    cli_options.add(parser, "pp", dest="ranks", more="required")
    cli_options.add(parser, "microbatches", more="required")
    parser.add_argument("--f", type=float, default=1.0, metavar="TF", help="forward time T_F of one stage (see --hold; default 1)")
    parser.add_argument("--b", type=float, default=1.0, metavar="TB", help="input-gradient backward time T_B only (default 1)")
    parser.add_argument("--w", type=float, default=1.0, metavar="TW", help="weight-gradient time T_W (default 1); a full backward takes TB+TW")
    parser.add_argument("--fb", type=float, default=None, metavar="TFB", help="overlapped forward+full backward (DualPipe F&B); default TF+TB+TW")
    parser.add_argument("--fb-b", type=float, default=None, metavar="TFBB",
                        help="overlapped forward+input-gradient backward (an F&B whose W runs later: zb-h1, zbv with --overlap); default TF+TB")
    parser.add_argument("--comm", type=float, default=0.0, metavar="TC", help="time of one message between ranks, any schedule (default 0)")
    parser.add_argument("--mw", type=float, default=0.5, metavar="RATIO", help="M_W/M_B: memory kept from B until W (default 0.5)")
    parser.add_argument("--cores", type=int, default=None, metavar="C",
                        help="ranks that can compute at once (a CPU run with more ranks than cores); default: all")
    parser.add_argument("--mem-limit", type=float, default=None, metavar="X",
                        help="activation limit per rank (zb-auto, zbv), in M_B of a 1F1B stage (with --hold stage: of the "
                        "schedule's own stages); default: 1F1B's peak, p M_B of 1F1B stages")
    cli_options.add(parser, "stages_per_rank", default_text="2")
    parser.add_argument("--pairs", type=int, default=None, metavar="K", help="down/up pipeline pairs (chimera; default 1; 2K must divide P)")
    cli_options.add(parser, "overlap", default_text="off")
    cli_options.add(parser, "overlap_warmup", dest="warmup_extra")
    parser.add_argument("--hold", choices=HOLD, default="model",
                        help="what is the same for every schedule: 'model' (default): the times and M_B are those of one "
                        "1F1B stage (1/p of the model) and each schedule's stages get their share (1/v for V-shaped and "
                        "interleaved ranks, 1 for DualPipe's two full-size copies); 'stage': every stage of every "
                        "schedule gets the costs as given (a V then models a model twice as large)")
    cli_options.add(parser, "json")
    if gpt:
        add_gpt_options(parser)
    return parser


def summarize(timeline: Timeline) -> dict:
    """The numbers ``--json`` prints for one simulated schedule."""
    return {
        "schedule": timeline.name,
        "ranks": timeline.num_ranks,
        "microbatches": timeline.num_microbatches,
        "held_equal": timeline.meta.get("held_equal"),
        "stage_size": timeline.meta.get("stage_size"),
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
    absent = [flag for flag, value in (("--pp", args.ranks), ("--microbatches", args.microbatches)) if value is None]
    if absent:
        raise ValueError(f"missing {', '.join(absent)}")
    names = _schedule_names(args)
    costs = _costs(args)
    timelines = []
    for name in names:
        try:
            timelines.append(_simulate_one(name, args, costs, strict=len(names) == 1))
        except ValueError as error:
            named = len(names) == 1 or str(error).startswith(f"{registry.get(name).name}:")
            raise ValueError(str(error) if named else f"{name}: {error}") from None
    return timelines


def held_equal(args: argparse.Namespace) -> str:
    """One line saying what every schedule shares under ``--hold`` (for tables and pictures)."""
    times = f"T_F={args.f:g}, T_B={args.b:g}, T_W={args.w:g}" + (f", T_FB={args.fb:g}" if args.fb is not None else "")
    times += f", T_FB_B={args.fb_b:g}" if args.fb_b is not None else ""
    times += f", T_comm={args.comm:g}" if args.comm else ""
    if args.hold == "model":
        return (f"same model: {times} and M_B per 1F1B stage (1/p of the model); a stage of size 1/v gets 1/v of them "
                "(V and interleaved ranks), DualPipe's stages are full-size copies")
    return f"same per-stage costs: {times} and M_B on every stage, whatever its size"


def _simulate_one(name: str, args, costs: CostModel, strict: bool) -> Timeline:
    """Scale the costs to ``name``'s stages (``--hold model``), build it and simulate it."""
    info = registry.get(name)
    size = Fraction(1)
    if args.hold == "model":
        # Only the placement's shape matters here; _build checks the options.
        options = {k: getattr(args, k) for k in _OPTIONS if getattr(args, k) is not None and (info.options is None or k in info.options)}
        placement = resolve(info.name, args.ranks, **options).placement
        sizes = set(stage_sizes(placement))
        size = sizes.pop() if len(sizes) == 1 else None
        costs = for_model(costs, placement)
    timeline = simulate(_build(name, args, costs, strict, size), costs)
    timeline.meta.update(held_equal=args.hold, stage_size=None if size is None or args.hold == "stage" else str(size))
    return timeline


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``twinpipe simulate``; 0 on success, 2 (message on stderr) on bad input."""
    try:
        check_gpt_options(args)
        timelines = simulate_from_args(args)
        memory = [_gpt_memory(t, args) for t in timelines] if args.gpt else None
    except ValueError as error:
        print(f"twinpipe simulate: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        summaries = [summarize(t) for t in timelines]
        for summary, ranks in zip(summaries, memory or ()):
            summary["memory"] = [r.to_dict() for r in ranks]
            if gpt_settings(args)["experts"]:
                summary["memory_note"] = BOUND_NOTE
        print(json.dumps(summaries if args.compare else summaries[0], indent=2))
        return 0
    if args.compare:
        _print_comparison(timelines, held_equal(args), memory)
    else:
        _print_ranks(timelines[0], held_equal(args))
        if memory:
            from rich.console import Console

            Console().print(memory_table(f"{timelines[0].name}: memory per rank, bytes (twinpipe train's GPT)", memory[0],
                                         _gpt_caption(args), bound=gpt_settings(args)["experts"] > 0))
    return 0


def _gpt_memory(timeline: Timeline, args) -> list:
    """Each rank's memory by part for ``timeline``'s schedule (its options) and the --gpt options."""
    options = {k: v for k, v in timeline.meta.get("options", {}).items() if k in _OPTIONS}  # the user's, as built
    return gpt_run(args).predict(timeline.name, args.ranks, args.microbatches, gpt_settings(args)["dp"], options)


def _gpt_caption(args) -> str:
    o = gpt_settings(args)
    moe = f", {o['experts']} experts top-{o['top_k']}" if o["experts"] else ""
    mtp = f", MTP depth {o['mtp_depth']}" if o["mtp_depth"] else ""
    return (f"{o['layers']} blocks{moe}{mtp}, dim {o['dim']}, {o['heads']} heads, seq {o['seq_len']}, vocab {o['vocab']}, "
            f"{o['microbatch_size']} sequences per micro-batch, {o['dtype']}, precision {o['precision']}, zero {o['zero']}, "
            f"dp {o['dp']}: what twinpipe train --batch-size {args.microbatches * o['dp'] * o['microbatch_size']} predicts")


def _schedule_names(args) -> list[str]:
    if args.compare and args.schedule:
        raise ValueError(f"give either SCHEDULE ({args.schedule!r}) or --compare ({args.compare!r}), not both")
    if args.compare:
        names = [n.strip() for n in args.compare.split(",") if n.strip()]
        if not names:
            raise checks.bad("--compare", args.compare, "must be schedule names separated by commas")
    elif args.schedule:
        names = [args.schedule]
    else:
        raise ValueError(f"missing SCHEDULE (or --compare); allowed are {', '.join(sorted(registry.names()))}")
    for name in names:
        registry.get(name)  # unknown names fail here, listing the allowed ones
    return names


def _costs(args) -> CostModel:
    for flag, value in (("--f", args.f), ("--b", args.b), ("--w", args.w), ("--fb", args.fb), ("--fb-b", args.fb_b), ("--comm", args.comm),
                        ("--mw", args.mw)):
        if value is not None:
            check_cost(flag, value)
    return CostModel(t_f=args.f, t_b=args.b, t_w=args.w, t_fb=args.fb, t_comm=args.comm, mw=args.mw, cores=args.cores, t_fb_b=args.fb_b)


def _build(name: str, args, costs: CostModel, strict: bool, size: Fraction | None = Fraction(1)):
    """Build ``name`` with the options its generator takes; in single mode an option it does not take is an error.

    ``size``: the schedule's stage size in 1F1B stages (``--hold model``), by which ``--mem-limit``
    (in M_B of a 1F1B stage) is divided for generators counting in their own stages' M_B.
    """
    info = registry.get(name)
    allowed = info.options  # None: the generator takes any option
    options = {}
    for key, flag in _OPTIONS.items():
        value = getattr(args, key)
        if value is None or value is False:  # not given (--overlap is a switch)
            continue
        if key == "mem_limit" and size is not None and size != 1:
            value = float(value / size)
        if allowed is None or key in allowed or (strict and key in registry.FB_OPTIONS):
            options[key] = value  # a schedule without a steady phase refuses --overlap itself, naming both
        elif strict:
            users = [n for n in registry.names() if key in (registry.get(n).options or ())]
            raise ValueError(f"{flag}={value:g} does not apply to schedule {info.name!r}; it applies to: {', '.join(users)}")
    for key in _COST_OPTIONS:  # heuristics plan with the same costs we simulate
        if allowed is not None and key in allowed:
            options[key] = getattr(costs, key)
    return registry.build(info.name, args.ranks, args.microbatches, **options)


def _print_ranks(timeline: Timeline, note: str) -> None:
    from rich.console import Console
    from rich.table import Table

    size = timeline.meta.get("stage_size")
    table = Table(title=f"{timeline.name}: p={timeline.num_ranks}, m={timeline.num_microbatches}, "
                        f"makespan {timeline.makespan:g}, bubble rate {timeline.bubble_rate:.2%}"
                        + (f", stage size {size} (1F1B stages)" if size else ""), caption=note)
    for column in ("rank", "start", "end", "busy", "idle", "peak activation (M_B)"):
        table.add_column(column, justify="right")
    for st in timeline.per_rank():
        table.add_row(str(st.rank), f"{st.start:g}", f"{st.end:g}", f"{st.busy:g}", f"{st.idle:g}", f"{st.peak_activation:g}")
    Console().print(table)


def _print_comparison(timelines: list[Timeline], note: str, memory: list | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from twinpipe.sim.memory import format_bytes

    first = timelines[0]
    table = Table(title=f"p={first.num_ranks}, m={first.num_microbatches}", caption=note)
    columns = ["schedule", "stages", "stage size", "makespan", "bubble rate", "max idle", "peak activation (M_B)"]
    for column in columns + (["fullest rank: activations / total (GPT)"] if memory else []):
        table.add_column(column, justify="right")
    for i, t in enumerate(timelines):
        stats = t.per_rank()
        row = [t.name, str(t.placement.num_stages), t.meta.get("stage_size") or "-", f"{t.makespan:g}", f"{t.bubble_rate:.2%}",
               f"{max(st.idle for st in stats):g}", f"{max(t.peak_activation):g}"]
        if memory:
            fullest = max(memory[i], key=lambda r: r.parts.total).parts
            row.append(f"{format_bytes(fullest.activations_peak)} / {format_bytes(fullest.total)}")
        table.add_row(*row)
    Console().print(table)
