"""The ``twinpipe`` command: ``demo | simulate | draw | eplb``. Each subcommand lives with its layer."""

from __future__ import annotations

import argparse
import sys

from twinpipe import __version__


def _parser() -> argparse.ArgumentParser:
    from twinpipe.demo import add_demo_parser, run_demo
    from twinpipe.eplb.cli import add_eplb_parser, run_eplb
    from twinpipe.sim.cli import add_simulate_parser, run_simulate
    from twinpipe.viz.cli import add_draw_parser, run_draw

    parser = argparse.ArgumentParser(prog="twinpipe", description="DualPipe, DualPipeV and friends: run, simulate, draw.")
    parser.add_argument("--version", action="version", version=f"twinpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add, run in ((add_demo_parser, run_demo), (add_simulate_parser, run_simulate),
                     (add_draw_parser, run_draw), (add_eplb_parser, run_eplb)):
        add(sub).set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
