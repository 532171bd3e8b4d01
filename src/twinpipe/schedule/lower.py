"""Lowering: derive every message a schedule needs and the order each pair of ranks posts them.

A message carries a stage's outputs to the next stage ("act") or input gradients back to the
previous stage ("grad"). Stages on the same rank hand tensors over locally instead (the V turn).
The messages one op sends to one peer travel together as one packet (DualPipe's F&B sends an
activation and a gradient to the same neighbour): half the point-to-point calls.

NCCL matches point-to-point messages between two ranks by order alone, and runs them one after
another. So for each pair of ranks we fix one list of the packets between them, in the order of
a valid sequential execution of the schedule (``check.validate``), and both ranks post their sends
and receives in that list's order. Because that execution is a witness that every message can be
produced before it is needed, no rank can wait forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from twinpipe.schedule.check import ScheduleError, validate
from twinpipe.schedule.deps import WORK_DONE, DependencyTable, Work, dependency_table
from twinpipe.schedule.ops import Op, Schedule

__all__ = ["Message", "Packet", "RankProgram", "LoweredSchedule", "lower", "forward_only", "check_channels"]


@dataclass(frozen=True)
class Message:
    """Tensors sent from ``src_stage`` (on ``src_rank``) to ``dst_stage`` for one micro-batch."""

    kind: str  # "act" (forward outputs) or "grad" (input gradients)
    src_stage: int
    dst_stage: int
    microbatch: int
    src_rank: int
    dst_rank: int

    def __str__(self) -> str:
        return f"{self.kind} {self.src_stage}->{self.dst_stage} mb{self.microbatch} (rank {self.src_rank}->{self.dst_rank})"


@dataclass(frozen=True)
class Packet:
    """The messages one op sends to one peer, sent and received as a unit."""

    messages: tuple[Message, ...]

    @property
    def src_rank(self) -> int:
        return self.messages[0].src_rank

    @property
    def dst_rank(self) -> int:
        return self.messages[0].dst_rank

    def __str__(self) -> str:
        return " + ".join(str(m) for m in self.messages)


@dataclass(frozen=True)
class RankProgram:
    """What one rank does: its ops, what each op receives and sends, and per-peer message order."""

    rank: int
    ops: tuple[Op, ...]
    recvs: tuple[tuple[Message, ...], ...]  # recvs[i]: messages op i needs
    sends: tuple[tuple[Message, ...], ...]  # sends[i]: messages op i produces
    channels: dict[int, tuple[Packet, ...]]  # peer -> packets with that peer, in posting order


@dataclass(frozen=True)
class LoweredSchedule:
    schedule: Schedule
    programs: tuple[RankProgram, ...]


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule with backward work removed: FB keeps its forward half, B/W/BW are dropped."""
    ops = []
    for rank_ops in schedule.ops:
        kept = [op.forward for op in rank_ops if op.forward is not None]
        ops.append(tuple(kept))
    options = {**schedule.options, "forward_only": True}
    return Schedule(schedule.name, schedule.placement, schedule.num_microbatches, tuple(ops), options)


_MESSAGE_KIND = MappingProxyType({Work.F: "act", Work.B: "grad"})  # what a need across ranks carries


def _messages_of(table: DependencyTable, op: Op) -> tuple[list[Message], list[Message]]:
    """(needed, produced) cross-rank messages of one op: the needs across ranks (``deps.py``) into
    the op, and those out of it."""
    placement = table.placement
    needed, produced = [], []
    for part in op.parts():
        s, j = part.stage, part.microbatch
        rank = placement.rank_of(s)
        for need in table.needs[part.kind][s]:
            if not need.local:
                needed.append(Message(_MESSAGE_KIND[need.work], need.stage, s, j, placement.rank_of(need.stage), rank))
        targets = {}
        for work in WORK_DONE[part.kind]:
            for _, stage in table.consumers.get((work, s), ()):
                if placement.rank_of(stage) != rank:
                    targets.setdefault((work, stage), None)  # B and BW of one stage need the same message
        produced += [Message(_MESSAGE_KIND[work], s, stage, j, rank, placement.rank_of(stage)) for work, stage in targets]
    return needed, produced


def lower(schedule: Schedule) -> LoweredSchedule:
    """Validate ``schedule`` and derive each rank's program."""
    order = validate(schedule)
    table = dependency_table(schedule.placement)
    num_ranks = schedule.num_ranks
    recvs = [[()] * len(ops) for ops in schedule.ops]
    sends = [[()] * len(ops) for ops in schedule.ops]
    channels: list[dict[int, list[Packet]]] = [{} for _ in range(num_ranks)]
    for rank, index in order:  # packets enter their channel in the order they are produced
        needed, produced = _messages_of(table, schedule.ops[rank][index])
        recvs[rank][index] = tuple(needed)
        sends[rank][index] = tuple(produced)
        for peer in dict.fromkeys(m.dst_rank for m in produced):
            packet = Packet(tuple(m for m in produced if m.dst_rank == peer))
            channels[rank].setdefault(peer, []).append(packet)
            channels[peer].setdefault(rank, []).append(packet)
    programs = tuple(
        RankProgram(
            rank,
            schedule.ops[rank],
            tuple(recvs[rank]),
            tuple(sends[rank]),
            {peer: tuple(msgs) for peer, msgs in sorted(channels[rank].items())},
        )
        for rank in range(num_ranks)
    )
    lowered = LoweredSchedule(schedule, programs)
    check_channels(lowered)
    return lowered


def check_channels(lowered: LoweredSchedule) -> None:
    """Each pair of ranks must list the messages between them in the same order, and a rank must
    never have to post a send before the op that produces it has run while a later op needs a
    receive queued behind that send (which would block forever)."""
    programs = lowered.programs
    for program in programs:
        for peer, packets in program.channels.items():
            theirs = programs[peer].channels.get(program.rank, ())
            if packets != theirs:
                k = next((i for i, (a, b) in enumerate(zip(packets, theirs)) if a != b), min(len(packets), len(theirs)))
                mine = str(packets[k]) if k < len(packets) else "nothing"
                other = str(theirs[k]) if k < len(theirs) else "nothing"
                raise ScheduleError(
                    "send/receive order",
                    f"packet {k} with rank {peer} is {mine} here but {other} on rank {peer}; "
                    "both ranks must post sends and receives in the same order",
                    program.rank,
                )
        _check_channel_progress(program)


def _check_channel_progress(program: RankProgram) -> None:
    # Packets are posted per channel in order; a send can be posted only after its producer ran.
    # A receive queued behind a send that is produced after the receive's consumer would block.
    produced_at = {msg: i for i, msgs in enumerate(program.sends) for msg in msgs}
    needed_at = {msg: i for i, msgs in enumerate(program.recvs) for msg in msgs}
    for peer, packets in program.channels.items():
        latest_send = -1
        for packet in packets:
            if packet.src_rank == program.rank:
                made = max(produced_at[m] for m in packet.messages)
                if made < latest_send:
                    raise ScheduleError(
                        "send/receive order",
                        f"send {packet} is queued after a send produced later (op {latest_send})",
                        program.rank,
                        made,
                    )
                latest_send = made
            else:
                first_use = min(needed_at[m] for m in packet.messages)
                if first_use <= latest_send:
                    raise ScheduleError(
                        "send/receive order",
                        f"receive {packet} is needed by op {first_use} but queued with rank {peer} behind a send "
                        f"produced by op {latest_send}: the rank would wait forever",
                        program.rank,
                        first_use,
                    )
