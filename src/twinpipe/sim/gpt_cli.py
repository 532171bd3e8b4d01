"""``--gpt`` for ``twinpipe simulate`` and ``twinpipe plan``: each rank's memory in bytes, by part,
for ``twinpipe train``'s GPT (``twinpipe.sim.gpt.GPTRun``), as the trainer's report predicts it.

The options are ``twinpipe train``'s and mean the same; a command that already has one of them
(``plan``'s model options) keeps its own. ``rich`` is imported only to print.
"""

from __future__ import annotations

import argparse
from types import MappingProxyType

import twinpipe.cli_options as cli_options
from twinpipe import checks
from twinpipe.precisions import PRECISIONS, PURE
from twinpipe.sim.gpt import ELSIZE, GPTRun, RankPrediction
from twinpipe.sim.memory import PARTS, format_bytes

__all__ = ["TRAIN_DEFAULTS", "add_gpt_options", "check_gpt_options", "gpt_settings", "gpt_run", "memory_table", "BOUND_NOTE"]

# twinpipe train's defaults (tests/test_memory_predict.py holds them to its parser's)
TRAIN_DEFAULTS = MappingProxyType({"layers": 6, "dim": 64, "heads": 4, "seq_len": 64, "vocab": 256, "microbatch_size": 2, "dtype": "float32",
                                   "precision": PURE, "zero": 0, "dp": 1, "experts": 0, "mtp_depth": 0})
TOP_K = 2  # twinpipe train's --top-k with --experts
TRANSPORTS = ("auto", "process-group")
BOUND_NOTE = "MoE blocks: 'activations peak' is an upper bound (the routing decides; docs/memory.md)"
HEADERS = MappingProxyType({"params": "params", "grads": "grads", "master": "master", "optimizer": "optimizer", "activations_peak": "activations peak"})


def add_gpt_options(parser: argparse.ArgumentParser, have: tuple[str, ...] = ()) -> None:
    """``--gpt`` and the train options it reads, but those in ``have`` (the command has them). They
    default to None (train's default, filled in by ``gpt_settings``): given without ``--gpt``, they
    are refused (``check_gpt_options``), not silently ignored."""
    g = parser.add_argument_group("memory in bytes for twinpipe train's GPT (--gpt; the options mean what they mean there)")
    g.add_argument("--gpt", action="store_true",
                   help="predict each rank's memory in bytes, by part (parameters, gradients, master weights, optimizer state, "
                        "activation peak with receive buffers), for twinpipe train's GPT trained with these options: what its "
                        "train-log.json lists as 'predicted' (AdamW, CPU; with --experts the activations are an upper bound)")
    added = []
    for name in ("layers", "dim", "heads", "seq_len", "vocab", "microbatch_size", "dtype", "dp", "experts", "top_k"):
        if name not in have:
            extra = {"choices": tuple(ELSIZE)} if name == "dtype" else {}
            default = str(TRAIN_DEFAULTS.get(name, TOP_K))
            added.append(cli_options.add(parser, name, group=g, default=None, default_text=default, **extra))
    added.append(g.add_argument("--precision", default=None, choices=PRECISIONS, help=f"train's --precision (default: {PURE})"))
    added.append(g.add_argument("--mtp-depth", type=int, default=None, metavar="D",
                                help="train's --mtp-depth: multi-token prediction modules on the last stage (default: 0)"))
    added.append(g.add_argument("--zero", type=int, default=None, choices=(0, 1), help="train's --zero (default: 0)"))
    added.append(g.add_argument("--no-overlap-dp", dest="overlap_dp", action="store_const", const=False, default=None,
                                help="train's --no-overlap-dp (changes ZeRO-1's shards)"))
    added.append(g.add_argument("--transport", default=None, choices=TRANSPORTS,
                                help="auto (default): shared memory between CPU ranks on one host (train's); "
                                     "process-group: gloo messages"))
    parser.set_defaults(_gpt_options=tuple((a.dest, a.option_strings[0]) for a in added), _gpt_have=tuple(have))


def check_gpt_options(args) -> None:
    """ValueError when an option only ``--gpt`` reads is given without it."""
    if args.gpt:
        return
    given = [flag for dest, flag in getattr(args, "_gpt_options", ()) if getattr(args, dest, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: only with --gpt (the memory of twinpipe train's GPT)")


def gpt_settings(args) -> dict:
    """The --gpt options as given, twinpipe train's defaults for the others."""
    names = ("layers", "dim", "heads", "seq_len", "vocab", "microbatch_size", "dtype", "dp", "precision", "zero", "experts",
             "mtp_depth")
    out = {name: getattr(args, name, None) for name in names}
    out = {name: TRAIN_DEFAULTS[name] if value is None else value for name, value in out.items()}
    out["top_k"] = TOP_K if getattr(args, "top_k", None) is None else args.top_k
    out["overlap_dp"] = getattr(args, "overlap_dp", None) is not False
    out["transport"] = getattr(args, "transport", None) or "auto"
    return out


def gpt_run(args) -> GPTRun:
    """The ``GPTRun`` the options describe (ValueError naming the bad one)."""
    o = gpt_settings(args)
    if not o["experts"] and getattr(args, "top_k", None) is not None and "experts" not in getattr(args, "_gpt_have", ()):
        raise checks.bad("--top-k", args.top_k, "needs --experts: a dense model (--experts 0) routes no tokens")
    return GPTRun(o["layers"], o["dim"], o["seq_len"], o["heads"], o["vocab"], o["microbatch_size"], dtype=o["dtype"],
                  precision=o["precision"], zero=o["zero"], overlap_dp=o["overlap_dp"], flattens=o["transport"] == "process-group",
                  experts=o["experts"], top_k=o["top_k"], mtp_depth=o["mtp_depth"])


def memory_table(title: str, ranks: list[RankPrediction], caption: str = "", bound: bool = False):
    """A rich table: one row per rank, its parts and total; ``bound``: the activations are an upper
    bound (MoE blocks), said in the caption."""
    from rich.table import Table

    caption = "; ".join(c for c in (caption, BOUND_NOTE if bound else "") if c)
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
