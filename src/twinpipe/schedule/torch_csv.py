"""Schedules as ``torch.distributed.pipelining`` action CSVs (the compute-only format), both ways.

One row per rank, one action per cell: ``0F3`` forward of stage 0 on micro-batch 3, ``0I3`` its
input-gradient backward (our B), ``0W3`` its weight gradient (our W), ``0B3`` a full backward (our
BW), ``(0F5;7B2)OVERLAP_F_B`` a forward overlapped with a full backward (our FB). An empty cell is
a bubble. ``_PipelineScheduleRuntime._load_csv`` reads such a file (torchtitan:
``pipeline_parallel_schedule_csv``); ``from_torch_csv`` reads one here. No torch import.

Torch's runtime has one chain of stages, stage s feeding stage s+1, and every micro-batch passes
every stage. So a schedule whose micro-batches walk several chains (DualPipe's two directions
over mirrored weight copies; Chimera, BitPipe) cannot be written in this format: ``to_torch_csv``
says so instead of writing a file torch would run wrongly.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from types import MappingProxyType

from twinpipe.schedule.check import check_work
from twinpipe.schedule.ops import BW, FB, Op, OpKind, Schedule, B, F, W
from twinpipe.schedule.placement import Placement, linear, looped, vshape

__all__ = ["unexpressible", "placement_unexpressible", "to_torch_csv", "write_torch_csv", "from_torch_csv", "parse_torch_csv"]

_TO_TORCH = MappingProxyType({OpKind.F: "F", OpKind.B: "I", OpKind.W: "W", OpKind.BW: "B"})
_FROM_TORCH = MappingProxyType({"F": F, "I": B, "W": W, "B": BW})
_SIMPLE = re.compile(r"^(\d+)(F|I|W|B)(\d+)$")
_OVERLAP = re.compile(r"^\((\d+)F(\d+);(\d+)B(\d+)\)OVERLAP_F_B$")
# Actions torch's lowering adds (compute_comms format): our lowering derives them from the placement.
_LOWERED = re.compile(r"^\d+(SEND_F|RECV_F|SEND_B|RECV_B)\d+$|^\d+(UNSHARD|RESHARD|REDUCE_GRAD)$")


def unexpressible(schedule: Schedule) -> str | None:
    """Why torch's CSV format cannot express ``schedule``, or None if it can."""
    split = next((op for ops in schedule.ops for op in ops if op.backward is not None and op.backward.kind is OpKind.B), None)
    if split is not None:
        return (f"{schedule.name}: its F&B op {split} overlaps a forward with an input-gradient backward (B); "
                "torch's OVERLAP_F_B pairs a forward with a full backward only")
    return placement_unexpressible(schedule.name, schedule.placement)


def placement_unexpressible(name: str, placement: Placement) -> str | None:
    """Why torch's CSV format cannot express a schedule ``name`` on ``placement``, or None if it can."""
    if len(placement.chains) != 1:
        return (f"{name}: its micro-batches walk {len(placement.chains)} chains of stages (two pipeline directions over "
                "mirrored weight copies); torch's runtime has one chain, every micro-batch passing every stage, and no weight copies")
    if placement.chains[0] != tuple(range(placement.num_stages)):
        return f"{name}: its chain visits stages in the order {placement.chains[0]}; torch's runtime needs stage s to feed stage s+1"
    return None


def _cell(op: Op) -> str:
    if op.kind is OpKind.FB:
        back = op.backward
        return f"({op.stage}F{op.microbatch};{back.stage}B{back.microbatch})OVERLAP_F_B"
    return f"{op.stage}{_TO_TORCH[op.kind]}{op.microbatch}"


def to_torch_csv(schedule: Schedule) -> str:
    """``schedule`` as torch's compute-only CSV text; ValueError naming the reason if it cannot be."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    why = unexpressible(schedule)
    if why:
        raise ValueError(f"cannot export to torch CSV: {why}")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for ops in schedule.ops:
        writer.writerow([_cell(op) for op in ops])
    return out.getvalue()


def write_torch_csv(schedule: Schedule, path: str | Path) -> Path:
    """Write ``to_torch_csv(schedule)`` to ``path`` (parents created); returns the path."""
    text = to_torch_csv(schedule)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _op(text: str, rank: int, column: int) -> Op | None:
    text = text.strip()
    if not text or _LOWERED.match(text):
        return None
    if m := _SIMPLE.match(text):
        return _FROM_TORCH[m.group(2)](int(m.group(1)), int(m.group(3)))
    if m := _OVERLAP.match(text):
        s0, m0, s1, m1 = map(int, m.groups())
        return FB(F(s0, m0), BW(s1, m1))
    raise ValueError(f"torch CSV rank {rank} (row {rank + 1}) column {column + 1}: action {text!r} is not one of "
                     "'3F7', '3I7', '3W7', '3B7', '(0F5;7B2)OVERLAP_F_B' (or a communication action, which is ignored)")


def _placement(stage_ranks: list[int], num_ranks: int) -> Placement:
    """The known placement these stage ranks form (linear, V, looped), else a one-chain custom one."""
    n = len(stage_ranks)
    known = []
    if n == num_ranks:
        known.append(linear(num_ranks))
    if n == 2 * num_ranks:
        known.append(vshape(num_ranks))
    if n > num_ranks and n % num_ranks == 0:
        known.append(looped(num_ranks, n // num_ranks))
    for placement in known:
        if list(placement.stage_ranks) == stage_ranks:
            return placement
    return Placement("custom", num_ranks, tuple(stage_ranks), (tuple(range(n)),))


def parse_torch_csv(text: str, name: str = "torch-csv") -> Schedule:
    """A Schedule from torch CSV text: ranks are rows, stage ranks inferred, then validated."""
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()  # a trailing blank line is not a rank
    if not rows:
        raise ValueError("torch CSV: no rows; expected one row of actions per rank")
    ops = [[op for c, cell in enumerate(row) if (op := _op(cell, r, c)) is not None] for r, row in enumerate(rows)]
    owner: dict[int, int] = {}
    microbatches = 0
    for rank, rank_ops in enumerate(ops):
        for op in rank_ops:
            for part in op.parts():
                if owner.setdefault(part.stage, rank) != rank:
                    raise ValueError(f"torch CSV: stage {part.stage} appears on rank {owner[part.stage]} and rank {rank}; a stage lives on one rank")
                microbatches = max(microbatches, part.microbatch + 1)
    missing = [s for s in range(max(owner, default=-1) + 1) if s not in owner]
    if not owner or missing:
        raise ValueError(f"torch CSV: stages must be 0..N-1 with no gap; no action names stage(s) {missing or [0]}")
    placement = _placement([owner[s] for s in range(len(owner))], len(rows))
    schedule = Schedule(name, placement, microbatches, tuple(tuple(r) for r in ops))
    check_work(schedule)
    return schedule


def from_torch_csv(path: str | Path, name: str | None = None) -> Schedule:
    """Read a torch pipelining CSV (``_dump_csv``, torchtitan's ``pipeline_parallel_schedule_csv``) as a Schedule.

    The Schedule is validated here (``check_work``: every op once, on its stage's rank, nothing
    missing), so it can be simulated and drawn like a registered one. Communication and FSDP
    actions of the compute_comms format are skipped: our lowering derives messages itself.
    """
    path = Path(path)
    return parse_torch_csv(path.read_text(), name or path.stem)
