"""Per-rank memory, in bytes: the one report shape that measured runs and predictions share.

A rank's memory comes in parts (``MemoryParts``): its stages' parameters, their gradients, the
FP32 master weights (mixed precision; 0 otherwise), the optimizer state, and the peak bytes its
activations reach during a step (what autograd saves for backward, what the weight-gradient
closures keep until W, and the receive buffers of messages not yet consumed). ``total`` is their
sum. A ``RankMemory`` pairs what a run measured with what was predicted for the same rank.

Pure Python: the trainer fills ``measured`` (``twinpipe.runtime.memory``), the planner and the
trainer's up-front check fill ``predicted`` (``activation_peaks`` below and
``twinpipe.plan``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from twinpipe.schedule.deps import neighbour

__all__ = ["PARTS", "MemoryParts", "RankMemory", "format_bytes", "memory_lines"]

PARTS = ("params", "grads", "master", "optimizer", "activations_peak")


@dataclass
class MemoryParts:
    """One rank's bytes, by part. ``device_peak``: ``torch.cuda.max_memory_allocated`` over the
    step where there is a GPU (measured only; not part of ``total``)."""

    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer: int = 0
    activations_peak: int = 0
    device_peak: int | None = None

    @property
    def total(self) -> int:
        return sum(int(getattr(self, part)) for part in PARTS)

    def to_dict(self) -> dict:
        out = {part: int(getattr(self, part)) for part in PARTS}
        out["total"] = self.total
        if self.device_peak is not None:
            out["device_peak"] = int(self.device_peak)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> MemoryParts:
        return cls(**{k: data[k] for k in (*PARTS, "device_peak") if k in data})


@dataclass
class RankMemory:
    """What one rank measured and what was predicted for it (bytes, by part)."""

    rank: int
    dp_rank: int = 0
    pp_rank: int = 0
    measured: MemoryParts = field(default_factory=MemoryParts)
    predicted: MemoryParts = field(default_factory=MemoryParts)

    def to_dict(self) -> dict:
        """The entry ``train-log.json`` holds under ``"memory"`` (one per rank)."""
        return {"rank": self.rank, "dp_rank": self.dp_rank, "pp_rank": self.pp_rank,
                "measured": self.measured.to_dict(), "predicted": self.predicted.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> RankMemory:
        return cls(data["rank"], data.get("dp_rank", 0), data.get("pp_rank", 0),
                   MemoryParts.from_dict(data["measured"]), MemoryParts.from_dict(data["predicted"]))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def memory_lines(entries: list[RankMemory]) -> list[str]:
    """One line per rank: measured / predicted activation peak and total, and their ratio."""
    lines = []
    for e in entries:
        m, p = e.measured, e.predicted
        ratio = f"{m.activations_peak / p.activations_peak:.2f}" if p.activations_peak else "-"
        lines.append(f"rank {e.rank} (dp {e.dp_rank}, pp {e.pp_rank}): activations measured {format_bytes(m.activations_peak)}, "
                     f"predicted {format_bytes(p.activations_peak)} (x{ratio}); total measured {format_bytes(m.total)}, "
                     f"predicted {format_bytes(p.total)}")
    return lines


# --------------------------------------------------------------------------- activations, replayed


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """What one stage's micro-batch holds, in bytes, measured from the stage itself
    (``twinpipe.runtime.memory.measure_stage``).

    ``in_bytes``/``out_bytes``: its input and output messages (``in_bytes`` 0 on a first stage: the
    user's data); ``in_grad_bytes``/``out_grad_bytes``: the gradients of its floating inputs
    (sent upstream) and outputs (received); ``*_tensors``: how many tensors those messages carry.
    After F, autograd holds ``f_other`` bytes besides the input (``saves_in``) and output
    (``saves_out``) storages. After a B whose weight gradients are deferred, W keeps ``w_other``
    bytes besides the input (``w_keeps_in``) and the received output gradient (``w_keeps_grad``).
    ``m_b``/``m_w``: the totals, M_B and M_W, in bytes. ``b_extra``: what a B (or BW) holds on top
    while it runs, at its largest: the activations ``torch.utils.checkpoint`` recomputes (0 without).
    """

    in_bytes: int = 0
    out_bytes: int = 0
    in_grad_bytes: int = 0
    out_grad_bytes: int = 0
    in_tensors: int = 1
    out_tensors: int = 1
    f_other: int = 0
    saves_in: bool = True
    saves_out: bool = True
    w_other: int = 0
    w_keeps_in: bool = False
    w_keeps_grad: bool = False
    b_extra: int = 0

    @property
    def m_b(self) -> int:
        return self.f_other + self.in_bytes * self.saves_in + self.out_bytes * self.saves_out

    @property
    def m_w(self) -> int:
        return self.w_other + self.in_bytes * self.w_keeps_in + self.out_grad_bytes * self.w_keeps_grad

    @property
    def mw(self) -> float:
        """M_W / M_B, the ratio the schedule cost model (``CostModel.mw``) takes."""
        return self.m_w / self.m_b if self.m_b else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class _Storages:
    """Storages with their holders; a storage counts while it has a holder, once it has been seen."""

    def __init__(self):
        self.size: dict = {}
        self.holders: dict = {}
        self.seen: set = set()
        self.live = 0

    def hold(self, key, holder, nbytes: int, seen: bool = True) -> None:
        if key is None or nbytes <= 0:
            return
        holders = self.holders.setdefault(key, set())
        self.size.setdefault(key, nbytes)
        was = bool(holders) and key in self.seen
        holders.add(holder)
        if seen:
            self.seen.add(key)
        if not was and key in self.seen:
            self.live += self.size[key]

    def drop(self, key, holder) -> None:
        holders = self.holders.get(key)
        if not holders or holder not in holders:
            return
        holders.discard(holder)
        if not holders:
            del self.holders[key]
            if key in self.seen:
                self.live -= self.size[key]
                self.seen.discard(key)


class _Replay:
    """One rank's step, replayed on storages: the executor's and transport's rules (see
    ``activation_peak``), in the order they run."""

    def __init__(self, program, placement, stages: dict, flattens, fb_middle: bool):
        self.program, self.placement, self.stages, self.flattens = program, placement, stages, flattens
        self.fb_middle, self.rank = fb_middle, program.rank
        self.mem = _Storages()
        self.peak = 0
        self.cursor = {peer: 0 for peer in program.channels}
        self.position = {pk: i for packets in program.channels.values() for i, pk in enumerate(packets)}
        self.packet_of = {m: pk for packets in program.channels.values() for pk in packets for m in pk.messages}
        self.outbox: set = set()
        self.in_flight: list = []  # (packet, storages)
        self.recv_storage: dict = {}  # message -> storage key

    def sample(self) -> None:
        self.peak = max(self.peak, self.mem.live)

    # ------------------------------------------------------------ messages
    def _bytes(self, msg) -> tuple[int, int]:
        if msg.kind == "act":
            st = self.stages[msg.dst_stage] if msg.dst_rank == self.rank else self.stages[msg.src_stage]
            return (st.in_bytes, st.in_tensors) if msg.dst_rank == self.rank else (st.out_bytes, st.out_tensors)
        if msg.dst_rank == self.rank:  # a gradient of this stage's outputs
            st = self.stages[msg.dst_stage]
            return st.out_grad_bytes, st.out_tensors
        st = self.stages[msg.src_stage]
        return st.in_grad_bytes, st.in_tensors

    def _payload(self, msg):
        """The storage a message this rank sends is made of."""
        return ("out", msg.src_stage, msg.microbatch) if msg.kind == "act" else ("ingrad", msg.src_stage, msg.microbatch)

    def _one_buffer(self, packet) -> bool:
        return self.flattens(packet.src_rank if packet.dst_rank == self.rank else packet.dst_rank) and \
            sum(self._bytes(m)[1] for m in packet.messages) > 1

    def pump(self, peer: int) -> None:
        packets = self.program.channels[peer]
        while self.cursor[peer] < len(packets):
            packet = packets[self.cursor[peer]]
            if packet.src_rank == self.rank:
                if any(m not in self.outbox for m in packet.messages):
                    return
                self._post_send(packet)
            else:
                self._post_receive(packet)
            self.cursor[peer] += 1

    def _post_send(self, packet) -> None:
        keys = []
        if self._one_buffer(packet):
            key = ("sendbuf", packet)
            self.mem.hold(key, "inflight", sum(self._bytes(m)[0] for m in packet.messages))
            keys.append(key)
        for m in packet.messages:
            self.outbox.discard(m)
            payload = self._payload(m)
            if not keys or keys[0][0] != "sendbuf":
                self.mem.hold(payload, ("inflight", packet), self._bytes(m)[0])
                keys.append(payload)
            self.mem.drop(payload, ("outbox", m))
        if not self.flattens(packet.dst_rank):  # a shared-memory pipe copies it at once
            for key in keys:
                self.mem.drop(key, "inflight" if key[0] == "sendbuf" else ("inflight", packet))
        else:
            self.in_flight.append((packet, keys))

    def _post_receive(self, packet) -> None:
        one = self._one_buffer(packet)
        for m in packet.messages:
            nbytes = sum(self._bytes(x)[0] for x in packet.messages) if one else self._bytes(m)[0]
            key = ("recvbuf", packet) if one else (m.kind, m.dst_stage, m.microbatch)
            self.recv_storage[m] = key
            self.mem.hold(key, ("msg", m), nbytes)

    def send(self, msg) -> None:
        self.outbox.add(msg)
        self.mem.hold(self._payload(msg), ("outbox", msg), self._bytes(msg)[0], seen=False)
        self.pump(msg.dst_rank)

    def receive(self, msg) -> None:
        packet = self.packet_of[msg]
        self.pump(msg.src_rank)
        before = self.position[packet]
        keep = []
        for sent, keys in self.in_flight:  # Transport._complete_sends_before
            if sent.dst_rank == msg.src_rank and self.position[sent] < before:
                self._retire(sent, keys)
            else:
                keep.append((sent, keys))
        self.in_flight = keep

    def _retire(self, packet, keys) -> None:
        for key in keys:
            self.mem.drop(key, "inflight" if key[0] == "sendbuf" else ("inflight", packet))

    # ------------------------------------------------------------ ops
    def _input_key(self, s: int, j: int):
        placement = self.placement
        if placement.is_first(s):
            return None
        prev = neighbour(placement, s, "act")
        if prev.local:
            return ("out", prev.stage, j)
        m = next(m for m in self.program.recvs_of[(s, j, "act")])
        return self.recv_storage[m]

    def forward(self, s: int, j: int) -> None:
        st, mem, placement = self.stages[s], self.mem, self.placement
        inp = self._input_key(s, j)
        if inp is not None:
            nbytes = self.mem.size.get(inp, st.in_bytes)
            mem.hold(inp, ("exec", s, j), nbytes, seen=False)
            if st.saves_in:
                mem.hold(inp, ("ag", s, j), nbytes)
            self._consume(inp, s, j, "act")
        mem.hold(("own", s, j), ("ag", s, j), st.f_other)
        out = ("out", s, j)
        if st.saves_out:
            mem.hold(out, ("ag", s, j), st.out_bytes)
        if placement.is_last(s):
            mem.hold(out, ("exec", s, j), st.out_bytes, seen=False)
            return
        nxt = neighbour(placement, s, "grad")  # the stage after s: its F reads this output
        if nxt.local:
            mem.hold(out, ("exec", s, j), st.out_bytes, seen=False)
            mem.hold(out, ("local", nxt.stage, j), st.out_bytes, seen=False)
        else:
            for m in self.program.sends_of.get((s, j, "act"), ()):
                self.send(m)

    def _consume(self, key, s: int, j: int, kind: str) -> None:
        prev = neighbour(self.placement, s, kind)
        if prev is not None and prev.local:
            self.mem.drop(key, ("local", s, j) if kind == "act" else ("grads", s, j))
        else:
            for m in self.program.recvs_of.get((s, j, kind), ()):
                self.mem.drop(key, ("msg", m))

    def backward(self, s: int, j: int, deferred: bool) -> None:
        st, mem, placement = self.stages[s], self.mem, self.placement
        if st.b_extra:  # a checkpointed region recomputed on top of everything held (the meter samples it then)
            self.peak = max(self.peak, mem.live + st.b_extra)
        inp, out = self._input_key(s, j), ("out", s, j)
        grad = None
        if not placement.is_last(s):
            nxt = neighbour(placement, s, "grad")
            if nxt.local:
                grad = ("ingrad", nxt.stage, j)
            else:
                m = next(iter(self.program.recvs_of[(s, j, "grad")]))
                grad = self.recv_storage[m]
        if deferred:
            mem.hold(("wown", s, j), ("w", s, j), st.w_other)
            if st.w_keeps_in and inp is not None:
                mem.hold(inp, ("w", s, j), mem.size.get(inp, st.in_bytes))
            if st.w_keeps_grad and grad is not None:
                mem.hold(grad, ("w", s, j), mem.size.get(grad, st.out_grad_bytes))
        for key in (inp, out, ("own", s, j)):
            mem.drop(key, ("ag", s, j))
            mem.drop(key, ("exec", s, j))
        if grad is not None:
            self._consume(grad, s, j, "grad")
        if placement.is_first(s):
            return
        prev = neighbour(placement, s, "act")  # the stage before s: its B reads this gradient
        ingrad = ("ingrad", s, j)
        if prev.local:
            mem.hold(ingrad, ("grads", prev.stage, j), st.in_grad_bytes, seen=False)
        else:
            for m in self.program.sends_of.get((s, j, "grad"), ()):
                self.send(m)

    def weight(self, s: int, j: int) -> None:
        for key in (("wown", s, j), self._input_key(s, j), self._grad_key(s, j)):
            self.mem.drop(key, ("w", s, j))

    def _grad_key(self, s: int, j: int):
        placement = self.placement
        if placement.is_last(s):
            return None
        nxt = neighbour(placement, s, "grad")
        if nxt.local:
            return ("ingrad", nxt.stage, j)
        m = next(iter(self.program.recvs_of[(s, j, "grad")]))
        return self.recv_storage.get(m)

    def run(self) -> int:
        from twinpipe.schedule.ops import OpKind

        for peer in self.program.channels:  # the transport opens before the first message
            self.pump(peer)
        for index, op in enumerate(self.program.ops):
            if self.program.recvs[index]:
                for m in self.program.recvs[index]:
                    self.receive(m)
                self.sample()
            kind = op.kind
            if kind is OpKind.F:
                self.forward(op.stage, op.microbatch)
            elif kind is OpKind.B:
                self.backward(op.stage, op.microbatch, True)
            elif kind is OpKind.BW:
                self.backward(op.stage, op.microbatch, False)
            elif kind is OpKind.W:
                self.weight(op.stage, op.microbatch)
            else:
                self.forward(op.stage, op.microbatch)
                if self.fb_middle:
                    self.sample()
                self.backward(op.backward.stage, op.backward.microbatch, op.backward.kind is OpKind.B)
            self.sample()
        for packet, keys in self.in_flight:
            self._retire(packet, keys)
        self.in_flight = []
        self.sample()
        return self.peak


class _Indexed:
    """A ``RankProgram`` with its messages indexed by (stage, micro-batch, kind)."""

    def __init__(self, program):
        self.rank, self.ops, self.recvs, self.channels = program.rank, program.ops, program.recvs, program.channels
        self.recvs_of: dict = {}
        self.sends_of: dict = {}
        for msgs in program.recvs:
            for m in msgs:
                self.recvs_of.setdefault((m.dst_stage, m.microbatch, m.kind), []).append(m)
        for msgs in program.sends:
            for m in msgs:
                self.sends_of.setdefault((m.src_stage, m.microbatch, m.kind), []).append(m)


def activation_peak(program, placement, stages: dict, flattens=lambda peer: False, fb_middle: bool = True) -> int:
    """The peak bytes of activations one rank holds over a training step, by replaying its
    ``program`` (``twinpipe.schedule.lower``) on the storages the runtime keeps, with each of its
    stages' ``StageMemory`` (``stages``: stage -> StageMemory):

    - F holds the stage's saved storages (input, output, the rest: M_B), and a non-last stage's
      output until its message is sent; B keeps what W needs (M_W) and frees the rest (while it
      runs it holds ``b_extra`` more: what a checkpointed region recomputes); W frees it; BW frees
      everything; FB is its F, then its BW;
    - receive buffers count from when the transport posts them (as early as each channel's
      order allows: after the last send before them) until their op consumes them: an
      activation then becomes the stage's saved input, a gradient is freed by its B (or kept by W);
    - a send over the process group (``flattens(peer)``: several tensors go as one flat buffer)
      is held until the peer's next packet on that channel arrives, or the step ends; a
      shared-memory send is copied at once.
    Peaks are taken where the runtime's meter samples: after each op's receives, after each op
    (and between an FB's halves, ``fb_middle``), and at the end.
    """
    return _Replay(_Indexed(program), placement, stages, flattens, fb_middle).run()


# --------------------------------------------------------------------------- model state


ADAM_STATE = 2  # AdamW keeps two moments per value (and one scalar step per tensor)


def state_prediction(numels, elsize: int, *, mixed: bool = False, updated=None, optimizer: str = "adamw") -> MemoryParts:
    """Bytes of a rank's model state: parameters of ``numels`` values (one entry per tensor) in
    ``elsize``-byte elements; gradients alike (FP32 under ``mixed`` precision); FP32 masters of the
    ``updated`` tensors (default: all) under ``mixed``; AdamW's two moments (in the updated tensors'
    dtype) and a 4-byte step per updated tensor (``optimizer="adamw"``; "sgd": one momentum buffer,
    "none": nothing)."""
    numels = [int(n) for n in numels]
    updated = numels if updated is None else [int(n) for n in updated]
    params = sum(numels) * elsize
    grads = sum(numels) * (4 if mixed else elsize)
    opt_elsize = 4 if mixed else elsize
    master = sum(updated) * 4 if mixed else 0
    if optimizer == "adamw":
        state = ADAM_STATE * sum(updated) * opt_elsize + 4 * len(updated)
    elif optimizer == "sgd":
        state = sum(updated) * opt_elsize
    else:
        state = 0
    return MemoryParts(params=params, grads=grads, master=master, optimizer=state)
