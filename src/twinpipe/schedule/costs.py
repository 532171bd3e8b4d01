"""Op cost, written once: how long each op takes and what it does to the activations a rank holds.

A ``CostModel`` gives the times (T_F, T_B, T_W, T_FB per stage, T_comm per message between ranks)
and the memory (M_B per stage, M_W = mw·M_B). The simulator, the generators that time or size
their own order (zb-auto, ZB-V, V-Half/V-Min, BitPipe), the costs read off a traced run and the
planner all ask this module; none of them spells the rules below again
(``tests/test_architecture_costs.py`` checks that).

**Time of one op.** F takes T_F, B (input gradient only) T_B, W T_W, BW (a full backward) T_B + T_W,
each at its own stage. An FB op (DualPipe's F&B) is the F of one micro-batch and the BW of
another, on two stages of one rank (DualPipe pairs a forward with the *other* stage of its rank:
on rank 0 the first stage with the last, the one that computes the loss; the 1F1B family with
``overlap`` pairs one stage's forward and backward, or, interleaved, two chunks'). Where B and W
are split (ZB-H1, ZB-V) the backward half is a B and everything below holds with T_B for T_B + T_W:

- Overlap means the two halves' *parts* interleave: one micro-batch's communication (MoE
  all-to-alls) runs while the other computes. Compute does not overlap compute: the halves share
  one processor. So without a model of the parts a pair takes its halves back to back,
  T_F(s_F) + (T_B(s_B) + T_W(s_B)), each half at its own stage; never the forward stage's
  T_F + T_B + T_W, which is wrong whenever the two stages differ (the loss stage is slower).
- A CostModel gives T_FB explicitly only where the pair is known to be faster than that: the
  planner's prediction for MoE layers (``sim.overlap.predict_fb`` times the interleaved parts,
  ``plan.costs``), FB ops measured on a traced run (``trace.costs``: only the stages whose FB ops
  were measured; the others are None), or the user's ``--fb``. It is keyed by the forward half's
  stage, which on the built-in schedules fixes the backward half's stage; a None entry means not
  given for that stage: the halves back to back. It is a pair with a BW.
- ``t_fb_b`` is the same for a pair whose backward half is a B (ZB-H1, ZB-V with ``overlap``):
  the F's parts against the B's, the W parts left out (they run later, in a W op). The planner
  predicts it from the same part order (``plan.costs``); ``--fb-b`` gives it. Where it is not
  given, that pair takes its halves back to back, T_F + T_B.

**Memory of one op** (units of one stage's M_B, or bytes if M_B is given in bytes): F adds M_B
(the micro-batch's activations); B adds M_W - M_B (it frees all but what W still needs, and
*grows* memory when M_W > M_B); W frees M_W; BW frees M_B; FB is its F, then its BW: the
forward's activations are live before the backward frees the other micro-batch's (a B half: its
F, then its B). A rank's peak
is taken after every step, B's included.

This is the model the runtime's memory is to be measured against: whatever else a rank is found
to hold (receive buffers, kept losses) belongs in this module too, not in its users.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import NamedTuple, Sequence, Union

from twinpipe import checks
from twinpipe.schedule.ops import Op, OpKind

__all__ = [
    "CostModel", "check_cost", "PER_STAGE", "OpCosts", "op_costs", "op_time", "full_backward_time", "pair_time",
    "memory_delta", "memory_steps", "microbatch_peak", "SearchInputs",
]

Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]

_F, _B, _W, _BW, _FB = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.FB
_SIMPLE = (_F, _B, _W, _BW)


def check_cost(name: str, value) -> float:
    """``value`` as a finite float >= 0, else ValueError naming ``name`` (a bool is not a number)."""
    return checks.check_float(value, name, low=0)


_PAIRS = ("t_fb", "t_fb_b")  # pair times: optional, per stage too
PER_STAGE = ("t_f", "t_b", "t_w", "t_fb", "m_b", "t_fb_b")  # the CostModel fields that grow with a stage's share of the model


@dataclass(frozen=True)
class CostModel:
    """Op times and memory, uniform (a number) or per stage (a sequence indexed by global stage).

    ``t_b`` is the input-gradient backward only; a full backward (BW) takes ``t_b + t_w``.
    ``t_fb`` is an F overlapped with a BW (DualPipe's F&B), keyed by the forward half's stage; by
    default (None, or a None entry) the pair costs its halves back to back, the F at its stage and
    the BW at its own (see the module doc: when to give it). ``t_fb_b``: the same for an F
    overlapped with a B (its W deferred to a W op). ``t_comm`` is paid on every dependency
    between *different* ranks; a hand-off inside one rank (the turn of a V) is free. Memory: F
    holds ``m_b``; B turns it into ``mw * m_b`` (the inputs W still needs); W frees that; BW frees
    ``m_b`` at once. Every value is finite and >= 0.

    ``cores``: how many ranks can compute at full speed at once (None: every rank has its own
    processor). A CPU run with more ranks than cores shares them: while k > ``cores`` ranks
    compute, each runs at ``cores / k`` of its speed (op times are the times of an op alone).
    """

    t_f: PerStage = 1.0
    t_b: PerStage = 1.0
    t_w: PerStage = 1.0
    _: KW_ONLY
    t_fb: PerStage | None = None
    t_comm: Number = 0.0
    m_b: PerStage = 1.0
    mw: Number = 0.5
    cores: int | None = None
    t_fb_b: PerStage | None = None

    def __post_init__(self) -> None:
        if self.cores is not None:
            checks.check_int(self.cores, "cores", low=1, why="or None: every rank its own processor")
        for name in PER_STAGE:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, (list, tuple)):
                if not value:
                    raise checks.bad(name, value, "must be a finite number >= 0 or a non-empty sequence of them")
                for i, v in enumerate(value):
                    if not (v is None and name in _PAIRS):  # a stage without a given pair time
                        check_cost(f"{name}[{i}]", v)
            else:
                check_cost(name, value)
        for name in ("t_comm", "mw"):
            check_cost(name, getattr(self, name))

    def per_stage(self, num_stages: int) -> dict[str, list]:
        """Every per-stage quantity as a list of ``num_stages`` floats (``t_fb`` and ``t_fb_b`` only
        if given; their None entries stay None)."""
        out = {name: self._expand(name, getattr(self, name), num_stages) for name in ("t_f", "t_b", "t_w", "m_b")}
        for name in _PAIRS:
            if getattr(self, name) is not None:
                out[name] = self._expand(name, getattr(self, name), num_stages)
        return out

    @staticmethod
    def _expand(name: str, value: PerStage, num_stages: int) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != num_stages:
                raise checks.bad(name, value, f"must be one number or {num_stages} (one per stage of the schedule)")
            return [None if v is None else float(v) for v in value]
        return [float(value)] * num_stages


# --------------------------------------------------------------------------- the rules


def full_backward_time(t_b: float, t_w: float) -> float:
    """A BW: its input-gradient and weight-gradient passes back to back."""
    return t_b + t_w


def pair_time(t_f: float, t_bw: float, t_fb: float | None = None) -> float:
    """An FB op: ``t_fb`` where given (the pair's measured or predicted overlap), else its forward
    half (``t_f``, at its stage) and its backward half (``t_bw``, at its stage) back to back."""
    return t_fb if t_fb is not None else t_f + t_bw


def memory_delta(kind: OpKind | str, m_b: float = 1.0, mw: float = 0.5) -> float:
    """What one F, B, W or BW of a stage with activations ``m_b`` does to the memory its rank holds
    (M_W = ``mw`` · ``m_b``). An FB changes it in two steps on two stages: ``memory_steps``."""
    kind = OpKind(kind)
    if kind is _F:
        return m_b
    if kind is _B:
        return (mw - 1.0) * m_b  # keeps M_W of the M_B its F added
    if kind is _W:
        return -(mw * m_b)
    if kind is _BW:
        return -m_b
    raise ValueError(f"kind={kind.value!r}: an FB op changes memory in two steps (its F, then its BW); use memory_steps")


def memory_steps(op: Op, m_b: PerStage = 1.0, mw: float = 0.5) -> tuple[float, ...]:
    """The memory changes of ``op`` in the order they happen (one per simple op it performs: an FB
    is its F, then its backward half); a peak is taken after each. ``m_b``: a number or one per stage."""
    return tuple(memory_delta(part.kind, _at(m_b, part.stage), mw) for part in op.parts())


def microbatch_peak(mw: float, m_b: float = 1.0) -> float:
    """The most one micro-batch's activations reach on one stage: M_B after its F, or M_W after
    its B when that is more. A memory limit below it cannot run a single micro-batch."""
    after_f = memory_delta(_F, m_b, mw)
    return max(after_f, after_f + memory_delta(_B, m_b, mw))


def _at(value: PerStage, stage: int) -> float:
    return float(value[stage]) if isinstance(value, (list, tuple)) else float(value)


# --------------------------------------------------------------------------- per-stage tables


class OpCosts:
    """A CostModel expanded to ``num_stages`` stages: per kind, per stage, the time (``duration``)
    and the memory change (``memory``) of F, B, W and BW, and the rules for an FB. What the
    simulator's loop indexes; ``time`` and ``steps`` answer for any op."""

    __slots__ = ("t_f", "t_b", "t_w", "t_bw", "given_pair", "m_b", "mw", "t_comm", "duration", "memory")

    def __init__(self, costs: CostModel, num_stages: int):
        per = costs.per_stage(num_stages)
        self.t_f, self.t_b, self.t_w, self.m_b = per["t_f"], per["t_b"], per["t_w"], per["m_b"]
        self.t_bw = [full_backward_time(b, w) for b, w in zip(self.t_b, self.t_w)]
        # per backward half's kind: None, or the pair time per forward stage (None entries: not given)
        self.given_pair = {_BW: per.get("t_fb"), _B: per.get("t_fb_b")}
        self.mw, self.t_comm = float(costs.mw), float(costs.t_comm)
        self.duration = {_F: self.t_f, _B: self.t_b, _W: self.t_w, _BW: self.t_bw}
        self.memory = {kind: [memory_delta(kind, m, self.mw) for m in self.m_b] for kind in _SIMPLE}

    def pair(self, stage: int, backward_stage: int, backward_kind: OpKind = _BW) -> float:
        """Time of an FB op whose F is on ``stage`` and whose backward half (a BW, or a B whose W
        runs later) is on ``backward_stage``: ``t_fb`` (a BW half) or ``t_fb_b`` (a B half) where given."""
        given = self.given_pair[backward_kind]
        given = given[stage] if given is not None else None
        return pair_time(self.t_f[stage], self.duration[backward_kind][backward_stage], given)

    def time(self, op: Op) -> float:
        """How long ``op`` takes."""
        if op.backward is not None:
            return self.pair(op.stage, op.backward.stage, op.backward.kind)
        return self.duration[op.kind][op.stage]

    def pair_steps(self, stage: int, backward_stage: int, backward_kind: OpKind = _BW) -> tuple[float, float]:
        """Memory changes of an FB op (F on ``stage``, its backward half on ``backward_stage``): its F, then its backward."""
        return self.memory[_F][stage], self.memory[backward_kind][backward_stage]

    def steps(self, op: Op) -> tuple[float, ...]:
        """``memory_steps`` of ``op`` under these costs."""
        if op.backward is not None:
            return self.pair_steps(op.stage, op.backward.stage, op.backward.kind)
        return (self.memory[op.kind][op.stage],)

    def microbatch_time(self, stage: int) -> float:
        """Compute one micro-batch costs ``stage`` alone: its F and its full backward, not overlapped."""
        return pair_time(self.t_f[stage], self.t_bw[stage])


def op_costs(costs: CostModel, num_stages: int) -> OpCosts:
    """``costs`` expanded to ``num_stages`` stages (checks that per-stage values have that many)."""
    if not isinstance(costs, CostModel):
        raise TypeError(f"costs must be a CostModel, got {type(costs).__name__}")
    return OpCosts(costs, num_stages)


def op_time(op: Op, costs: CostModel | OpCosts) -> float:
    """How long ``op`` takes under ``costs`` (a CostModel, or one already expanded by ``op_costs``)."""
    if isinstance(costs, OpCosts):
        return costs.time(op)
    sized = [len(v) for v in (getattr(costs, name) for name in PER_STAGE) if isinstance(v, (list, tuple))]
    num_stages = sized[0] if sized else 1 + max(part.stage for part in op.parts())
    return op_costs(costs, num_stages).time(op)


class SearchInputs(NamedTuple):
    """What the searching schedulers (zb-auto, zbv) place ops by: F, B and W times per stage, the
    time of one message between ranks, W's share of a micro-batch's activation memory, and the
    activations a rank may hold (units of M_B; one number or one per stage)."""

    t_f: Sequence[float]
    t_b: Sequence[float]
    t_w: Sequence[float]
    t_comm: float
    mw: float
    mem_limit: PerStage
