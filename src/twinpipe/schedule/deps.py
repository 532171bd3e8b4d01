"""The dependency rule, written once: what each op needs, what it completes, what a schedule must hold.

Work is counted in *work items* ``(work, stage, micro-batch)``: ``Work.F`` the forward is done,
``Work.B`` the input gradient is done (by a B or a BW), ``Work.W`` the weight gradient is done (by a
W or a BW). Every need is on the same micro-batch, so the rule is a table per (op kind, stage):

- F needs the previous stage's F (nothing on a chain's first stage);
- B and BW need their own stage's F and the next stage's B (only the F on a chain's last stage);
- W needs its own stage's B;
- an FB needs what its F half and its backward half (BW or B) need, and neither half may need
  what the other completes: the two run at once (``coupled`` finds such a pairing).

The validator, the lowering (a need across ranks is a message), the simulator, the trace
analysis and the planners all read this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from types import MappingProxyType

from twinpipe.schedule.ops import Op, OpKind
from twinpipe.schedule.placement import Placement

__all__ = ["Work", "WORK_DONE", "Need", "DependencyTable", "dependency_table", "needs", "neighbour", "work_done", "required_work",
           "coupled"]


class Work(IntEnum):
    """What a finished op has made available for its stage and micro-batch."""

    F = 0  # outputs of the forward (activations)
    B = 1  # input gradient
    W = 2  # weight gradient

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)


# The work each simple op kind completes.
WORK_DONE: MappingProxyType[OpKind, tuple[Work, ...]] = MappingProxyType({
    OpKind.F: (Work.F,),
    OpKind.B: (Work.B,),
    OpKind.W: (Work.W,),
    OpKind.BW: (Work.B, Work.W),
})


@dataclass(frozen=True)
class Need:
    """One dependency of an op on ``stage``: ``work`` of ``stage`` (same micro-batch); ``local``
    when both stages sit on one rank (a hand-off, not a message)."""

    work: Work
    stage: int
    local: bool


def _needs_of(placement: Placement, kind: OpKind, stage: int) -> tuple[Need, ...]:
    if kind is OpKind.F:
        deps = [(Work.F, placement.prev_stage(stage))]
    elif kind is OpKind.W:
        deps = [(Work.B, stage)]
    elif kind in (OpKind.B, OpKind.BW):
        deps = [(Work.F, stage), (Work.B, placement.next_stage(stage))]
    else:
        raise ValueError(f"kind={kind!r}: dependencies are defined for F, B, W and BW (an FB is an F and a BW)")
    rank = placement.rank_of(stage)
    return tuple(Need(work, s, placement.rank_of(s) == rank) for work, s in deps if s is not None)


@dataclass(frozen=True)
class DependencyTable:
    """The rule for one placement, precomputed: ``needs[kind][stage]`` and its inverse ``consumers``."""

    placement: Placement
    needs: dict[OpKind, tuple[tuple[Need, ...], ...]]
    consumers: dict[tuple[Work, int], tuple[tuple[OpKind, int], ...]]  # (work, stage) -> (kind, stage) needing it

    def op_needs(self, op: Op) -> list[tuple[Work, int, int]]:
        """The work items ``op`` needs before it can start, as ``(work, stage, micro-batch)``."""
        return [(n.work, n.stage, part.microbatch) for part in op.parts() for n in self.needs[part.kind][part.stage]]


@lru_cache(maxsize=64)
def dependency_table(placement: Placement) -> DependencyTable:
    """The dependency table of ``placement`` (cached: placements are immutable)."""
    stages = range(placement.num_stages)
    table = {kind: tuple(_needs_of(placement, kind, s) for s in stages) for kind in WORK_DONE}
    consumers: dict[tuple[Work, int], list[tuple[OpKind, int]]] = {}
    for kind, per_stage in table.items():
        for s, stage_needs in enumerate(per_stage):
            for need in stage_needs:
                consumers.setdefault((need.work, need.stage), []).append((kind, s))
    return DependencyTable(placement, table, {key: tuple(v) for key, v in consumers.items()})


def neighbour(placement: Placement, stage: int, kind: str) -> Need | None:
    """Where ``stage`` gets what it consumes from: ``"act"``, the stage whose F output its F reads;
    ``"grad"``, the stage whose B output (the gradient) its B reads. None at the pipeline's ends."""
    if kind == "act":
        found = [n for n in dependency_table(placement).needs[OpKind.F][stage] if n.work is Work.F]
    elif kind == "grad":
        found = [n for n in dependency_table(placement).needs[OpKind.B][stage] if n.work is Work.B]
    else:
        raise ValueError(f"kind={kind!r}: allowed are 'act', 'grad'")
    return found[0] if found else None


def needs(placement: Placement, op: Op) -> list[tuple[Work, int, int]]:
    """The work items ``op`` needs before it can start, as ``(work, stage, micro-batch)``."""
    return dependency_table(placement).op_needs(op)


def work_done(op: Op) -> list[tuple[Work, int, int]]:
    """The work items ``op`` completes, as ``(work, stage, micro-batch)``."""
    return [(work, part.stage, part.microbatch) for part in op.parts() for work in WORK_DONE[part.kind]]


def coupled(placement: Placement, op: Op) -> tuple[Op, tuple[Work, int, int]] | None:
    """For an FB op whose halves depend on each other, (the half that waits, the work item it needs
    from the other half); None when the halves can run at once (or ``op`` is not an FB)."""
    if op.backward is None:
        return None
    forward, backward = op.parts()
    for waiting, other in ((forward, backward), (backward, forward)):
        made = set(work_done(other))
        for item in needs(placement, waiting):
            if item in made:
                return waiting, item
    return None


def required_work(placement: Placement, num_microbatches: int, forward_only: bool = False):
    """Every work item a complete schedule does: each stage of each chain, each micro-batch of that
    chain, F, B and W (only F when ``forward_only``)."""
    works = (Work.F,) if forward_only else tuple(Work)
    for index, chain in enumerate(placement.chains):
        microbatches = placement.microbatches_of_chain(index, num_microbatches)
        for s in chain:
            for j in microbatches:
                for work in works:
                    yield work, s, j
