"""``twinpipe train``'s GPT by its sizes alone (pure Python): each pipeline rank's memory, by part.

The trainer predicts a rank's memory from its real stages (``twinpipe.train.memory``): the model
state from the parameters' element counts (``state_prediction``), the activation peak from each
stage measured alone on one micro-batch (``twinpipe.runtime.memory.measure_stage``) and replayed
on the rank's program (``activation_peak``). ``GPTRun.predict`` does the same from the
model's sizes (a ``GPTConfig``'s fields) without building anything: the parameters come from the
layers' shapes (``layer_numels``), the cut into stages from the same ``partition`` as the trainer's
``split(..., "params")``, and each stage's ``StageMemory`` from ``stage_memory``, the bytes
autograd and the deferred weight gradients keep for the GPT's layers on CPU, as
``measure_stage`` finds them (``tests/test_memory_predict.py`` holds the two equal). Then the same
``state_prediction`` and ``activation_peak``: ``twinpipe simulate --gpt`` and ``twinpipe plan --gpt``
print these numbers, and they equal the ``"predicted"`` entries of a ``twinpipe train`` run's
``train-log.json`` for the same configuration.

Modelled: the dense GPT, its MoE blocks (experts spread over the data-parallel ranks; their
activations bounded from above, ``gpt_moe``) and its multi-token-prediction head, AdamW, the default
transport (CPU ranks on one host: shared memory; ``flattens=True`` for process-group messages).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from types import MappingProxyType

from twinpipe import checks
from twinpipe.precisions import BF16_MIXED, PRECISIONS, PURE
from twinpipe.schedule.lower import lower
from twinpipe.schedule.ops import OpKind
from twinpipe.schedule.spec import resolve
from twinpipe.sim.memory import MemoryParts, StageMemory, activation_peak, state_prediction
from twinpipe.sim.gpt_moe import moe_block_bytes, moe_block_numels, mtp_head_bytes, mtp_head_numels
from twinpipe.sim.partition import partition
from twinpipe.sim.shards import BUCKET_BYTES, buckets, mirror_copies, runs  # noqa: F401  (BUCKET_BYTES: its old home) the trainer's reducers cut by the same rule

__all__ = ["ELSIZE", "PLANNED_WITH_MW", "RankPrediction", "layer_names", "layer_numels", "stage_layers", "stage_memory",
           "GPTRun"]

ELSIZE = MappingProxyType({"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2})
PLANNED_WITH_MW = ("zbv", "zb-auto")  # generators that order their ops by the memory W keeps (the trainer measures mw)


def layer_names(cfg) -> list[str]:
    """The GPT's layers in run order, named as ``split`` names them."""
    return ["embed", *(f"blocks.{i}" for i in range(cfg.layers)), "head"]


