"""The command line's one vocabulary: each idea the sub-commands share, spelled once.

Every sub-command (``demo``, ``demo --moe``, ``train``, ``simulate``, ``draw``, ``plan``, ``export``,
``eplb``) adds a shared option through ``add(parser, name)``: the flag its ``--help`` shows, the
words that explain it, its type and the check its value must pass. Earlier spellings of the same
idea (``--ranks`` for ``--pp``, ``--chunks`` for ``--microbatches``...) still parse, as hidden
options writing the same value; help lists only ``flag``. Used in a terminal, an old spelling gets a
one-line note on stderr naming the new one (scripts and logs are left alone).

``check(args, parser)`` holds the values of a parser's shared options to their bounds after parsing,
with ``twinpipe.checks``: one phrasing, ``--flag=value: must be ...``, naming the flag help shows.
Pure Python: no torch.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import KW_ONLY, dataclass
from types import MappingProxyType

from twinpipe.checks import MAX_TIMEOUT, MIN_TIMEOUT, check_float, check_int

__all__ = ["Option", "VOCABULARY", "add", "check", "old_spellings", "missing"]


@dataclass(frozen=True)
class Option:
    """One shared idea: ``flag`` (the one spelling help shows), ``words`` (what it is, in every
    command's help), ``type``, ``metavar``, ``old`` (earlier spellings, still parsed, never shown),
    and the bounds ``check`` holds its value to (``low``/``high``; ``low_open``: strictly above)."""

    flag: str
    words: str
    type: type | None = int
    metavar: str | None = None
    _: KW_ONLY
    old: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


VOCABULARY: MappingProxyType[str, Option] = MappingProxyType({o.dest: o for o in (
    # the pipeline and the step
    Option("--schedule", "pipeline schedule", str, "NAME"),
    Option("--pp", "pipeline ranks", int, "P", old=("--ranks", "-p"), low=1),
    Option("--dp", "data-parallel replicas", int, "DP", low=1),
    Option("--ep", "expert-parallel ranks", int, "EP", low=1),
    Option("--microbatches", "micro-batches per step", int, "M", old=("--chunks", "-m"), low=1),
    Option("--microbatch-size", "sequences per micro-batch", int, "B", low=1),
    Option("--stages-per-rank", "stages per rank (interleaved-1f1b)", int, "V", low=1),
    Option("--overlap", "pair each steady-phase forward with the backward after it as one overlapped F&B op "
           "(1f1b, interleaved-1f1b, zb-h1, zb-h2, zbv; docs/schedules.md)", None, None),
    Option("--overlap-warmup", "extra warm-up forwards before the overlapped steady phase (Kimi K2), "
           "one more micro-batch's activations held per rank each; with --overlap", int, "K", low=0),
    Option("--steps", "training steps", int, "N", low=1),
    Option("--lr", "learning rate", float, "LR", low=0, low_open=True),
    Option("--device", "cpu: gloo, one process per rank; cuda: NCCL, one GPU per rank", str, None),
    Option("--dtype", "parameter and activation dtype", str, None),
    Option("--threads", "torch threads per CPU rank", int, "N", low=1),
    Option("--timeout", "seconds any wait for a peer may take", float, "SECONDS", low=MIN_TIMEOUT, high=MAX_TIMEOUT),
    # the model: the names of twinpipe.train.GPTConfig's fields
    Option("--layers", "transformer blocks", int, "L", low=1),
    Option("--dim", "model width (hidden size)", int, "DIM", old=("--hidden",), low=1),
    Option("--heads", "attention heads; must divide --dim", int, "H", low=1),
    Option("--seq-len", "tokens per sequence", int, "T", old=("--seq",), low=1),
    Option("--blocks-per-stage", "transformer blocks in each pipeline stage", int, "BLOCKS", old=("--blocks",), low=1),
    Option("--ffn", "MLP width", int, "WIDTH", low=0),
    Option("--vocab", "vocabulary (embedding and head)", int, "V", low=1),
    Option("--experts", "routed experts per MoE block (0: dense MLPs)", int, "E", low=0),
    Option("--top-k", "experts each token is routed to", int, "K", low=1),
    Option("--expert-ffn", "width of one expert's MLP", int, "WIDTH", old=("--expert-hidden",), low=0),
    # EPLB in the loop (twinpipe.train.TrainConfig's eplb_* and redundant_experts)
    Option("--eplb-every", "re-place the MoE experts every N steps from their measured loads (EPLB; 0: never)", int, "N", low=0),
    Option("--redundant-experts", "extra expert slots per MoE block, for replicas of the busiest experts; a multiple of --ep",
           int, "R", low=0),
    Option("--eplb-window", "steps of loads a rebalance decides from", int, "W", low=1),
    Option("--eplb-threshold", "re-place a block only when its max/mean EP-rank load is above this", float, "T", low=1),
    # what a command writes
    Option("--out", "where to write", str, "PATH", old=("--output", "-o")),
    Option("--trace", "record the last step", str, "DIR"),
    Option("--plot", "also draw a picture to this file", str, "FILE"),
    Option("--json", "print JSON instead of a table", None, None),
    Option("--gpus", "GPUs in all", int, "GPUS", low=1),
)})


def _default_text(default) -> str:
    return "" if default is None or default is False else f" (default: {default})"


def add(parser: argparse.ArgumentParser, name: str, *, group=None, default=None, more: str = "",
        default_text: str | None = None, **argparse_kwargs) -> argparse.Action:
    """Add the shared option ``name`` (a key of ``VOCABULARY``) to ``parser`` (or its ``group``);
    ``more`` adds what is particular to this command to the shared words; ``default_text`` replaces
    the ``(default: ...)`` help shows. Its old spellings go to ``parser`` too, hidden. Returns the action.
    """
    option = VOCABULARY[name]
    target = group if group is not None else parser
    words = option.words + (f"; {more}" if more else "")
    shown = _default_text(default) if default_text is None else f" (default: {default_text})"
    if option.type is None:  # a switch
        action = target.add_argument(option.flag, action="store_true", help=words + shown, **argparse_kwargs)
    else:
        kwargs = dict(type=option.type, default=default, metavar=option.metavar, help=words + shown)
        kwargs.update(argparse_kwargs)
        action = target.add_argument(option.flag, **kwargs)
        for spelling in option.old:
            old = parser.add_argument(spelling, dest=action.dest, type=action.type, choices=action.choices,
                                      default=argparse.SUPPRESS, help=argparse.SUPPRESS, action=_OldSpelling)
            old.new_flag = option.flag
    action.vocabulary = name
    return action


class _OldSpelling(argparse._StoreAction):
    """An earlier spelling of a shared option: stores the value where the new spelling does."""

    new_flag = ""

    def __call__(self, parser, namespace, values, option_string=None):
        if sys.stderr.isatty():  # a person at a terminal learns the new spelling; scripts and logs stay clean
            print(f"{parser.prog}: note: {option_string} is now spelled {self.new_flag} (the old spelling still works)",
                  file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def old_spellings() -> dict[str, str]:
    """Every old spelling -> the flag that replaced it."""
    return {old: o.flag for o in VOCABULARY.values() for old in o.old}


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Hold every shared option ``parser`` has to its bounds (ValueError ``--flag=value: must be ...``);
    an option left at None (not given, no default) is not checked."""
    seen = set()
    for action in parser._actions:
        name = getattr(action, "vocabulary", None)
        if name is None or name in seen:
            continue
        seen.add(name)
        option, value = VOCABULARY[name], getattr(args, action.dest, None)
        if value is None or (option.low is None and option.high is None):
            continue
        if option.type is int:
            check_int(value, option.flag, low=option.low, high=option.high)
        elif option.type is float:
            check_float(value, option.flag, low=option.low, high=option.high, low_open=option.low_open)


def missing(args: argparse.Namespace, parser: argparse.ArgumentParser, *names: str) -> list[str]:
    """The flags of the shared options ``names`` that ``args`` leaves at None: ``missing --pp`` (an
    option a command needs is checked here, not by argparse, so an old spelling counts as given)."""
    dests = {getattr(a, "vocabulary", None): a.dest for a in parser._actions}
    return [VOCABULARY[n].flag for n in names if getattr(args, dests.get(n, VOCABULARY[n].dest), None) is None]
