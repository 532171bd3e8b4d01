"""``--gpt`` for ``twinpipe simulate`` and ``twinpipe plan``: each rank's memory in bytes, by part,
for ``twinpipe train``'s GPT (``twinpipe.sim.gpt.GPTRun``), as the trainer's report predicts it.

The options are ``twinpipe train``'s and mean the same; a command that already has one of them
(``plan``'s model options) keeps its own. ``rich`` is imported only to print.
"""

from __future__ import annotations

import argparse

import twinpipe.cli_options as cli_options
from twinpipe.sim.gpt import ELSIZE, GPTRun, RankPrediction
from twinpipe.sim.memory import PARTS, format_bytes

__all__ = ["TRAIN_DEFAULTS", "add_gpt_options", "gpt_run", "memory_table"]

# twinpipe train's defaults (tests/test_memory_predict.py holds them to its parser's)
TRAIN_DEFAULTS = {"layers": 6, "dim": 64, "heads": 4, "seq_len": 64, "vocab": 256, "microbatch_size": 2, "dtype": "float32",
                  "precision": "pure", "zero": 0}
TRANSPORTS = ("auto", "process-group")
HEADERS = {"params": "params", "grads": "grads", "master": "master", "optimizer": "optimizer", "activations_peak": "activations peak"}


def add_gpt_options(parser: argparse.ArgumentParser, have: tuple[str, ...] = ()) -> None:
    """``--gpt`` and the train options it reads, but those in ``have`` (the command has them)."""
    g = parser.add_argument_group("memory in bytes for twinpipe train's GPT (--gpt; the options mean what they mean there)")
    g.add_argument("--gpt", action="store_true",
                   help="predict each rank's memory in bytes, by part (parameters, gradients, master weights, optimizer state, "
                        "activation peak with receive buffers), for twinpipe train's GPT trained with these options: what its "
                        "train-log.json lists as 'predicted' (dense GPT, AdamW, CPU)")
    for name in ("layers", "dim", "heads", "seq_len", "vocab", "microbatch_size"):
        if name not in have:
            cli_options.add(parser, name, group=g, default=TRAIN_DEFAULTS[name])
    if "dtype" not in have:
        cli_options.add(parser, "dtype", group=g, default=TRAIN_DEFAULTS["dtype"], choices=tuple(ELSIZE))
    g.add_argument("--precision", default="pure", choices=("pure", "bf16-mixed"), help="train's --precision (default: pure)")
    g.add_argument("--zero", type=int, default=0, choices=(0, 1), help="train's --zero (default: 0)")
    if "dp" not in have:
        cli_options.add(parser, "dp", group=g, default=1)
    g.add_argument("--no-overlap-dp", dest="overlap_dp", action="store_false",
                   help="train's --no-overlap-dp (changes ZeRO-1's shards)")
    g.add_argument("--transport", default="auto", choices=TRANSPORTS,
                   help="auto: shared memory between CPU ranks on one host (train's); process-group: gloo messages")


def gpt_run(args) -> GPTRun:
    """The ``GPTRun`` the options describe (ValueError naming the bad one)."""
    return GPTRun(args.layers, args.dim, args.seq_len, args.heads, args.vocab, args.microbatch_size, dtype=args.dtype,
                  precision=args.precision, zero=args.zero, overlap_dp=args.overlap_dp, flattens=args.transport == "process-group",
                  experts=getattr(args, "experts", 0) or 0)


def memory_table(title: str, ranks: list[RankPrediction], caption: str = ""):
    """A rich table: one row per rank, its parts and total."""
    from rich.table import Table

    table = Table(title=title, caption=caption)
    sharded = any(r.dp_rank for r in ranks)
    table.add_column("rank" if not sharded else "pp, dp", justify="right")
    for part in (*PARTS, "total"):
        table.add_column(HEADERS.get(part, part), justify="right")
    for r in ranks:
        parts = r.parts.to_dict()
        table.add_row(str(r.pp_rank) if not sharded else f"{r.pp_rank}, {r.dp_rank}",
                      *(format_bytes(parts[part]) for part in (*PARTS, "total")))
    return table
