"""Operations and schedules: the plain data every other layer reads.

A schedule is, for each rank, an ordered list of compute operations. Communication is not
written down here: it follows from the placement (see ``lower.py``).

String forms (used in messages and tests): ``3F7`` is the forward of stage 3 on micro-batch 7,
``3B7`` its input-gradient backward, ``3W7`` its weight-gradient pass, ``3BW7`` a full backward,
``(0F5;7BW2)`` a forward overlapped with a full backward (DualPipe's "F&B") and ``(0F5;0B2)`` a
forward overlapped with an input-gradient backward (the B/W-split schedules' F&B: its W comes later).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from twinpipe.schedule.placement import Placement

__all__ = ["OpKind", "Op", "Schedule", "F", "B", "W", "BW", "FB", "parse_op"]


class OpKind(str, Enum):
    """What an operation computes."""

    F = "F"  # forward
    B = "B"  # backward for inputs only; the weight gradient waits for W
    W = "W"  # weight gradient of an earlier B
    BW = "BW"  # full backward: B and W at once
    FB = "FB"  # forward of one micro-batch overlapped with the backward (BW, or B) of another

    def __str__(self) -> str:
        return self.value


_FB_KIND = OpKind.FB
_BACKWARD_HALVES = (OpKind.BW, OpKind.B)


@dataclass(frozen=True, slots=True)
class Op:
    """One compute operation on one stage and micro-batch.

    For ``FB``, ``stage``/``microbatch`` name the forward half and ``backward`` the backward it
    is overlapped with: a full backward (``BW``) or, in schedules that split B and W, an
    input-gradient backward (``B``) whose ``W`` is a later op.
    """

    kind: OpKind
    stage: int
    microbatch: int
    backward: Op | None = None

    def __post_init__(self) -> None:
        if self.backward is None and self.kind is not _FB_KIND:  # the common case, first: schedules hold millions of ops
            return
        if (self.kind is OpKind.FB) != (self.backward is not None):
            raise ValueError(f"op {self.kind}: an FB op needs a backward half, no other op has one")
        if self.backward is not None and self.backward.kind not in _BACKWARD_HALVES:
            raise ValueError(f"the backward half of an FB op must be BW or B, got {self.backward.kind}")

    def parts(self) -> tuple[Op, ...]:
        """The simple ops this op performs: itself, or (F, its backward half) for an FB op."""
        if self.backward is None:
            return (self,)
        return (Op(OpKind.F, self.stage, self.microbatch), self.backward)

    @property
    def forward(self) -> Op | None:
        """The forward half of an F or FB op, else None."""
        if self.kind is OpKind.F:
            return self
        if self.kind is OpKind.FB:
            return Op(OpKind.F, self.stage, self.microbatch)
        return None

    def __str__(self) -> str:
        if self.backward is not None:
            return f"({self.stage}F{self.microbatch};{self.backward})"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Op({self})"


def F(stage: int, microbatch: int) -> Op:
    return Op(OpKind.F, stage, microbatch)


def B(stage: int, microbatch: int) -> Op:
    return Op(OpKind.B, stage, microbatch)


def W(stage: int, microbatch: int) -> Op:
    return Op(OpKind.W, stage, microbatch)


def BW(stage: int, microbatch: int) -> Op:
    return Op(OpKind.BW, stage, microbatch)


def FB(forward: Op, backward: Op) -> Op:
    """Overlap ``forward`` (an F op) with ``backward`` (a BW op, or a B op whose W runs later)."""
    if forward.kind is not OpKind.F:
        raise ValueError(f"FB needs an F op first, got {forward}")
    if backward.kind not in _BACKWARD_HALVES:
        raise ValueError(f"FB needs a BW or B op second, got {backward}")
    return Op(OpKind.FB, forward.stage, forward.microbatch, backward)


_SIMPLE = re.compile(r"^(\d+)(BW|F|B|W)(\d+)$")
_PAIR = re.compile(r"^\((\d+)F(\d+);(\d+)(BW|B)(\d+)\)$")


def parse_op(text: str) -> Op:
    """Inverse of ``str(op)``: ``parse_op("3F7") == F(3, 7)``."""
    text = text.strip()
    if m := _PAIR.match(text):
        s0, m0, s1, kind, m1 = m.groups()
        return FB(F(int(s0), int(m0)), Op(OpKind(kind), int(s1), int(m1)))
    if m := _SIMPLE.match(text):
        return Op(OpKind(m.group(2)), int(m.group(1)), int(m.group(3)))
    raise ValueError(f"op string {text!r} is not of the form '3F7', '3B7', '3W7', '3BW7' or '(0F5;7BW2)' / '(0F5;0B2)'")


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: for each rank, the ordered compute ops it runs.

    ``num_microbatches`` counts every micro-batch of every chain; chain ``k`` of the placement
    carries micro-batches ``placement.microbatches_of_chain(k, num_microbatches)``.
    """

    name: str
    placement: Placement
    num_microbatches: int
    ops: tuple[tuple[Op, ...], ...]
    options: dict = field(default_factory=dict, compare=False)

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    def to_strings(self) -> list[list[str]]:
        """Per rank, the string form of each op (handy in tests and messages)."""
        return [[str(op) for op in rank_ops] for rank_ops in self.ops]

    def kinds_string(self, rank: int) -> str:
        """Ops of one rank as kind letters, e.g. ``FFFBWFBW...`` (FB is written ``X``)."""
        return "".join("X" if op.kind is OpKind.FB else op.kind.value for op in self.ops[rank])

    def with_ops(self, ops) -> Schedule:
        """A copy with other op lists (for tests that corrupt a schedule on purpose)."""
        return Schedule(self.name, self.placement, self.num_microbatches, tuple(tuple(r) for r in ops), self.options)
