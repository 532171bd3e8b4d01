"""One training step on a (dp, pp) mesh: pipeline step, gradient reductions, clipping, optimizer.

Per step, in this order (the order the single-process reference follows, so results are exact):
1. ``Pipeline.step`` on this replica's rows: gradients summed over micro-batches into ``.grad``;
2. schedules with mirrored copies (DualPipe, Chimera, BitPipe): the copies of each stage add their
   gradients (``sync_mirrored_grads``); then tied weights (an MTP head's embedding copy, a
   transformers model's tied head): every copy of a pair gets ``main + copy`` of this replica, summed
   over the pipeline (``_sum_tied_grads``), so the reduction below gives both the same sum;
3. data parallel: dense gradients summed across replicas (bucketed all-reduce); MoE experts, each
   held by one data-parallel rank (``experts.py``), only as ``twinpipe.moe.reduce_replica_grads``
   says (nothing without replicas); then all divided by the number of micro-batches in the global batch;
4. one all-reduce over the pipeline, then one over the replicas, carry every parameter's squared
   gradient norm (each model parameter counted once: by data-parallel rank 0, an expert by its
   holder, never DualPipe's second copy), the micro-batch losses and a digest of the global batch
   (ranks that sampled different batches raise ``PipelineMismatchError`` before the update), a
   count of ranks whose gradients are not finite and of ranks asking ``step(stop=, save=)`` (a
   signal, a save due by one rank's clock: every rank learns alike whether any asked);
5. a non-finite loss, gradient norm or gradient (every rank sees the same sums, so all decide
   alike): the update is skipped, or ``NonFiniteStepError`` raised (``TrainConfig.on_nonfinite``);
6. clipping (if ``max_norm``), then the optimizer.
With ``precision="bf16-mixed"`` the gradients above are the FP32 ``main_grad`` buffers and the
optimizer updates FP32 masters, copied to the bf16 weights after the update (``precision.py``).
With ``zero=1`` step 3 is a reduce-scatter: each data-parallel rank gets the summed gradients of the
parameters it owns, updates only those (their optimizer state lives there alone) and starts the
all-gathers of the new weights (``zero.py``): ``step()`` returns with them in flight, and each stage
module awaits its own before its next forward (a forward pre-hook; ``defer_gather = False`` awaits
them in ``step()``, the same bits); ``finish_update()`` awaits the rest before anything reads the
weights between steps (checkpoints, ``mirrors_equal``). Norms and checkpoints count each parameter at its owner.
With mirrored copies the copies of a stage split each data-parallel shard between them (``zero.Copies``):
one owner per model parameter among its copies and replicas, the second copy included.
With ``overlap_dp`` and one chain (no mirrored copies), step 3's dense collectives start inside
step 1: each stage's buckets as soon as its last gradient-writing op has run (the pipeline's
``on_grads_ready``), and the trainer awaits them after ``step()`` returns. With mirrored copies the
mirrored sum comes first (the summation order in ``grads.py``), so the reduction waits for it.

When the trainer is built, its ranks agree on the whole configuration (``agreement.py``) before any
collective whose sizes depend on it.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.moe.balance_loss import install_balance_loss
from twinpipe.moe.bias import HF_BIAS, CountedRouter, hf_gates, update_bias_
from twinpipe.moe.grads import reduce_replica_grads
from twinpipe.moe.router import TopKRouter
from twinpipe.runtime.batches import batch_layout
from twinpipe.runtime.collectives import collective, cpu_group, gather_objects
from twinpipe.runtime import waits
from twinpipe.runtime.main_grad import grad_of
from twinpipe.runtime.errors import (
    PipelineAbortedError, PipelineBrokenError, PipelineMismatchError, PipelineOutOfStepError, PipelinePeerFailedError,
)
from twinpipe.runtime.pipeline import Pipeline
from twinpipe.runtime.weight_grad import defer_weight_grads
from twinpipe.schedule import registry
from twinpipe.schedule.ops import Op, OpKind
from twinpipe.schedule.spec import resolve
from twinpipe.checks import bad
from twinpipe.train.agreement import agree, canonical
from twinpipe.train.config import TrainConfig, model_record
from twinpipe.train.data import BatchSampler, replica_rows
from twinpipe.train.experts import check_experts, expert_ids, shard_experts
from twinpipe.train.grads import (
    DataParallelReducer, clip_coefficient, clip_grads, scale_grads, squared_norms, sum_across,
)
from twinpipe.train.memory import planned_options
from twinpipe.train.mesh import TrainMesh
from twinpipe.train.mtp import MTPLoss, mtp_heads
from twinpipe.train import precision
from twinpipe.sim.shards import mirror_copies
from twinpipe.train.zero import Copies, ShardedReducer
from twinpipe.train.stages import Stage, is_mirror_copy, model_layers, split, stage_modules

__all__ = ["TrainConfig", "StepResult", "Trainer", "NonFiniteStepError", "model_parameter_names"]


@dataclass
class StepResult:
    step: int
    loss: float  # mean over every micro-batch of the global batch
    losses: torch.Tensor  # per global micro-batch, in order
    grad_norm: float | None
    times: dict[str, float] = field(default_factory=dict)
    skipped: bool = False  # the loss or the gradients were not finite: no rank updated (on_nonfinite="skip")
    stop: bool = False  # some rank asked ``step(stop=True)``: the same on every rank (agreed in the step's all-reduce)
    save: bool = False  # some rank asked ``step(save=True)``: the same on every rank


class NonFiniteStepError(FloatingPointError):
    """A step's loss, gradient norm or gradients were not finite, with ``on_nonfinite="raise"``:
    raised on every rank, before any update (the step can be retried or skipped alike everywhere)."""


# Raised by every rank of the step alike (agreement, the same summed vector), or heard from a peer:
# no failure notice to publish.
_RAISED_ALIKE = (PipelineMismatchError, PipelineAbortedError, PipelineBrokenError, PipelineOutOfStepError,
                 PipelinePeerFailedError, NonFiniteStepError)


def _qualname(obj) -> str:
    """``module.qualname`` of a function or class (an object: of its class)."""
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', '?')}.{target.__qualname__}"


def model_parameter_names(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """Every parameter of a splittable model, by name in the unsplit model, in run order."""
    return [(f"{name}.{sub}", p.shape) for name, layer in model_layers(model) for sub, p in layer.named_parameters()]


def _any_nonfinite(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """1.0 when a gradient of ``params`` holds inf or NaN, else 0.0 (float64; no host sync).

    A float64 sum of finite float32 (or narrower) values cannot overflow, so it is finite exactly
    when every value is (float64 gradients: unless their sum passes 1.8e308)."""
    sums = [g.sum(dtype=torch.float64) for g in map(grad_of, params) if g is not None]
    if not sums:
        return torch.zeros((), dtype=torch.float64)
    return (~torch.isfinite(torch.stack(sums))).any().to(torch.float64)


def model_routers(model: nn.Module) -> list[tuple[str, TopKRouter]]:
    """``(name in the unsplit model, router)`` of every ``TopKRouter`` of a splittable model, in run order."""
    return [(f"{name}.{sub}" if sub else name, m) for name, layer in model_layers(model)
            for sub, m in layer.named_modules() if isinstance(m, TopKRouter)]


def _stage_routers(stage) -> list[tuple[str, TopKRouter]]:
    """``(name in the unsplit model, router)`` of every ``TopKRouter`` of a stage, in run order (none
    in a stage that is not ``stages.Stage``, e.g. a transformers model's)."""
    if not isinstance(stage, Stage):
        return []
    return [(f"{name}.{sub}" if sub else name, m) for name, layer in zip(stage.names, stage.layers)
            for sub, m in layer.named_modules() if isinstance(m, TopKRouter)]


def _router_slices(model: nn.Module, held: Sequence[str]) -> tuple[list[tuple[int, int]], int]:
    """Where each held router's loads sit in the model's vector of loads (all routers, in order), and its length."""
    return _slices([(name, router.num_experts) for name, router in model_routers(model)], held)


def _slices(every: Sequence[tuple[str, int]], held: Sequence[str]) -> tuple[list[tuple[int, int]], int]:
    """Where each of the ``held`` routers' loads sit in the vector of ``every`` router's ``(name,
    experts)``, in order, and the vector's length."""
    where, offset = {}, 0
    for name, experts in every:
        where[name] = (offset, offset + experts)
        offset += experts
    missing = [name for name in held if name not in where]
    if missing:
        raise ValueError(f"routing bias {missing[0]!r} of this rank's stages is not among the model's "
                         f"({_few([n for n, _ in every]) or 'none'}): the stages and the model disagree")
    return [where[name] for name in held], offset


def _gates(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(bias name in the unsplit model, gate)`` of every Hugging Face DeepSeek-V3 gate of a stage
    built by ``Trainer(stages=...)`` (the biases among its ``named_model_buffers``), in order."""
    if not hasattr(module, "named_model_buffers"):
        return []
    gates = {id(getattr(m, HF_BIAS)): m for _, m in hf_gates(module)}
    return [(name, gates[id(t)]) for name, t in module.named_model_buffers() if id(t) in gates]


def _model_gates(model: nn.Module) -> list[tuple[str, int]]:
    """``(bias name, experts)`` of every Hugging Face DeepSeek-V3 gate of an unsplit model, in order."""
    return [(f"{name}.{HF_BIAS}", len(getattr(m, HF_BIAS))) for name, m in hf_gates(model)]


def first_forward_in_fb(ops: Sequence[Op]) -> bool:
    """Whether some stage's first forward in one rank's ``ops`` is the forward half of an F&B op."""
    seen: set[int] = set()
    for op in ops:
        if op.kind in (OpKind.F, OpKind.FB) and op.stage not in seen:
            if op.kind is OpKind.FB:
                return True
            seen.add(op.stage)
    return False


def _few(items: Sequence, limit: int = 4) -> str:
    shown = ", ".join(map(str, items[:limit]))
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


class Trainer:
    """Trains ``model_fn()`` (built on every rank with ``config.seed``) on ``mesh``.

    ``optimizer_fn(params)`` builds any ``torch.optim`` optimizer over this rank's parameters;
    ``criterion(output, labels)`` is one micro-batch's mean loss.

    ``stages``: how to cut a model that is not a sequence of one-tensor layers (a ``transformers``
    causal LM: ``twinpipe train --model``); None cuts by ``split`` with ``config.balance``. An object with
    ``parameter_names(model)`` (``(name, shape)`` of the unsplit model's parameters, in order),
    ``build(model, schedule, pp_rank)`` (this rank's stage modules in ``Pipeline`` order, each with
    ``named_model_parameters()``, weight gradients deferred), ``batch(layout, x, y)`` (the
    ``(inputs, labels)`` of ``Pipeline.step`` from this replica's rows and the rank's ``batch_layout``)
    and ``sync_grads(pipe)`` (after the pipeline step: every copy of a parameter gets the same sum,
    mirrored copies alike), and optionally ``tied_copies(model)``: ``(main name, copy name)`` pairs of
    tied weights (instead of the model's ``tied_copies``), summed by the trainer before the
    data-parallel reduction and counted once in the norm; a rank may hold both names as one tensor.
    """

    def __init__(self, model_fn: Callable[[], nn.Module], sampler: BatchSampler, criterion, optimizer_fn,
                 mesh: TrainMesh, config: TrainConfig, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 stages=None):
        if not isinstance(config, TrainConfig):
            raise ValueError(f"config={config!r}: must be a TrainConfig")
        self.config, self.mesh, self.sampler, self.criterion = config, mesh, sampler, criterion
        self.timeout = float(config.timeout)  # TrainConfig checked it
        self.skipped_steps = 0  # steps whose loss or gradients were not finite (on_nonfinite="skip")
        options = dict(config.schedule_options)
        # The start-up agreement and checkpoints (torch.distributed.checkpoint's own collectives) run on
        # a gloo group over the world, whose timeout bounds them.
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        precision.check_dtype(config.precision, dtype)
        self.mixed = config.precision == "bf16-mixed"
        torch.manual_seed(config.seed)
        model = model_fn().to(device=device, dtype=precision.MASTER_DTYPE if self.mixed else dtype)  # mixed: cast after the masters
        self.stages = stages
        self.parameter_names = model_parameter_names(model) if stages is None else list(stages.parameter_names(model))
        self.model_record = model_record(model)  # the model's configuration, as checkpoints store it
        self._agree_settings(model, device)  # before any collective whose sizes depend on the settings
        options = planned_options(config, model, sampler, criterion, mesh.pp, device)  # ZB-V, zb-auto: the measured M_W
        self.schedule = resolve(config.schedule, mesh.pp, **options)  # once: the layout, stages and pipeline share it
        self.placement = self.schedule.placement
        self.num_chunks = config.num_microbatches(mesh.dp)
        self.layout = batch_layout(self.schedule, mesh.pp, mesh.pp_rank, self.num_chunks)
        self.experts = check_experts(model, mesh.dp)
        index = {name: i for i, (name, _) in enumerate(self.parameter_names)}
        pipeline_stages = self.placement.stages_of(mesh.pp_rank)
        if stages is None:
            cut = split(model, self.placement.num_model_stages, self._layer_counts(model, device))
            self.stage_names = [s.names for s in cut]
            modules = [defer_weight_grads(m) for m in stage_modules(cut, self.schedule, mesh.pp, mesh.pp_rank)]
        else:
            with waits.limit(self.timeout):  # the cut's own collectives (balance="time") wait the trainer's limit
                modules = list(stages.build(model, self.schedule, mesh.pp_rank))
            self.stage_names = None  # the custom cut names its stages its own way
        if mesh.dp > 1:
            shard_experts(modules, mesh.dp_group)  # expert parallelism over the stage's data-parallel group
        experts = expert_ids(modules)
        # Parameters holding this data-parallel rank's rows of a model tensor (a transformers model's
        # fused experts): stored in checkpoints as one tensor sharded over ``row_mesh``.
        self.row_shards = set(stages.row_shards(modules)) if hasattr(stages, "row_shards") else set()
        self.row_mesh = mesh.mesh["dp"] if self.row_shards else None
        ep_group = getattr(stages, "ep_group", None)
        if self.row_shards and ep_group is not None and dist.get_process_group_ranks(ep_group) != dist.get_process_group_ranks(mesh.dp_group):
            raise bad("stages.ep_group", dist.get_process_group_ranks(ep_group),
                      f"must be the mesh's data-parallel group {dist.get_process_group_ranks(mesh.dp_group)} (the rows "
                      "of each expert tensor are stored sharded over it)")
        named = [(s, name, p) for s, m in zip(pipeline_stages, modules) for name, p in m.named_model_parameters()]
        # One tensor may be held under two names (tied embeddings whose ends are on one rank): updated once.
        self.params = list({id(p): p for _, _, p in named}.values())
        shared = len(self.params) < len(named)
        # Tied copies (an MTP head's embedding copy, a transformers model's tied head): kept equal to
        # their main parameter, not in the norm.
        self.tied = tuple(stages.tied_copies(model) if hasattr(stages, "tied_copies") else getattr(model, "tied_copies", ()))
        self._tied_dtypes = {main: p.dtype for main, p in model.named_parameters() if main in dict(self.tied)}
        copies = {copy for _, copy in self.tied}
        tied_names = {name for pair in self.tied for name in pair}
        # Every held tensor of a tied pair (both names, mirrored copies too): summed over the pipeline
        # before the data-parallel reduction, then reduced each in a bucket of its own (below).
        tied_held = list({id(p): p for _, name, p in named if name in tied_names}.values())
        self._criterion = self._mtp_criterion(model, modules)
        self._dense = [p for p in self.params if id(p) not in experts]  # the same on every data-parallel replica
        # Routing biases (buffers, DeepSeek-V3's balancing), owned as dense parameters are; loads by model
        # router, in one vector of the whole model's routers. Stages built by ``stages`` (a transformers
        # model): its DeepSeek-V3 gates, whose choices a forward hook counts (``CountedRouter``).
        if stages is None:
            routers = [(s, f"{name}.bias", name, router) for s, m in zip(pipeline_stages, modules)
                       for name, router in _stage_routers(m)]
            every = [(name, router.num_experts) for name, router in model_routers(model)]
        else:
            routers = [(s, name, name, CountedRouter(name, gate)) for s, m in zip(pipeline_stages, modules)
                       for name, gate in _gates(m)]
            every = list(stages.routing_biases(model)) if hasattr(stages, "routing_biases") else _model_gates(model)
        self._bias_slots = [(name, router, not is_mirror_copy(self.placement, s) and mesh.dp_rank == 0)
                            for s, name, _, router in routers]
        self._routers = [router for *_, router in routers]
        self._router_slices = _slices(every, [key for _, _, key, _ in routers])
        self._check_balancing(config, model, modules)
        # Overlapped: one part per stage, started by the pipeline's on_grads_ready; else one part of all.
        # A tensor held by two stages (shared tied weight) is final only when both are: not per stage.
        self.overlap_dp = config.overlap_dp and not self.is_dual and not shared
        # A tied tensor's gradient is final only after the tied sum (after the pipeline step): never in
        # a stage's part; each is a part of its own, so that every copy of the pair is reduced alike
        # (the same sizes and inputs: the same bits, whatever the backend's order within a bucket).
        tied_ids = set(map(id, tied_held))
        untied = [p for p in self._dense if id(p) not in tied_ids]
        sharded = config.zero == 1 and mesh.dp > 1
        # ZeRO-1 with mirrored copies on distinct ranks: one part per model stage, cut alike by every
        # copy, whose copies split each run (zero.Copies); the groups are made on every rank alike.
        mirrored = self._mirror_groups() if sharded else None
        spreads = None  # per part: its zero.Copies, or None
        if self.overlap_dp or mirrored:
            dense = set(map(id, untied))
            parts = [list({id(p): p for _, p in m.named_model_parameters() if id(p) in dense}.values()) for m in modules]
            self._part_of = {s: i for i, s in enumerate(pipeline_stages)}
            if mirrored:
                spreads = [mirrored[self.placement.model_stage(s)][mesh.pp_rank] for s in pipeline_stages]
        else:
            parts = [untied]
        tied_dense = [p for p in tied_held if id(p) not in experts]
        self._tied_parts = list(range(len(parts), len(parts) + len(tied_dense)))
        parts += [[p] for p in tied_dense]
        if spreads is not None:
            spreads += [None] * len(tied_dense)  # tied tensors: each copy shards over data parallel alone
        if sharded:
            self.reducer = ShardedReducer(parts, mesh.dp_group, self.timeout, mode=config.dp_reduce, copies=spreads)
        else:
            self.reducer = DataParallelReducer(parts, mesh.dp_group, self.timeout, mode=config.dp_reduce)
        spread = {id(p) for part, cp in zip(parts, spreads or ()) if cp for p in part}  # owned by one copy of all
        # The data-parallel rank that updates a dense parameter: its shard's (ZeRO-1), else every one.
        updates = (lambda p: self.reducer.owns(p)) if sharded else (lambda p: True)
        # (model parameter name, parameter, owned): owned parameters count in norms and checkpoints. One
        # rank owns each model parameter: the first copy at data-parallel rank 0, or (ZeRO-1) at the rank
        # that updates it; an expert at its only holder.
        first = mesh.dp_rank == 0 or sharded
        self.held = [(name, p, (id(p) in spread or not is_mirror_copy(self.placement, s)) and (id(p) in experts or (first and updates(p))))
                     for s, name, p in named]
        self._owned_index = torch.tensor([index[n] for n, _, owned in self.held if owned and n not in copies], dtype=torch.long,
                                         device=device)
        self._owned = [p for n, p, owned in self.held if owned and n not in copies]
        self._updated = [p for p in self.params if id(p) in experts or updates(p)]  # what this rank's optimizer updates
        masters = precision.make_masters(self._updated) if self.mixed else self._updated
        self._optimized = {id(p): t for p, t in zip(self._updated, masters)}  # parameter -> the tensor the optimizer updates
        self.pipe = Pipeline(modules, self.schedule, process_group=mesh.pp_group, timeout=self.timeout)
        # ZeRO-1: the all-gathers of an update are awaited stage by stage, before the stage's next forward.
        self.defer_gather = sharded  # False: awaited inside step() (the eager order; bench/bench_zero.py compares)
        if sharded:
            self.reducer.set_stages([[p for _, p in m.named_model_parameters()] for m in self.pipe.module])
            for j, module in enumerate(self.pipe.module):
                module.register_forward_pre_hook(functools.partial(self._await_weights, j))
        # The pre-hook does not see a forward run through a stage's parts (the forward half of an F&B
        # op): a schedule whose first forward of a stage is one awaits every all-gather before the step.
        self._gather_before_step = sharded and first_forward_in_fb(self.pipe.schedule_for(self.num_chunks).ops[self.pipe.rank])
        self.optimizer = optimizer_fn(masters)
        self._agree_optimizer()  # before the initial weights' broadcast
        self._agree_group = cpu_group(mesh.pp_group, self.timeout)  # small CPU exchanges (mirrors_equal)
        self._sync_start()
        for router in self._routers:  # a step counts its own tokens only (balance="time" ran the layers)
            router.loads.zero_()
        if self.mixed:  # the masters from the agreed weights, then the bf16 compute copy and FP32 gradient buffers
            precision.refresh(masters, self._updated)
            precision.to_compute(modules)
            for p, m in zip(self._updated, masters):
                m.grad = p.main_grad  # one tensor: what the trainer reduces is what the optimizer reads

    @property
    def held_buffers(self) -> list[tuple[str, torch.Tensor, bool]]:
        """``(name, buffer, owned)`` of the routing biases this rank holds (checkpoints store them):
        ``<router>.bias`` of a ``twinpipe.moe`` router, ``model.layers.N.mlp.gate.e_score_correction_bias``
        of a transformers DeepSeek-V3 gate; owned by data-parallel rank 0's first copy. Read from the
        routers each time (a dtype cast replaces a module's buffers)."""
        return [(name, router.bias, owned) for name, router, owned in self._bias_slots]

    def _check_balancing(self, config: TrainConfig, model: nn.Module, modules: Sequence[nn.Module]) -> None:
        """DeepSeek-V3's balancing needs routers with a bias; ``balance_alpha`` hooks a transformers
        model's gates (``install_balance_loss``: every copy of each)."""
        gamma, alpha = config.bias_update_speed, config.balance_alpha
        if gamma and not self._router_slices[1]:
            what = ("a model without MoE routers" if self.stages is None else
                    f"a model without DeepSeek-V3 gates ({type(model).__name__}: no module with an {HF_BIAS} buffer)")
            raise bad("bias_update_speed", gamma, f"must be 0 for {what}: nothing to balance")
        if not alpha:
            return
        if self.stages is None:
            raise bad("balance_alpha", alpha, "must be 0 for a model cut by split: a twinpipe.moe router takes its own "
                      "(TopKRouter(balance_alpha=...), GPTConfig.balance_alpha)")
        if not self._router_slices[1]:
            raise bad("balance_alpha", alpha, f"must be 0 for a model without DeepSeek-V3 gates ({type(model).__name__}: "
                      f"no module with an {HF_BIAS} buffer): no sequence-wise balance loss to add")
        for module in modules:
            if _gates(module):
                install_balance_loss(module, alpha)

    def _agree_settings(self, model: nn.Module, device) -> None:
        """Every rank's configuration, model and precision, compared (``agreement.agree``)."""
        c = self.config
        names = json.dumps([[n, list(s)] for n, s in self.parameter_names]).encode()
        facts = {
            "schedule": registry.get(c.schedule).name, "schedule_options": sorted(c.schedule_options),
            "batch_size": c.batch_size, "microbatch_size": c.microbatch_size, "max_norm": canonical(c.max_norm),
            "balance": c.balance, "seed": c.seed, "timeout": canonical(c.timeout), "dp_reduce": c.dp_reduce, "overlap_dp": c.overlap_dp,
            "on_nonfinite": c.on_nonfinite, "bias_update_speed": canonical(c.bias_update_speed),
            "balance_alpha": canonical(c.balance_alpha),
            "mtp_depth": c.mtp_depth, "mtp_weight": canonical(c.mtp_weight), "precision": c.precision, "zero": c.zero,
            "dtype": ",".join(sorted({str(p.dtype) for p in model.parameters()})), "device": torch.device(device).type,
            "criterion": _qualname(self.criterion),
            "model parameters": f"{len(self.parameter_names)} named, sha256 {hashlib.sha256(names).hexdigest()[:16]}",
        }
        config = self.model_record.get("config")
        if isinstance(config, dict):  # one fact per field: an error names the field that differs
            facts.update((f"model config.{key}", json.dumps(value, sort_keys=True)) for key, value in config.items())
        else:
            facts["model config"] = json.dumps(self.model_record, sort_keys=True)
        agree(self.checkpoint_group, facts, self.timeout, self._where("building the trainer"),
              "Build every rank's Trainer with the same TrainConfig, model, dtype, criterion and optimizer; nothing ran.")

    def _agree_optimizer(self) -> None:
        """Every rank's optimizer class and hyper-parameters (each param group's, ``params`` left out), compared."""
        groups = self.optimizer.param_groups
        facts: dict[str, object] = {"optimizer": _qualname(type(self.optimizer)), "optimizer param_groups": len(groups)}
        for i, group in enumerate(groups):
            for key, value in group.items():
                if key != "params":
                    facts[f"optimizer param_groups[{i}].{key}"] = canonical(value)
        agree(self.checkpoint_group, facts, self.timeout, self._where("building the trainer"),
              "Build every rank's optimizer alike (optimizer_fn); nothing ran.", decisive=("optimizer", "optimizer param_groups"))

    def _mtp_criterion(self, model: nn.Module, modules: Sequence[nn.Module]):
        """The criterion this rank's last stage runs: with MTP, ``MTPLoss`` over its head's modules."""
        # The MTP layers of stages built by ``stages`` (a transformers model) are the stages', not the model's.
        depth = getattr(self.stages, "mtp_depth", None)
        if depth is None:
            depth = sum(len(h.mtp) for h in mtp_heads([model]))
        if depth != self.config.mtp_depth:
            raise bad("mtp_depth", self.config.mtp_depth, f"must be the number of MTP modules the model holds ({depth}): "
                      "build the model with as many (GPTConfig.mtp_depth)")
        if not depth:
            return self.criterion
        heads = mtp_heads(modules)
        if len(heads) > 1:
            raise ValueError(f"schedule={self.config.schedule!r}: rank pp={self.mesh.pp_rank} holds {len(heads)} copies of the "
                             "MTP head; multi-token prediction needs at most one per rank")
        return MTPLoss(self.criterion, heads[0], self.config.mtp_weight) if heads else self.criterion

    def _sum_tied_grads(self, step: int) -> None:
        """Each tied pair (main, copy): every copy of both gets ``main's gradient + copy's gradient``
        of this replica, before the data-parallel reduction (which then gives both the same sum).

        After the mirrored sum every copy of a parameter holds this replica's gradient (``grad_of``:
        the FP32 ``main_grad`` under mixed precision); the rank holding a parameter's first copy puts
        it into a [2, ...] buffer, summed over the pipeline (each slot has one non-zero contribution:
        exact), and every holder adds the two slots."""
        held = {}
        for stage, module in zip(self.placement.stages_of(self.mesh.pp_rank), self.pipe.module):
            for name, p in module.named_model_parameters():
                held.setdefault(name, []).append((p, not is_mirror_copy(self.placement, stage)))
        device = self.pipe.device
        for main, copy in self.tied:
            shape = next(s for n, s in self.parameter_names if n == main)
            both = torch.zeros(2, *shape, dtype=self._tied_dtypes[main], device=device)
            added = set()  # one tensor held under both names (shared) already holds both gradients: added once
            for slot, name in enumerate((main, copy)):
                for p, first in held.get(name, ()):
                    if first and grad_of(p) is not None and id(p) not in added:
                        both[slot] += grad_of(p)
                        added.add(id(p))
            sum_across(both, self.mesh.pp_group, self.timeout, self._where(f"step {step}: summing {main} and its copy {copy}"))
            total = both[0] + both[1]
            for name in (main, copy):
                for p, _ in held.get(name, ()):
                    if getattr(p, "main_grad", None) is not None:
                        p.main_grad.copy_(total)  # the buffer stays (a master's .grad is the same tensor)
                    else:
                        p.grad = total.clone()

    def _layer_counts(self, model: nn.Module, device) -> str | Sequence[int]:
        """How to cut the model; with ``balance="time"``, global rank 0's measurement, for every rank."""
        balance = self.config.balance
        if balance != "time":
            return balance
        n = self.placement.num_model_stages
        counts = torch.zeros(n, dtype=torch.long, device=device)
        if dist.get_rank() == 0:  # one measurement, sent to every rank
            sample = self.sampler.batch(0, self.config.microbatch_size)[0].to(device)
            counts = torch.tensor([len(s.names) for s in split(model, n, "time", sample=sample)], device=device)
        collective(dist.broadcast, counts, src=0, group=None, timeout=self.timeout,
                   what=self._where("agreeing on the time-balanced split"))
        return counts.cpu().tolist()

    def _mirror_groups(self) -> dict[int, dict[int, Copies]] | None:
        """ZeRO-1 over mirrored copies: model stage -> pipeline rank -> its ``zero.Copies``, with one
        process group per set of ranks holding a stage (every copy on every data-parallel rank), made
        on every rank in the same order; None without copies on distinct ranks (``shards.mirror_copies``)."""
        holders = mirror_copies(self.placement)
        if holders is None:
            return None
        ranks = self.mesh.mesh.mesh  # global rank of (dp rank, pp rank)
        made: dict[tuple[int, ...], object] = {}
        out: dict[int, dict[int, Copies]] = {}
        for k in sorted(holders):
            members = tuple(sorted(int(ranks[i, r]) for i in range(self.mesh.dp) for r in holders[k]))
            if members not in made:
                made[members] = dist.new_group(list(members), timeout=datetime.timedelta(seconds=self.timeout))
            position = tuple(tuple(members.index(int(ranks[i, r])) for r in holders[k]) for i in range(self.mesh.dp))
            out[k] = {r: Copies(c, len(holders[k]), made[members], position, k) for c, r in enumerate(holders[k])}
        return out

    @property
    def is_dual(self) -> bool:
        """Whether the schedule keeps two copies of the model (DualPipe, Chimera, BitPipe)."""
        return len(self.placement.chains) > 1

    def _where(self, what: str) -> str:
        return f"rank dp={self.mesh.dp_rank} pp={self.mesh.pp_rank}: {what}"

    def _sync_start(self) -> None:
        """Every replica and mirrored copy starts from dp replica 0's (lower rank's) weights (experts:
        each is on one replica only, built there from the same seed)."""
        if self.mesh.dp > 1 and self._dense:
            flat = torch.cat([p.detach().reshape(-1) for p in self._dense])
            src = dist.get_global_rank(self.mesh.dp_group, 0)
            collective(dist.broadcast, flat, src=src, group=self.mesh.dp_group, timeout=self.timeout,
                       what=self._where("broadcasting the initial weights across data-parallel replicas"))
            offset = 0
            with torch.no_grad():
                for p in self._dense:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        if self.is_dual:
            self.pipe.sync_mirrored_weights()

    def step(self, step: int, *, stop: bool = False, save: bool = False) -> StepResult:
        """Train on global batch ``step`` (from the sampler). ``stop``, ``save``: this rank's request (a
        signal arrived, a save is due by its clock), agreed in the step's all-reduce: the result's
        ``stop``/``save`` are True on every rank when any rank asked, so all ranks act alike."""
        try:
            return self._step(step, (bool(stop), bool(save)))
        except _RAISED_ALIKE:
            raise  # every rank raises it, from the same sums or agreement: nothing to tell
        except BaseException as exc:  # the ranks waiting for this one hear of it now, not at their timeout
            waits.publish_failure(getattr(exc, "first", "") or self._where(
                f"step {step} failed (global rank {dist.get_rank()}): {type(exc).__name__}: {exc}"),
                [self.mesh.pp_group, self.mesh.dp_group, *getattr(self.reducer, "mirror_groups", ())])
            raise

    def _step(self, step: int, requests: tuple[bool, bool]) -> StepResult:
        times = {}
        start = time.perf_counter()
        dp, m = self.mesh.dp, self.num_chunks
        x, y = self.sampler.batch(step, self.config.batch_size)
        digest = zlib.crc32(y.cpu().numpy().tobytes(), zlib.crc32(x.cpu().numpy().tobytes())) & 0xFFFF
        rows = replica_rows(self.config.batch_size, dp, self.mesh.dp_rank)
        device = self.pipe.device
        x, y = x[rows].to(device), y[rows].to(device)
        precision.zero_main_grads(self.params)  # .grad dropped, FP32 main_grad (mixed precision) zeroed
        overlap = self.overlap_dp and self.reducer.active
        if self._gather_before_step:
            self.finish_update()
        try:
            inputs, labels = ((self.layout.inputs(x), self.layout.labels(y)) if self.stages is None
                              else self.stages.batch(self.layout, x, y))
            loss, _ = self.pipe.step(*inputs, num_chunks=m, criterion=self._criterion, labels=labels,
                                     on_grads_ready=self._start_reduction if overlap else None)
        except BaseException:
            self.reducer.abandon()  # its peers' waits time out, naming the step
            raise
        times["pipeline"] = time.perf_counter() - start
        times["busy"] = self.pipe.last_busy_s  # of "pipeline": running this rank's ops, not waiting for peers
        mark = time.perf_counter()
        if self.stages is not None:
            self.stages.sync_grads(self.pipe)
        elif self.is_dual:
            self.pipe.sync_mirrored_grads()
        times["mirror"] = time.perf_counter() - mark
        mark = time.perf_counter()
        if self.tied:  # before the data-parallel reduction: it moves main_grad, or reduce-scatters (ZeRO-1)
            self._sum_tied_grads(step)
        if overlap:
            for part in self._tied_parts:
                self.reducer.start(part)
            self.reducer.wait(self._where(f"step {step}"))
        else:
            self.reducer.all_reduce(self._where(f"step {step}"))
        if self.experts:
            reduce_replica_grads(self.pipe.module, self.timeout)
        times["dp"] = time.perf_counter() - mark
        mark = time.perf_counter()
        scale_grads(self._updated, m * dp)
        clip = self.config.max_norm is not None
        n_norms = len(self.parameter_names) if clip else 0
        vec = self._sum_vector(step, loss, digest, n_norms, requests)
        losses = vec[n_norms : n_norms + dp * m].clone()
        loads = vec[n_norms + dp * m : len(vec) - 3 - len(requests)]
        stop, save = (bool(v) for v in vec[-3 - len(requests) : -3].tolist())
        problem = self._nonfinite(vec, n_norms, losses)
        norm, factor = clip_coefficient(vec[:n_norms], self.config.max_norm) if clip else (None, 1.0)
        if problem is not None:
            self._refuse_update(step, problem)  # raises, or counts the step as skipped
        else:
            clip_grads(self._updated, factor)
            self.finish_update()  # normally done: every stage's forward awaited its all-gathers
            self.optimizer.step()
            self._publish_update(step)
            self._move_biases(loads)
        for router in self._routers:
            router.loads.zero_()
        times["update"] = time.perf_counter() - mark
        times["total"] = time.perf_counter() - start
        return StepResult(step, float(losses.mean()), losses, norm, times, skipped=problem is not None, stop=stop, save=save)

    def _sum_vector(self, step: int, loss: torch.Tensor | None, digest: int, n_norms: int,
                    requests: tuple[bool, ...] = ()) -> torch.Tensor:
        """The step's one vector, summed over the pipeline, then the replicas (returned on the CPU).

        Entries: squared norms by model parameter (``n_norms``: when clipping), the losses of every
        micro-batch of the global batch, with ``bias_update_speed`` the token copies routed to each
        expert of every router of the model (its copies on every replica and mirrored copy), the number of ranks
        asking for each of ``requests`` (``step(stop=, save=)``), the number of ranks whose gradients are not finite, and a
        16-bit digest of the global batch and its square. Each norm and loss entry has one non-zero
        contribution (its owner's): exact sums. Ranks asked for different steps (or with other samplers)
        would pair one batch's inputs with another's labels, and n digests are all equal only when
        sum**2 == n * (sum of squares): ``PipelineMismatchError`` before anything is updated.
        """
        dp, m, device = self.mesh.dp, self.num_chunks, self.pipe.device
        n_loads = self._router_slices[1] if self.config.bias_update_speed else 0
        vec = torch.zeros(n_norms + dp * m + n_loads + len(requests) + 3, dtype=torch.float64, device=device)  # on the device: NCCL moves no CPU tensors
        if requests:
            vec[-3 - len(requests) : -3] = torch.tensor(requests, dtype=torch.float64)
        if n_loads:  # token copies per expert of every router of the model (counts: exact float64 sums)
            for router, (start, end) in zip(self._routers, self._router_slices[0]):
                vec[n_norms + dp * m + start : n_norms + dp * m + end] += router.loads.to(torch.float64)
        vec[-2:] = torch.tensor([digest, digest * digest], dtype=torch.float64)
        if n_norms:
            vec[self._owned_index] = squared_norms(self._owned)  # a non-finite gradient makes its norm non-finite
        else:
            vec[-3] = _any_nonfinite(self._owned)
        if loss is not None:
            idx = torch.tensor(list(self.layout.label_microbatches), device=device) + self.mesh.dp_rank * m
            vec[n_norms + idx] = loss.detach().to(torch.float64)
        sum_across(vec, self.mesh.pp_group, self.timeout, self._where(f"step {step}: norms and losses over the pipeline"))
        sum_across(vec, self.mesh.dp_group, self.timeout, self._where(f"step {step}: norms and losses over data-parallel replicas"))
        vec = vec.cpu()
        total, squares = (int(v) for v in vec[-2:].tolist())
        if total * total != self.mesh.dp * self.mesh.pp * squares:
            raise PipelineMismatchError(self._where(
                f"step {step}: the ranks trained on different global batches (other step numbers, samplers or seeds); "
                "every rank must call step() with the same step and build its trainer alike (nothing was updated)"))
        return vec

    def _nonfinite(self, vec: torch.Tensor, n_norms: int, losses: torch.Tensor) -> str | None:
        """What in the summed vector is not finite (the same on every rank), or None."""
        parts = []
        bad_losses = [i for i, v in enumerate(losses.tolist()) if not math.isfinite(v)]
        if bad_losses:
            parts.append(f"the loss of global micro-batch(es) {_few(bad_losses)} ({losses[bad_losses[0]].item()})")
        bad_norms = [i for i, v in enumerate(vec[:n_norms].tolist()) if not math.isfinite(v)]
        if bad_norms:
            names = [self.parameter_names[i][0] for i in bad_norms]
            parts.append(f"the gradient norm ({float(vec[:n_norms].sum().sqrt())}; not finite in {_few(names)})")
        if vec[-3].item():
            parts.append(f"the gradients of {int(vec[-3].item())} rank(s)")
        return ", ".join(parts) if parts else None

    def _move_biases(self, loads: torch.Tensor) -> None:
        """Every held router's bias moved against its summed loads (the same on every copy and replica)."""
        gamma = self.config.bias_update_speed
        if gamma:
            for router, (start, end) in zip(self._routers, self._router_slices[0]):
                update_bias_(router.bias, loads[start:end], gamma)

    def _refuse_update(self, step: int, problem: str) -> None:
        """No rank updates (every rank sees the same sums): count the step as skipped, or raise."""
        what = self._where(f"step {step}: not finite: {problem}")
        if self.config.on_nonfinite == "raise":
            raise NonFiniteStepError(f"{what}. Nothing was updated on any rank (on_nonfinite='raise'; 'skip' skips such steps)")
        self.skipped_steps += 1

    def _publish_update(self, step: int) -> None:
        """The updated weights where the forward reads them: bf16 from the masters (mixed precision),
        every shard's to every data-parallel rank (ZeRO-1)."""
        if self.mixed:
            precision.refresh(self._updated, [self._optimized[id(p)] for p in self._updated])
        if isinstance(self.reducer, ShardedReducer):
            self.reducer.start_gather(self._where(f"step {step}"))
            if not self.defer_gather:
                self.finish_update()

    def _await_weights(self, index: int, module, args) -> None:
        """Forward pre-hook of stage module ``index`` (ZeRO-1): its weights' pending all-gathers awaited."""
        if self.reducer.pending:
            self.reducer.wait_gather(index, f"before the forward of stage {self.pipe.stages[index]}")

    def finish_update(self) -> None:
        """Await the all-gathers the last update left pending (ZeRO-1; nothing otherwise): afterwards
        every parameter this rank holds has its updated value. Whatever reads the weights between steps
        calls it first (checkpoints, ``mirrors_equal``, ``loaded_weights``); a stage's forward awaits its
        own. Raises ``PipelineBrokenError`` when an all-gather failed or a failed step abandoned them."""
        if isinstance(self.reducer, ShardedReducer):
            self.reducer.wait_gather(None, "before reading the weights")

    def state_bytes(self) -> dict[str, int]:
        """This rank's bytes of model state, by part (``twinpipe.sim.memory.MemoryParts`` names):
        ``params`` (every parameter held, mirrored copies included, in its own dtype), ``grads`` (the
        buffers gradients accumulate in: FP32 ``main_grad`` under mixed precision, else one
        ``.grad`` per parameter), ``master`` (FP32 masters of the parameters this rank updates:
        mixed precision only) and ``optimizer`` (every tensor of the optimizer's state as it is now:
        AdamW builds its state at the first step)."""
        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        params = sum(size(p) for p in self.params)
        grads = sum(size(p.main_grad) if getattr(p, "main_grad", None) is not None else size(p) for p in self.params)
        master = sum(size(t) for t in self._optimized.values()) if self.mixed else 0
        optimizer = sum(size(v) for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))
        return {"params": params, "grads": grads, "master": master, "optimizer": optimizer}

    def loaded_weights(self) -> None:
        """New values were written into the optimizer's tensors (a checkpoint): refresh the bf16
        weights from the masters (mixed precision)."""
        self.finish_update()  # none pending after load_checkpoint (it awaits them before loading)
        if self.mixed:
            precision.refresh(self._updated, [self._optimized[id(p)] for p in self._updated])

    @property
    def updated_parameters(self) -> list[torch.Tensor]:
        """The parameters this rank's optimizer updates (through their masters under mixed
        precision): all it holds, or with ZeRO-1 its shard of the dense ones and its experts."""
        return list(self._updated)

    def optimized_tensor(self, p: torch.Tensor) -> torch.Tensor | None:
        """The tensor this rank's optimizer updates for parameter ``p``: its FP32 master (mixed
        precision) or ``p`` itself; None when another data-parallel rank updates it (ZeRO-1)."""
        return self._optimized.get(id(p))

    def _start_reduction(self, stage: int) -> None:
        """The pipeline's ``on_grads_ready``: ``stage``'s gradients are final, start its buckets."""
        self.reducer.start(self._part_of[stage])

    def mirrors_equal(self) -> bool:
        """Whether every copy of every model stage is bitwise equal across the pipeline (collective)."""
        self.finish_update()
        if not self.is_dual:
            return True
        digests = []
        for s, module in zip(self.placement.stages_of(self.mesh.pp_rank), self.pipe.module):
            data = b"".join(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() for p in module.parameters())
            digests.append((self.placement.model_stage(s), hashlib.sha1(data).hexdigest()[:16]))
        seen: dict[int, set[str]] = {}
        for claims in gather_objects(self._agree_group, digests, self.timeout, self._where("comparing mirrored copies")):
            for k, digest in claims:
                seen.setdefault(k, set()).add(digest)
        return all(len(d) == 1 for d in seen.values())
