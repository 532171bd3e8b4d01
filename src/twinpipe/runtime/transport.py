"""Moving packets between pipeline ranks, in the per-pair order the lowering fixed.

Nothing is posted before the step agreement has passed: a step the ranks disagree on must not move
a single byte. Sends produced before every rank's claim is in wait in the outbox (the rank goes on
computing); the first receive, or the end of the step, waits for the agreement. From then on
receives are posted as early as that order allows, so transfers overlap compute; sends are
asynchronous and retired when done. Layouts are declared or discovered (a header precedes a packet
whose layout the receiver does not know yet); senders check what they send against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from twinpipe.runtime import comm, observe
from twinpipe.runtime.comm import HEADER_LEN, Layout, pack, receive_buffers, unpack
from twinpipe.runtime.releases import early_release
from twinpipe.runtime.wiring import StepWiring
from twinpipe.schedule.lower import Message, Packet

__all__ = ["Transport"]


@dataclass
class _Channel:
    peer: int
    packets: tuple[Packet, ...]
    cursor: int = 0
    header: tuple | None = None  # (work, tensor) of a header receive in flight


class Transport:
    """One rank's channels for one step, from the step's ``wiring``. ``where()`` names the current op in
    error messages."""

    def __init__(self, wiring: StepWiring, where: Callable[[], str]):
        program = wiring.program
        self.rank, self.p2p, self.device = program.rank, wiring.p2p, wiring.device
        self.layouts, self.declared, self.timeout, self.where = wiring.layouts, wiring.declared, wiring.timeout, where
        self.channels = {peer: _Channel(peer, packets) for peer, packets in program.channels.items()}
        self.packet_of = {m: pk for ch in self.channels.values() for pk in ch.packets for m in pk.messages}
        self.position = {pk: i for ch in self.channels.values() for i, pk in enumerate(ch.packets)}  # in its channel
        self.posted: dict[Packet, tuple[list, list[torch.Tensor], list[Layout]]] = {}
        self.arrived: dict[Message, list[torch.Tensor]] = {}  # unpacked, waiting for their op
        self.outbox: dict[Message, tuple[torch.Tensor, ...]] = {}
        self.in_flight: list[tuple[list, list, Packet]] = []
        self.before_first_message, self.agreement_arrived = wiring.before_first_message, wiring.agreement_arrived
        self.opened = False  # whether anything may have been posted (the step then cannot be undone)

    def _open(self) -> None:
        """Before the first message: pass the agreement, then post what can be posted."""
        if self.opened:
            return
        if self.before_first_message is not None:
            self.before_first_message()
        self.opened = True
        for channel in self.channels.values():
            self.pump(channel)

    def open_if_agreed(self) -> None:
        """Between ops: post the sends held back once every rank's claim is in (does not wait)."""
        if not self.opened and self.outbox and (self.agreement_arrived is None or self.agreement_arrived()):
            self._open()

    def finish(self) -> None:
        """Post everything left and wait until every send is delivered."""
        self._open()
        for channel in self.channels.values():
            self.pump(channel, drain=True)
        self.retire(wait=True)

    def layout(self, msg: Message) -> Layout | None:
        if msg.kind == "act":
            return self.declared or self.layouts.get((msg.src_stage, msg.microbatch))
        act_layout = self.declared or self.layouts.get((msg.dst_stage, msg.microbatch))
        return act_layout.grad_layout() if act_layout is not None else None

    def pump(self, channel: _Channel, until: Packet | None = None, drain: bool = False) -> None:
        """Post the channel's next sends and receives, in the agreed order, as far as possible.

        A receive whose layout is still unknown waits for the sender's header; we block on it
        only to reach ``until`` (a packet that precedes it must be posted first) or to ``drain``.
        """
        peer = channel.peer
        while channel.cursor < len(channel.packets):
            packet = channel.packets[channel.cursor]
            if packet.src_rank == self.rank:
                if any(m not in self.outbox for m in packet.messages):
                    return
                self._post_send(packet, [self.outbox.pop(m) for m in packet.messages], peer)
            else:
                layouts = [self.layout(m) for m in packet.messages]
                if any(layout is None for layout in layouts):  # discovering: the sender describes it first
                    if channel.header is None:
                        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                        channel.header = (self.p2p.irecv(header, peer), header)
                    work, header = channel.header
                    block = drain or (until is not None and until not in self.posted)
                    if not block and not work.is_completed():
                        return
                    comm.wait_work(work, self.timeout, self._what(f"header of {packet}", channel.peer))
                    channel.header = None
                    layouts = comm.decode_header(header.cpu())
                    self._remember(packet, layouts)
                shapes = [shape for layout in layouts for shape in layout.shapes]
                dtypes = [dtype for layout in layouts for dtype in layout.dtypes]
                buffers = receive_buffers(shapes, dtypes, self.device, self.p2p.flattens(peer))
                observe.note(buffers)  # counted from the moment they are posted
                self.posted[packet] = ([self.p2p.irecv(b, peer) for b in buffers], buffers, layouts)
            channel.cursor += 1

    def _remember(self, packet: Packet, layouts: list[Layout]) -> None:
        for msg, layout in zip(packet.messages, layouts):
            if msg.kind == "act":
                self.layouts[(msg.src_stage, msg.microbatch)] = layout

    def _post_send(self, packet: Packet, payloads: list[tuple], peer: int) -> None:
        layouts = [Layout.of(tensors) for tensors in payloads]
        expected = [self.layout(m) for m in packet.messages]
        for msg, layout, want in zip(packet.messages, layouts, expected):
            if want is not None and layout != want:
                source = "declared (set_p2p_tensor_shapes/tensor_shapes)" if self.declared else "seen on the first step"
                raise ValueError(
                    f"rank {self.rank}: {msg} carries [{layout}] but the receiver expects [{want}], {source}. "
                    "Declare the right shapes, or create the pipeline with dynamic_shapes=True for shapes that change."
                )
        works, keep = [], []
        if any(want is None for want in expected):
            self._remember(packet, layouts)
            header = comm.encode_header(layouts).to(self.device)
            works.append(self.p2p.isend(header, peer))
            keep.append(header)
        buffers = pack([t for tensors in payloads for t in tensors], self.p2p.flattens(peer))
        observe.note(buffers)  # held until the send is retired
        works += [self.p2p.isend(b, peer) for b in buffers]
        self.in_flight.append((works, keep + buffers, packet))

    def _what(self, thing: str, peer: int) -> str:
        return f"{self.where()}: waiting for {thing} from/to rank {peer}"

    def receive(self, msg: Message) -> list[torch.Tensor]:
        self._open()
        if msg in self.arrived:
            return self.arrived.pop(msg)
        packet = self.packet_of[msg]
        channel = self.channels[packet.src_rank]
        while packet not in self.posted:
            before = channel.cursor
            self.pump(channel, until=packet)
            if channel.cursor == before and packet not in self.posted:  # lowering guarantees progress
                raise RuntimeError(f"rank {self.rank}: {packet} is queued behind a send that was never produced")
        works, buffers, layouts = self.posted.pop(packet)
        for work in works:
            comm.wait_work(work, self.timeout, self._what(str(packet), packet.src_rank))
        self._complete_sends_before(packet)
        tensors = unpack(buffers, [shape for layout in layouts for shape in layout.shapes])
        for m, layout in zip(packet.messages, layouts):
            self.arrived[m], tensors = tensors[: len(layout.shapes)], tensors[len(layout.shapes) :]
        return self.arrived.pop(msg)

    def send(self, msg: Message, tensors: tuple) -> None:
        self.outbox[msg] = tensors
        if not self.opened and self.agreement_arrived is not None and not self.agreement_arrived():
            return  # posted, in order, once the agreement is in
        self._open()
        self.pump(self.channels[msg.dst_rank])

    def _complete_sends_before(self, packet: Packet) -> None:
        """Wait for the sends to ``packet``'s sender that precede it in the channel: that peer posted
        their receives before it sent ``packet``, so they complete at once. A process-group send (gloo)
        reports done only once waited, so without this its tensors would live until the step ends."""
        if not early_release("sends"):
            return
        peer, before = packet.src_rank, self.position[packet]
        keep = []
        for works, tensors, sent in self.in_flight:
            if sent.dst_rank == peer and self.position[sent] < before:
                for work in works:
                    comm.wait_work(work, self.timeout, self._what(f"delivery of {sent}", peer))
            else:
                keep.append((works, tensors, sent))
        self.in_flight = keep

    def retire(self, wait: bool) -> None:
        keep = []
        for works, tensors, packet in self.in_flight:
            if wait:
                for work in works:
                    comm.wait_work(work, self.timeout, self._what(f"delivery of {packet}", packet.dst_rank))
            elif not all(w.is_completed() for w in works):
                keep.append((works, tensors, packet))
        self.in_flight = keep
