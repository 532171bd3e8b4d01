"""The ``twinpipe`` command: ``demo | simulate | draw | eplb | train | plan | check | export | export-hf``. Each subcommand lives with its layer.

Only the module of the subcommand that runs is imported: ``simulate`` and ``draw`` need neither
torch nor the runtime, so they work where torch is not installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import MappingProxyType

import twinpipe.cli_options as cli_options
from twinpipe import __version__

# name -> (module, function adding its parser, function running it, one-line help for the listing)
_COMMANDS = MappingProxyType({
    "demo": ("twinpipe.demo", "add_demo_parser", "run_demo", "train a small model on a pipeline and check it against one process (--moe: MoE blocks with F&B overlap)"),
    "simulate": ("twinpipe.sim.cli", "add_simulate_parser", "run_simulate", "simulate a schedule: bubble, per-rank idle time, peak activation memory"),
    "draw": ("twinpipe.viz.cli", "add_draw_parser", "run_draw", "draw a simulated schedule (or several, stacked) as PNG/SVG/PDF"),
    "eplb": ("twinpipe.eplb.cli", "add_eplb_parser", "run_eplb", "balance MoE expert replicas across GPUs (DeepSeek EPLB)"),
    "train": ("twinpipe.train_command.cli", "add_train_parser", "run_train", "train a small byte-level GPT on a pipeline (any schedule) with data parallelism"),
    "plan": ("twinpipe.plan.cli", "add_plan_parser", "run_plan", "rank every schedule and pipeline size for a model on a cluster (or a traced run)"),
    "check": ("twinpipe.train_command.check", "add_check_parser", "run_check", "check a parallel plan on a small float64 copy of a transformers model (split vs unsplit gradients)"),
    "export": ("twinpipe.cli", "add_export_parser", "run_export", "write a schedule in another tool's format (torch.distributed.pipelining CSV)"),
    "export-hf": ("twinpipe.train_command.export_hf", "add_export_hf_parser", "run_export_hf", "write a twinpipe train checkpoint as a transformers folder (from_pretrained loads it)"),
})


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first word that is not an option)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _parser(command: str | None = None, argv: list[str] = ()) -> argparse.ArgumentParser:
    """The parser with ``command``'s full options; the other subcommands are listed by name only.
    ``demo --moe`` is the MoE demo: the same command with its own options (and help)."""
    parser = argparse.ArgumentParser(prog="twinpipe", description="DualPipe, DualPipeV and friends: run, simulate, draw.")
    parser.add_argument("--version", action="version", version=f"twinpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, add, run, summary) in _COMMANDS.items():
        if name == command:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as error:  # e.g. demo without torch
                if (error.name or "twinpipe").split(".")[0] == "twinpipe":
                    raise
                parser.exit(2, f"twinpipe {name}: error: it needs the package {error.name!r}, which is not installed\n")
            variant = {"is_moe": True} if name == "demo" and "--moe" in argv else {}
            getattr(mod, add)(sub, **variant).set_defaults(run=getattr(mod, run))
        else:
            sub.add_parser(name, help=summary)
    return parser


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    """The ``export`` subcommand: a registered schedule in torch.distributed.pipelining's CSV."""
    from twinpipe.schedule import registry

    parser = subparsers.add_parser(
        "export", help=_COMMANDS["export"][3], allow_abbrev=False,
        description="Write a schedule as torch.distributed.pipelining's compute-only action CSV (one row per rank), "
                    "which _PipelineScheduleRuntime._load_csv and torchtitan's pipeline_parallel_schedule_csv load. "
                    "Schedules whose micro-batches walk several chains (DualPipe's two directions) cannot be written; "
                    "--list says which.")
    parser.add_argument("schedule", nargs="?", help=f"schedule name: {', '.join(sorted(registry.names()))}")
    cli_options.add(parser, "pp")
    cli_options.add(parser, "microbatches")
    parser.add_argument("--format", choices=["torch-csv"], default="torch-csv", help="output format (default: %(default)s)")
    cli_options.add(parser, "out", more="the file", default_text="standard output")
    parser.add_argument("--list", action="store_true", help="list every registered schedule and whether the format can express it")
    return parser


def _export_list() -> str:
    """Every registered schedule: whether torch's CSV can express it, and if not, why."""
    from twinpipe.schedule import registry, resolve
    from twinpipe.schedule.torch_csv import placement_unexpressible

    lines = []
    for name in registry.names():
        why = placement_unexpressible(name, resolve(name, 4).placement)
        lines.append(f"{name}: {'yes' if why is None else 'no, ' + why.split(': ', 1)[1]}")
    return "\n".join(lines) + "\n"


def run_export(args) -> int:
    """Run ``twinpipe export``; 0 on success, 2 (message on stderr) when it cannot."""
    from twinpipe.schedule import registry
    from twinpipe.schedule.torch_csv import to_torch_csv

    try:
        if args.list:
            text = _export_list()
        else:
            missing = [flag for flag, value in (("SCHEDULE", args.schedule), ("--pp", args.pp), ("--microbatches", args.microbatches))
                       if value is None]
            if missing:
                raise ValueError(f"missing {', '.join(missing)} (or --list)")
            text = to_torch_csv(registry.build(args.schedule, args.pp, args.microbatches))
        if args.out:
            from pathlib import Path

            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)
    except (ValueError, OSError) as error:
        print(f"twinpipe export: error: {error}", file=sys.stderr)
        return 2
    if not args.out:
        sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser(_command_of(argv), argv)
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
