"""Chimera (Li & Hoefler, SC'21): pipelines in opposite directions over copies of the model.

D ranks (even) hold 2k copies of a D-stage model, k = ``pairs`` (default 1), on the
``dual_pairs`` placement: chain 2i, the *down* pipeline i, puts model stage s on rank
(s + iD/k) mod D; chain 2i+1, the *up* pipeline i, on rank (D-1-s + iD/k) mod D. With k = 1 this
is the ``dual`` placement (down: stage s on rank s, up: on rank D-1-s). 2k must divide D; each
rank then holds 2k stages, one of each chain, and no two copies of one model stage. The
micro-batches are split evenly over the 2k chains (so their count is a multiple of 2k).

Ops are placed in *slots* of one F or one full backward BW (the paper's unit, T_F = T_B + T_W). A
*basic unit* is N = D micro-batches, D/(2k) per pipeline; all pipelines inject at once, one
micro-batch every two slots: micro-batch x of a unit runs F on its chain's position q in slot
2x + q and BW in slot 2x + 2D-1-q (1F1B-like: the backward starts as soon as the last forward is
done).

Why no two ops meet in one slot: let h = D/k (even) and r = w mod h. Rank w holds, of the down
pipelines, the positions r, r+h, ..., r+(k-1)h, one per pipeline, and of the up pipelines
h-1-r, h-1-r+h, .... The down forwards on w fall on the slots r+jh+2x (j < k, x < h/2), which is
one run r, r+2, ..., r+D-2; the up backwards on D+r, ..., 2D-2+r. So these two kinds fill one
run of D consecutive slots of r's parity, from r to r+2D-2. Likewise the up forwards and down
backwards fill h-1-r, ..., h-1-r+2D-2, of the other parity (h is even). Unit u is the basic unit
shifted by 2D slots, so the units continue both runs without a gap.

Span: with N = m micro-batches in whole units, each run of rank w is N slots of one parity, from
r (or h-1-r) to r+2N-2 (or h-1-r+2N-2). The earliest rank starts in slot 0 (r = 0), the latest
ends in slot h-1+2N-2 (r = 0 or h-1), so the span is 2N + D/k - 2 slots, and each rank, busy
2N of them, idles D/k - 2 (bubble ratio (D/k - 2) / (2N + D/k - 2); k = 1: the paper's
2N + D - 2; k = D/2 has no bubble but holds the whole model on every rank). A last, partial unit
is a full unit with the missing micro-batches left out.

Each rank runs its ops in slot order.
"""

from __future__ import annotations

from twinpipe import checks
from twinpipe.schedule.ops import BW, F, Op, Schedule
from twinpipe.schedule.placement import Placement, dual, dual_pairs

__all__ = ["chimera", "slots", "check_even", "placement", "allowed_pairs", "variants"]

_NAME = "chimera"


def check_even(schedule: str, name: str, value) -> int:
    """``value`` as an even int >= 2, else ValueError (two directions need an even count)."""
    return checks.check_int(value, f"{schedule}: {name}", low=2, multiple_of=2)


def allowed_pairs(num_ranks: int) -> list[int]:
    """The pair counts k that ``num_ranks`` ranks allow: 2k divides num_ranks."""
    return [k for k in range(1, num_ranks // 2 + 1) if num_ranks % (2 * k) == 0]


def variants(num_ranks: int) -> list[dict]:
    """More than one pair, for the planner to compare: ``{"pairs": k}`` for each allowed k > 1."""
    return [{"pairs": k} for k in allowed_pairs(num_ranks) if k > 1]


def _check_pairs(num_ranks: int, pairs) -> int:
    """``pairs`` as an int k >= 1 with 2k dividing ``num_ranks`` (any ``num_ranks`` for k = 1, the
    ``dual`` placement; the generator asks for an even one), else ValueError."""
    def refused() -> ValueError:
        allowed = ", ".join(map(str, allowed_pairs(num_ranks))) or "none, num_ranks must be even"
        return checks.bad(f"{_NAME}: pairs", pairs,
                          f"must be an int >= 1 with 2*pairs dividing num_ranks={num_ranks} (here: {allowed})")

    try:
        pairs = checks.check_int(pairs, f"{_NAME}: pairs", low=1)
    except ValueError:
        raise refused() from None
    if pairs > 1:
        check_even(_NAME, "num_ranks", num_ranks)
        if num_ranks % (2 * pairs):
            raise refused()
    return pairs


def placement(num_ranks: int, pairs: int = 1) -> Placement:
    """Which rank holds each stage: ``dual_pairs(num_ranks, pairs)`` (``dual`` for one pair)."""
    pairs = _check_pairs(num_ranks, pairs)
    return dual(num_ranks) if pairs == 1 else dual_pairs(num_ranks, pairs)


def _check_microbatches(num_microbatches, pairs: int) -> int:
    if pairs == 1:
        return check_even(_NAME, "num_microbatches", num_microbatches)
    return checks.check_int(num_microbatches, f"{_NAME}: num_microbatches", low=2 * pairs, multiple_of=2 * pairs,
                            why=f"2*pairs for pairs={pairs}: an equal share for each of the {2 * pairs} pipelines")


def slots(num_ranks: int, num_microbatches: int, pairs: int = 1) -> list[list[tuple[int, Op]]]:
    """Per rank, ``(slot, op)`` for every op, sorted by slot (slot = one F or one BW)."""
    d = check_even(_NAME, "num_ranks", num_ranks)
    k = _check_pairs(d, pairs)
    m = _check_microbatches(num_microbatches, k)
    layout = placement(d, k)
    per_chain, per_unit = m // (2 * k), d // (2 * k)
    table: list[list[tuple[int, Op]]] = [[] for _ in range(d)]
    for c, chain in enumerate(layout.chains):
        for i in range(per_chain):
            unit, x = divmod(i, per_unit)
            start = 2 * d * unit + 2 * x
            j = c * per_chain + i
            for position, stage in enumerate(chain):
                rank = layout.rank_of(stage)
                table[rank].append((start + position, F(stage, j)))
                table[rank].append((start + 2 * d - 1 - position, BW(stage, j)))
    for rank, entries in enumerate(table):
        entries.sort(key=lambda e: e[0])
        taken = [slot for slot, _ in entries]
        if len(set(taken)) != len(taken):  # the parity argument above says this cannot happen
            raise RuntimeError(f"{_NAME}: two ops share a slot on rank {rank}; this is a bug")
    return table


def chimera(num_ranks: int, num_microbatches: int, pairs: int = 1) -> Schedule:
    """Chimera with ``pairs`` = k pipeline pairs on an even ``num_ranks`` that 2k divides, for
    ``num_microbatches`` a multiple of 2k (an equal share per pipeline; whole basic units when a
    multiple of ``num_ranks``)."""
    table = slots(num_ranks, num_microbatches, pairs)
    ops = tuple(tuple(op for _, op in entries) for entries in table)
    return Schedule(_NAME, placement(num_ranks, pairs), num_microbatches, ops, {"pairs": pairs} if pairs > 1 else {})