def layer_numels(cfg, name: str, dp: int = 1) -> list[int]:
    """Element counts of a layer's parameter tensors, in ``named_parameters`` order; a MoE block's with
    the experts of one of ``dp`` data-parallel ranks (``gpt_moe``)."""
    d, v = cfg.dim, cfg.vocab
    if name == "embed":  # token and position embeddings
        return [v * d, cfg.seq_len * d]
    if name == "head":  # norm weight and bias, the output projection (and the MTP modules)
        return mtp_head_numels(cfg) if getattr(cfg, "mtp_depth", 0) else [d, d, v * d, v]
    if getattr(cfg, "experts", 0):
        shared, experts = moe_block_numels(cfg, cfg.experts // dp)
        return shared + experts
    # norm1, qkv, proj, norm2, up, down (weights and biases)
    return [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]


def stage_layers(cfg, num_stages: int) -> list[list[str]]:
    """The layers of each stage of ``split(GPT(cfg), num_stages, "params")`` (every expert counted: the
    model is cut before its experts are spread)."""
    names = layer_names(cfg)
    if num_stages > len(names):
        raise checks.bad("num_stages", num_stages, f"must be <= {len(names)}: the GPT has {len(names)} layers "
                         "(the embedding, the blocks and the head)")
    counts = partition([float(sum(layer_numels(cfg, n))) for n in names], num_stages)
    out, start = [], 0
    for c in counts:
        out.append(names[start:start + c])
        start += c
    return out


def stage_memory(cfg, names, microbatch_size: int, elsize: int, dp: int = 1) -> StageMemory:
    """What one micro-batch of the stage made of the GPT's layers ``names`` keeps, in bytes, as
    ``measure_stage`` measures it on CPU (``elsize``: bytes of the compute dtype). With A = b t d
    elements of the hidden state:

    - a block keeps 15 A for F (the inputs of its four linears and of the two norms' outputs, q, k,
      v, the 4x MLP twice), the attention probabilities (b h t t), the causal mask (t t bytes) and
      its two norms' mean and rstd (b t each); W keeps the 15 A of its linears (inputs and output
      gradients; its last linear's output gradient is the block's received one);
    - the head keeps its norm's output and statistics and the loss's FP32 log-softmax (b t vocab;
      float64 logits keep it in float64) and one scalar; W keeps the norm's output and the logits' gradient;
    - between two layers of a stage, the hidden state (A) is saved by the next layer's norm; W
      keeps it too (the graph its saved inputs hang on holds it), except the embedding's output.

    A MoE block (``cfg.experts``, its experts spread over ``dp`` ranks) keeps at most
    ``gpt_moe.moe_block_bytes`` (an upper bound: the routing decides); an MTP head
    (``cfg.mtp_depth``) returns the logits and its hidden states, and keeps ``gpt_moe.mtp_head_bytes``.
    """
    b, t, d = microbatch_size, cfg.seq_len, cfg.dim
    a = b * t * d * elsize
    loss_el = 8 if elsize == 8 else 4
    first, last = names[0] == "embed", names[-1] == "head"
    moe, mtp = bool(getattr(cfg, "experts", 0)), bool(getattr(cfg, "mtp_depth", 0))
    f_other = w_other = 0
    for k, name in enumerate(names):
        if k:  # the hidden state between layers k-1 and k, saved by layer k's norm
            f_other += a
            w_other += a * (names[k - 1] != "embed")
        if name.startswith("blocks") and moe:
            f, w = moe_block_bytes(cfg, b, elsize, dp)
            f_other, w_other = f_other + f, w_other + w
        elif name.startswith("blocks"):
            f_other += 15 * a + b * cfg.heads * t * t * elsize + t * t + 4 * b * t * elsize
            w_other += 15 * a
        elif name == "head" and mtp:
            f, w = mtp_head_bytes(cfg, b, elsize)
            f_other, w_other = f_other + f, w_other + w
        elif name == "head":
            f_other += a + 2 * b * t * elsize + b * t * cfg.vocab * loss_el + loss_el
            w_other += a + b * t * cfg.vocab * elsize
    out = b * t * cfg.vocab * elsize if last else a
    received = 0 if first else a
    if last and mtp:  # (logits, hidden states), both saved
        return StageMemory(in_bytes=received, out_bytes=out + a, in_grad_bytes=received, out_grad_bytes=out + a,
                           out_tensors=2, f_other=f_other, saves_in=not first, saves_out=True, w_other=w_other,
                           w_keeps_in=not first)
    ends_dense = names[-1].startswith("blocks") and not moe  # a dense block's last linear keeps the received gradient
    return StageMemory(in_bytes=received, out_bytes=out, in_grad_bytes=received, out_grad_bytes=out,
                       f_other=f_other, saves_in=not first, saves_out=False, w_other=w_other,
                       w_keeps_in=not first, w_keeps_grad=not last and ends_dense)


@dataclass(frozen=True)
class RankPrediction:
    """One rank's predicted memory (``parts``), by pipeline and data-parallel rank."""

    pp_rank: int
    dp_rank: int
    parts: MemoryParts

    def to_dict(self) -> dict:
        return {"pp_rank": self.pp_rank, "dp_rank": self.dp_rank, **self.parts.to_dict()}


def _updated(stage_tensors: list[list[int]], elsize: int, dp: int, overlap: bool, own: list[int] = (),
             copies: list[tuple[int, int]] | None = None) -> list[list[int]]:
    """ZeRO-1: the element counts each data-parallel rank updates among one pipeline rank's tensors
    (``stage_tensors``: the reduced ones, one list per stage; ``own``: tensors reduced in a part of
    their own, an MTP head's tied embedding pair), as ``twinpipe.train.zero.ShardedReducer`` cuts them:
    parts (one per stage when the reduction overlaps the step or ``copies`` are given, else one),
    buckets in order (``shards.buckets``), each cut into ``dp`` runs of whole tensors (``shards.runs``);
    with ``copies`` ((this rank's copy, number of copies) per stage: mirrored copies) each run cut
    again, this copy updating its sub-run."""
    parts = stage_tensors if overlap or copies else [[n for tensors in stage_tensors for n in tensors]]
    mine: list[list[int]] = [[] for _ in range(dp)]
    for i, tensors in enumerate([*parts, *([n] for n in own)]):
        copy, count = copies[i] if copies and i < len(parts) else (0, 1)
        for bucket in buckets([n * elsize for n in tensors]):
            sizes = tensors[bucket.start : bucket.stop]
            for r, run in enumerate(runs(sizes, dp)):
                sub = runs(sizes[run.start : run.stop], count)[copy]
                mine[r] += sizes[run.start + sub.start : run.start + sub.stop]
    return mine


def _rank_tensors(cfg, names_of_stages: list[list[str]], dp: int) -> tuple[list[list[int]], list[int], list[int]]:
    """One pipeline rank's tensors, as the trainer sorts them: (the data-parallel-reduced ones per stage,
    the tied ones reduced alone, the experts: held by one rank, updated there)."""
    reduced, tied, experts = [], [], []
    mtp = bool(getattr(cfg, "mtp_depth", 0))
    for names in names_of_stages:
        mine = []
        for name in names:
            numels = layer_numels(cfg, name, dp)
            if name.startswith("blocks") and getattr(cfg, "experts", 0):
                shared = len(moe_block_numels(cfg, 0)[0])
                mine += numels[:shared]
                experts += numels[shared:]
            elif mtp and name in ("embed", "head"):  # embed.tokens.weight and head.mtp_embed: a tied pair
                keep = 0 if name == "embed" else len(numels) - 1
                tied.append(numels[keep])
                mine += numels[:keep] + numels[keep + 1:]
            else:
                mine += numels
        reduced.append(mine)
    return reduced, tied, experts


def _kept_losses(program, placement) -> int:
    """How many micro-batches' losses a rank keeps: one per forward of a last stage."""
    return sum(op.kind in (OpKind.F, OpKind.FB) and placement.is_last(op.stage) for op in program.ops)


@dataclass(frozen=True)
class GPTRun:
    """A ``twinpipe train`` run of its GPT, as far as memory goes: the model's sizes (``GPTConfig``'s
    fields; ``GPTRun.of(cfg, ...)`` reads them from one), ``microbatch_size`` sequences per
    micro-batch, parameters in ``dtype`` (``precision="bf16-mixed"``: bf16 compute, FP32 masters,
    gradients and AdamW state), AdamW state sharded over data parallel with ``zero=1`` (its gradient
    reduction per stage unless ``overlap_dp`` is off), and messages as one flat buffer
    (``flattens``: the process-group transport) or through shared memory (the default on one host)."""

    layers: int
    dim: int
    seq_len: int
    heads: int
    vocab: int
    microbatch_size: int
    _: KW_ONLY
    dtype: str = "float32"
    precision: str = PURE
    zero: int = 0
    overlap_dp: bool = True
    flattens: bool = False
    experts: int = 0
    top_k: int = 2
    mtp_depth: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "dim", "seq_len", "heads", "vocab", "microbatch_size"):
            checks.check_int(getattr(self, name), name, low=1)
        if self.dim % self.heads:
            raise checks.bad("dim", self.dim, f"must be a multiple of heads={self.heads}")
        checks.check_choice(self.dtype, "dtype", tuple(ELSIZE))
        checks.check_choice(self.precision, "precision", PRECISIONS)
        checks.check_int(self.zero, "zero", low=0, high=1)
        checks.check_int(self.experts, "experts", low=0, why="0: dense MLPs")
        if self.experts:
            checks.check_int(self.top_k, "top_k", low=1, high=self.experts, why=f"at most experts={self.experts}")
        checks.check_int(self.mtp_depth, "mtp_depth", low=0, high=self.seq_len - 1)

    @classmethod
    def of(cls, cfg, microbatch_size: int, **run) -> GPTRun:
        return cls(cfg.layers, cfg.dim, cfg.seq_len, cfg.heads, cfg.vocab, microbatch_size,
                   experts=getattr(cfg, "experts", 0), top_k=getattr(cfg, "top_k", 2), mtp_depth=getattr(cfg, "mtp_depth", 0),
                   **run)

    @property
    def elsize(self) -> int:
        """Bytes of a parameter and of an activation value (the compute dtype)."""
        return 2 if self.precision == BF16_MIXED else ELSIZE[self.dtype]

    def predict(self, schedule: str, pp: int, microbatches: int, dp: int = 1, options: dict | None = None,
                ep: int | None = None) -> list[RankPrediction]:
        """Each rank's memory by part, as ``twinpipe train`` predicts it for this run under
        ``schedule`` (with ``options``) on ``pp`` pipeline ranks x ``dp`` data-parallel replicas,
        ``microbatches`` per step and replica, MoE experts spread over ``ep`` ranks (default ``dp``).
        One entry per pipeline rank (data-parallel rank 0), or per (pipeline, data-parallel) rank
        where ZeRO-1 makes them differ."""
        checks.check_int(dp, "dp", low=1)
        ep = dp if ep is None else checks.check_int(ep, "ep", low=1)
        if self.experts and self.experts % ep:
            raise checks.bad("dp" if ep == dp else "ep", ep, f"must divide experts={self.experts}: each expert-parallel "
                             "rank holds experts/ep of every MoE block")
        mixed, elsize = self.precision == BF16_MIXED, self.elsize
        options = dict(options or {})
        spec = resolve(schedule, pp, **options)
        cut = stage_layers(self, spec.placement.num_model_stages)
        memories = [stage_memory(self, names, self.microbatch_size, elsize, ep) for names in cut]
        if spec.name in PLANNED_WITH_MW and "mw" not in options and not self.experts:  # as the trainer plans them
            spec = resolve(schedule, pp, **options, mw=round(max(m.mw for m in memories), 3))  # (train.memory.planned_options)
        placement = spec.placement
        programs = lower(spec.build(microbatches)).programs
        sharded = self.zero == 1 and dp > 1
        overlap = self.overlap_dp and len(placement.chains) == 1  # the trainer reduces per stage unless stages have copies
        holders = mirror_copies(placement) if sharded else None
        out = []
        for rank in range(pp):
            stages = {s: memories[placement.model_stage(s)] for s in placement.stages_of(rank)}
            peak = activation_peak(programs[rank], placement, stages, lambda peer: self.flattens)
            if self.experts:  # a bound: the losses the rank keeps to the step's end count too (8 bytes each in float64)
                peak += _kept_losses(programs[rank], placement) * (8 if elsize == 8 else 4)
            reduced, tied, experts = _rank_tensors(self, [cut[placement.model_stage(s)] for s in placement.stages_of(rank)], ep)
            held = [n for stage in reduced for n in stage] + tied + experts
            grad_el = 4 if mixed else elsize  # the reducer cuts its buckets on the FP32 parameters under bf16-mixed
            copies = None
            if holders is not None:  # ZeRO-1 over mirrored copies: (this rank's copy, copies) per stage
                copies = [(holders[placement.model_stage(s)].index(rank), len(holders[placement.model_stage(s)]))
                          for s in placement.stages_of(rank)]
            shards = _updated(reduced, grad_el, dp, overlap, tied, copies) if sharded else [held]
            for dp_rank, updated in enumerate(shards):
                parts = state_prediction(held, elsize, mixed=mixed, updated=updated + experts if sharded else updated)
                parts.activations_peak = peak
                out.append(RankPrediction(rank, dp_rank, parts))
        return out
