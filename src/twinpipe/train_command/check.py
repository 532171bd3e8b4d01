"""The ``twinpipe check`` command: a parallel plan checked on a small float64 copy of the user's model.

The options are checked here before any rank starts (``--model`` as ``twinpipe train`` checks it:
``train_command.model.check_model``); the check itself is ``twinpipe.hf.plan_check``. Exit codes: 0
when every difference is within its bound, 1 when one is not (or a rank fails), 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import twinpipe.cli_options as cli_options
from twinpipe.checks import bad, check_int, checked_timeout

__all__ = ["add_check_parser", "run_check"]

_MAX_SEED = 2**32 - 1


def add_check_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "check", allow_abbrev=False,
        description="Train one step of a small float64 copy of --model's config.json (widths shrunk, every layer kept, "
                    "random weights from --seed) split as asked, on CPU ranks this command starts, and unsplit on the same "
                    "batch; print per parameter group the largest gradient difference and the losses' difference against "
                    "the bounds twinpipe.hf.plan_check.BOUNDS states. Exit 0 when all are within, 1 when one is not, "
                    "2 on bad input.")
    parser.add_argument("--model", required=True, metavar="DIR", help="a local transformers causal LM folder (its config.json)")
    cli_options.add(parser, "schedule", default="dualpipev")
    cli_options.add(parser, "pp", default=2)
    cli_options.add(parser, "ep", default=1, more="a divisor of --dp: each stage's MoE experts spread over EP groups of --ep "
                                                  "data-parallel ranks, as twinpipe train --ep does")
    cli_options.add(parser, "dp", default=None, default_text="--ep")
    cli_options.add(parser, "microbatches", default=None, default_text="2 x --pp")
    cli_options.add(parser, "seq_len", default=8)
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch (default: %(default)s)")
    cli_options.add(parser, "timeout", default=120.0)
    return parser


def run_check(args: argparse.Namespace) -> int:
    """Run ``twinpipe check``: print the report; 0, 1 or 2 (module docstring)."""
    try:
        request = _request(args)
    except ValueError as error:
        print(f"twinpipe check: error: {error}", file=sys.stderr)
        return 2
    from twinpipe.hf.plan_check import check_plan, format_report
    from twinpipe.launch import RankFailedError

    try:
        rows = check_plan(request)
    except (RankFailedError, TimeoutError) as error:
        print(f"twinpipe check: a rank failed: {str(error).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    print(format_report(request, rows))
    return 0 if all(row.within for row in rows) else 1


def _request(args):
    """The checked request (ValueError ``--option=value: must be ...`` naming the first bad option)."""
    from twinpipe.hf.plan_check import PlanRequest
    from twinpipe.schedule import registry, resolve
    from twinpipe.train_command.model import GPT_OPTIONS, check_ep, check_model

    dp = args.ep if args.dp is None else args.dp
    microbatches = 2 * args.pp if args.microbatches is None else args.microbatches
    for flag, value in (("--pp", args.pp), ("--ep", args.ep), ("--dp", dp), ("--microbatches", microbatches),
                        ("--seq-len", args.seq_len)):
        check_int(value, flag, low=1)
    check_int(args.seed, "--seed", low=0, high=_MAX_SEED, why="torch's generator keeps 32 bits of a seed")
    checked_timeout(args.timeout, "--timeout")
    try:
        registry.get(args.schedule)
    except ValueError as error:  # it lists the names and aliases
        raise bad("--schedule", args.schedule, "allowed are " + str(error).split("allowed are ", 1)[-1]) from None
    try:
        schedule = resolve(args.schedule, args.pp)
        schedule.build(microbatches)
    except ValueError as error:
        raise bad("--schedule", args.schedule, f"does not run on --pp={args.pp} with --microbatches={microbatches}: "
                  f"{error}") from None
    gpt = {flag[2:].replace("-", "_"): None for flag in GPT_OPTIONS}
    as_train = SimpleNamespace(model=args.model, layout=None, ep=args.ep, dp=dp, pp=args.pp, schedule=args.schedule,
                               seq_len=args.seq_len, mtp_depth=0, bias_update_speed=0.0, balance_alpha=0.0, **gpt)
    check_ep(as_train)  # the one expert-parallel rule, as twinpipe train's
    check_model(as_train, schedule.placement.num_model_stages, gpt, command="check")
    return PlanRequest(folder=args.model, schedule=args.schedule, pp=args.pp, dp=dp, ep=args.ep, microbatches=microbatches,
                       seq_len=args.seq_len, seed=args.seed, timeout=args.timeout)
