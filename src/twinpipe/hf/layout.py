"""Where a causal LM is cut into pipeline stages: a Megatron-style layout string, or a balance.

A layout lists the stages in order, separated by ``|``; a stage is a comma-separated list of
items: ``E`` (the token embedding), ``t`` (one decoder layer), ``L`` (the final norm, the LM head
and the loss); ``X*n`` repeats an item ``n`` times. ``"E,t*3|t*4|t*4|t*3,L"`` cuts a 14-layer model
into 4 stages. ``E`` must open the first stage, ``L`` close the last, every stage must hold at least
one item, and the ``t`` count must equal the model's number of layers. Spaces are ignored.

Pure Python: a layout is checked before any model is built.
"""

from __future__ import annotations

import re
from typing import Sequence

from twinpipe.checks import bad

__all__ = ["parse_layout", "format_layout", "balanced_layout", "BALANCE"]

BALANCE = ("params", "time")
_ITEM = re.compile(r"^(E|t|L)(?:\*(\d+))?$")


def parse_layout(layout: str, num_stages: int, num_layers: int) -> list[list[str]]:
    """``layout`` as one list of items (``"E"``, ``"t"``, ``"L"``) per stage, or a ValueError saying
    what it must be."""
    def fail(why: str) -> ValueError:
        return bad("layout", layout, f"must be {num_stages} stage(s) separated by '|', each a comma-separated list of "
                                     f"E, t, L (X*n repeats X), E first, L last, {num_layers} t in all; {why}")

    if not isinstance(layout, str):
        raise fail("it is not a str")
    stages = []
    for s, text in enumerate(layout.replace(" ", "").split("|")):
        items = []
        for token in text.split(",") if text else []:
            match = _ITEM.match(token)
            if not match:
                raise fail(f"stage {s} has {token!r}")
            count = int(match.group(2)) if match.group(2) is not None else 1
            if count < 1:
                raise fail(f"stage {s} repeats {match.group(1)} {count} times")
            items += [match.group(1)] * count
        if not items:
            raise fail(f"stage {s} is empty")
        stages.append(items)
    if len(stages) != num_stages:
        raise fail(f"it has {len(stages)} stage(s)")
    flat = [item for stage in stages for item in stage]
    if flat.count("E") != 1 or flat[0] != "E":
        raise fail("E must appear once, as the first item")
    if flat.count("L") != 1 or flat[-1] != "L":
        raise fail("L must appear once, as the last item")
    if flat.count("t") != num_layers:
        raise fail(f"it has {flat.count('t')} t")
    return stages


def format_layout(stages: Sequence[Sequence[str]]) -> str:
    """The layout string of per-stage item lists (runs of ``t`` written ``t*n``)."""
    out = []
    for items in stages:
        tokens, i = [], 0
        while i < len(items):
            j = i
            while j < len(items) and items[j] == items[i]:
                j += 1
            tokens.append(items[i] if j - i == 1 else f"{items[i]}*{j - i}")
            i = j
        out.append(",".join(tokens))
    return "|".join(out)


def balanced_layout(weights: Sequence[float], num_stages: int) -> list[list[str]]:
    """The layout whose heaviest stage is lightest, from the weights of the items in model order:
    the embedding, each decoder layer, the head (norm + LM head)."""
    from twinpipe.train.balance import partition  # torch-free at import time of this module

    n = len(weights)
    if num_stages > n:
        raise bad("num_stages", num_stages, f"must be at most {n}: the model has {n - 2} layers plus the embedding "
                                            "and the head, and each stage needs one of them")
    items = ["E"] + ["t"] * (n - 2) + ["L"]
    stages, start = [], 0
    for count in partition(list(weights), num_stages):
        stages.append(items[start:start + count])
        start += count
    return stages
