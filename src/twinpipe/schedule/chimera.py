"""Chimera (Li & Hoefler, SC'21): two pipelines in opposite directions over mirrored stage copies.

D ranks (even) hold two copies of a D-stage model (the ``dual`` placement): the *down* pipeline
(chain 0) puts model stage s on rank s, the *up* pipeline (chain 1) on rank D-1-s. Half the
micro-batches go down, half up. Ops are placed in *slots* of one F or one full backward BW (the
paper's unit, T_F = T_B + T_W). In a basic unit each pipeline injects D/2 micro-batches, one every
two slots; micro-batch i of a unit runs F on its chain's stage k in slot 2i + k and BW in slot
2i + 2D-1-k (1F1B-like: the backward starts as soon as the last forward is done).

Why no two ops meet in one slot: on rank w the down forwards and the up backwards fall on slots of
w's parity, the up forwards and down backwards on the other parity, and each parity class is one
run of D consecutive slots of that parity. Unit u is the basic unit shifted by 2D slots, so the
units tile both classes: every rank is busy from its first op to its last except the D-2 bubble
slots of the first and last unit, and the span is 2N + D - 2 slots for N = m micro-batches in
whole units. A last, partial unit is a full unit with the missing micro-batches left out.

Each rank runs its ops in slot order. Only k = 1 pipeline pair is built (k > 1 pairs would put 2k
copies of the model on the ranks; the mirrored-gradient sync pairs exactly two).
"""

from __future__ import annotations

from twinpipe.schedule.ops import BW, F, Op, Schedule
from twinpipe.schedule.placement import dual

__all__ = ["chimera", "slots", "check_even"]

_NAME = "chimera"


def check_even(schedule: str, name: str, value) -> int:
    """``value`` as an even int >= 2, else ValueError (two directions need an even count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value % 2:
        raise ValueError(f"{schedule}: {name}={value!r} is not allowed; it must be an even integer >= 2")
    return value


def slots(num_ranks: int, num_microbatches: int) -> list[list[tuple[int, Op]]]:
    """Per rank, ``(slot, op)`` for every op, sorted by slot (slot = one F or one BW)."""
    d = check_even(_NAME, "num_ranks", num_ranks)
    m = check_even(_NAME, "num_microbatches", num_microbatches)
    placement = dual(d)
    per_direction, per_unit = m // 2, d // 2
    table: list[list[tuple[int, Op]]] = [[] for _ in range(d)]
    for direction, chain in enumerate(placement.chains):
        for k in range(per_direction):
            unit, i = divmod(k, per_unit)
            start = 2 * d * unit + 2 * i
            j = direction * per_direction + k
            for position, stage in enumerate(chain):
                rank = placement.rank_of(stage)
                table[rank].append((start + position, F(stage, j)))
                table[rank].append((start + 2 * d - 1 - position, BW(stage, j)))
    for rank, entries in enumerate(table):
        entries.sort(key=lambda e: e[0])
        taken = [slot for slot, _ in entries]
        if len(set(taken)) != len(taken):  # the parity argument above says this cannot happen
            raise RuntimeError(f"{_NAME}: two ops share a slot on rank {rank}; this is a bug")
    return table


def chimera(num_ranks: int, num_microbatches: int) -> Schedule:
    """Chimera with one pipeline pair on an even ``num_ranks`` >= 2, for an even
    ``num_microbatches`` >= 2 (half per direction; whole basic units when a multiple of ``num_ranks``)."""
    table = slots(num_ranks, num_microbatches)
    ops = tuple(tuple(op for _, op in entries) for entries in table)
    return Schedule(_NAME, dual(num_ranks), num_microbatches, ops)
