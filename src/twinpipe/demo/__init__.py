"""The demos ``twinpipe demo`` runs, on the command-line layer (nothing in the library imports them).

``twinpipe demo`` (``dense``): a small transformer on any pipeline schedule, every step checked
against one process. ``twinpipe demo --moe`` (``moe``): MoE blocks on pipeline x expert-parallel ranks
with F&B overlap; the same command with its own options and its own ``--help``. Both build their
blocks from the trainer's model description (``twinpipe.train.GPTConfig``) and spell their options
as every command does (``twinpipe.cli_options``). ``python -m twinpipe.demo`` runs them too (torchrun).
"""

from __future__ import annotations

import argparse
import sys

from twinpipe.demo import dense, moe
from twinpipe.demo.dense import (GRAD_TOLERANCE, TRACE_FILES, cpu_cores, exactness_line, grad_tolerance,
                                 oversubscription_warning)

__all__ = ["add_demo_parser", "run_demo", "main", "grad_tolerance", "exactness_line", "cpu_cores",
           "oversubscription_warning", "GRAD_TOLERANCE", "TRACE_FILES", "Block"]

HELP = "train a small model on a pipeline and check it against one process (--moe: MoE blocks with F&B overlap)"


def _configure(parser: argparse.ArgumentParser, is_moe: bool) -> argparse.ArgumentParser:
    (moe if is_moe else dense).add_options(parser)
    parser.add_argument("--moe", action="store_true",
                        help="run the MoE demo (these are its options)" if is_moe else
                        "run the MoE demo instead: MoE blocks on PP x EP ranks, DualPipeV with F&B overlap on and off, "
                        "and how much all-to-all time the overlap hid; its options: twinpipe demo --moe --help (default: off)")
    return parser


def add_demo_parser(subparsers, is_moe: bool = False) -> argparse.ArgumentParser:
    """Add ``demo`` to ``subparsers``: the dense demo's options, or with ``is_moe`` the MoE demo's
    (``twinpipe demo --moe ...``: the command line decides which, before parsing)."""
    parser = subparsers.add_parser("demo", help=HELP, allow_abbrev=False,
                                   prog=f"{subparsers._prog_prefix} demo{' --moe' if is_moe else ''}",
                                   description=moe.DESCRIPTION if is_moe else dense.DESCRIPTION)
    return _configure(parser, is_moe)


def run_demo(args) -> int:
    """Run the demo ``args`` ask for (``args.moe``: the MoE one)."""
    return moe.run(args) if args.moe else dense.run(args)


def main(argv=None) -> int:
    """``python -m twinpipe.demo [--moe] ...`` (torchrun too)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    is_moe = "--moe" in argv
    parser = argparse.ArgumentParser(prog="python -m twinpipe.demo" + (" --moe" if is_moe else ""), allow_abbrev=False,
                                     description=moe.DESCRIPTION if is_moe else dense.DESCRIPTION)
    return run_demo(_configure(parser, is_moe).parse_args(argv))


def __getattr__(name):
    if name == "Block":  # the demo's own block before it used the trainer's; still builds one
        from twinpipe.demo._compat import Block

        return Block
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
