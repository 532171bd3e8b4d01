"""Training on a (dp, pp) mesh: ``Trainer`` builds the parts once, then ``step()`` runs one global batch.

One step (``step.py``'s ``TrainStep``, built from the parts), in this order (the order the
single-process reference follows, so results are exact; docs/architecture.md follows it file by file):
1. ``Pipeline.step`` on this replica's rows: gradients summed over micro-batches into ``.grad``
   (with ``overlap_dp`` and one chain, each stage's data-parallel buckets start as soon as its last
   gradient-writing op has run: the pipeline's ``on_grads_ready``);
2. the stage source's ``sync_mirrored_grads``: mirrored copies (DualPipe, Chimera, BitPipe) add their
   gradients; then every copy of a tied pair gets ``main + copy`` over the pipeline (``tied.py``);
3. data parallel (``ownership.py`` built the reducer): dense gradients summed across replicas
   (ZeRO-1: reduce-scattered to their owners, ``zero.py``); MoE experts only as
   ``twinpipe.moe.reduce_replica_grads`` says; all divided by the global batch's micro-batches;
4. the step's one vector (``step_vector.py``), summed over the pipeline, then the replicas: squared
   norms (each model parameter counted once, at its owner), losses, routers' loads
   (``routing.py``), ``step(stop=, save=)`` requests, non-finite counts and a batch digest;
5. a non-finite loss, norm or gradient (every rank sees the same sums): the update is skipped, or
   ``NonFiniteStepError`` raised on every rank (``TrainConfig.on_nonfinite``);
6. clipping (``max_norm``), then ``update.py``: the optimizer (FP32 masters under
   ``precision="bf16-mixed"``, copied to the bf16 weights after), ZeRO-1's all-gathers of the new
   weights started (each stage's next forward awaits its own; ``finish_update()`` the rest, before
   anything reads the weights).
When the trainer is built, its ranks agree on the whole configuration (``settings.py``) before any
collective whose sizes depend on it; the parts: ``StageSource`` (``stage_source.py``), ownership and
the reducer (``ownership.py``), ``TiedPairs``, ``RoutingBalance``, ``WeightUpdate``, the pipeline.
"""

from __future__ import annotations

import datetime
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.runtime.batches import batch_layout
from twinpipe.runtime.collectives import cpu_group
from twinpipe.runtime import waits
from twinpipe.runtime.pipeline import Pipeline
from twinpipe.schedule.spec import resolve
from twinpipe.train.checkpoint_view import CheckpointView
from twinpipe.train.config import TrainConfig, model_record
from twinpipe.train.data import BatchSampler
from twinpipe.train.evaluation import EvalResult, evaluate
from twinpipe.train.experts import PlacedRows, check_experts, check_row_group, expert_ids, shard_experts
from twinpipe.train.memory import planned_options, state_bytes
from twinpipe.train.mirrors import mirrors_equal
from twinpipe.train.mesh import TrainMesh
from twinpipe.train.mtp import rank_criterion
from twinpipe.precisions import BF16_MIXED
from twinpipe.train import live_eplb, precision
from twinpipe.train.update import WeightUpdate
from twinpipe.train.zero import first_forward_in_fb  # noqa: F401  (re-exported)
from twinpipe.train.split_source import SplitStages, model_parameter_names, model_routers  # noqa: F401  (re-exported)
from twinpipe.train.ownership import broadcast_start, own_parameters
from twinpipe.train.settings import agree_optimizer, agree_settings
from twinpipe.train.routing import RoutingBalance
from twinpipe.train.stages import is_mirror_copy
from twinpipe.train.step import NonFiniteStepError, StepParts, StepResult, TrainStep
from twinpipe.train.tied import TiedPairs
from twinpipe.train.stage_source import StageSource, check_source

__all__ = ["TrainConfig", "StepResult", "Trainer", "NonFiniteStepError", "model_parameter_names"]


class Trainer:
    """Trains ``model_fn()`` (built on every rank with ``config.seed``) on ``mesh``.

    ``optimizer_fn(params)`` builds any ``torch.optim`` optimizer over this rank's parameters;
    ``criterion(output, labels)`` is one micro-batch's mean loss.

    ``stages``: how to cut a model that is not a sequence of one-tensor layers (a ``transformers``
    causal LM: ``twinpipe train --model``, ``twinpipe.hf.HFSource``), a ``StageSource``
    (``stage_source.py``: every method the trainer calls); None cuts by ``split`` with
    ``config.balance`` (``split_source.SplitStages``). Its nine arguments are the signature users call
    (docs/train.md): kept (tests/test_architecture.py, PUBLIC).
    """

    def __init__(self, model_fn: Callable[[], nn.Module], sampler: BatchSampler, criterion, optimizer_fn,
                 mesh: TrainMesh, config: TrainConfig, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 stages=None):
        if not isinstance(config, TrainConfig):
            raise ValueError(f"config={config!r}: must be a TrainConfig")
        if stages is not None:
            check_source(stages)
        self.config, self.mesh, self.sampler, self.criterion = config, mesh, sampler, criterion
        self.timeout = float(config.timeout)  # TrainConfig checked it
        self.skipped_steps = 0  # steps whose loss or gradients were not finite (on_nonfinite="skip")
        # The start-up agreement and checkpoints (torch.distributed.checkpoint's own collectives) run on
        # a gloo group over the world, whose timeout bounds them.
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        precision.check_dtype(config.precision, dtype)
        self.mixed = config.precision == BF16_MIXED
        torch.manual_seed(config.seed)
        model = model_fn().to(device=device, dtype=precision.MASTER_DTYPE if self.mixed else dtype)  # mixed: cast after the masters
        self.stages = stages  # the user's (None: the model is cut by split)
        self.source: StageSource = stages if stages is not None else SplitStages(
            config.balance, lambda: sampler.batch(0, config.microbatch_size)[0], self.timeout, self._where)
        self.parameter_names = list(self.source.parameter_names(model))
        self.model_record = model_record(model)  # the model's configuration, as checkpoints store it
        agree_settings(config, model, self.parameter_names, self.model_record, criterion, device, self.checkpoint_group,
                       self._where("building the trainer"))  # before any collective whose sizes depend on the settings
        options = planned_options(config, model, sampler, criterion, mesh.pp, device)  # ZB-V, zb-auto: the measured M_W
        self.schedule = resolve(config.schedule, mesh.pp, **options)  # once: the layout, stages and pipeline share it
        self.placement = self.schedule.placement
        self.num_chunks = config.num_microbatches(mesh.dp)
        self.layout = batch_layout(self.schedule, mesh.pp, mesh.pp_rank, self.num_chunks)
        self.expert_groups = mesh.expert_groups(config.expert_parallel(mesh.dp))  # collective: ep strictly inside (1, dp)
        self.experts = check_experts(model, self.expert_groups.ep, "dp" if config.ep is None else "ep")
        live_eplb.check_trainer(config, self.expert_groups.ep, mesh.dp, gpt_experts=self.experts, mirrored=self.is_dual)
        modules = self._build_stages(model)
        # Tied copies (an MTP head's embedding copy, a transformers model's tied head): equal to their main, not in the norm.
        self._tied = TiedPairs(self.source.tied_copies(model), model)
        self.tied = self._tied.pairs
        criterion = rank_criterion(criterion, modules, held=self.source.mtp_modules(model), depth=config.mtp_depth,
                                   weight=config.mtp_weight, where=f"schedule={config.schedule!r}: rank pp={mesh.pp_rank}")
        self.routing = RoutingBalance(self.source, model, modules, self._owns_routers(), config.bias_update_speed)
        if config.balance_alpha:
            self.source.add_balance_loss(model, modules, config.balance_alpha, bool(self.routing.size))
        own = self.ownership = own_parameters(modules, self.placement.stages_of(mesh.pp_rank), placement=self.placement,
                                              mesh=mesh, config=config, experts=expert_ids(modules), tied=self.tied,
                                              timeout=self.timeout, expert_groups=self.expert_groups)
        self.params, self.held, self.reducer, self.overlap_dp = own.params, own.held, own.reducer, own.overlap_dp
        self._prepare_update(modules, optimizer_fn)
        # Experts by logical id (checkpoints); EPLB in the loop, or None (collective over the EP groups).
        self.placed, self.eplb = PlacedRows(modules, self.timeout), live_eplb.start(modules, self.optimizer, config, self.timeout)
        self.train_step = TrainStep(StepParts(
            config=config, mesh=mesh, sampler=sampler, source=self.source, pipe=self.pipe, placement=self.placement,
            layout=self.layout, parameter_names=self.parameter_names, ownership=own, update=self.update,
            optimizer=self.optimizer, routing=self.routing, tied=self._tied, experts=self.experts, where=self._where,
            placed=self.placed if self.eplb else None), criterion)

    def _build_stages(self, model: nn.Module) -> list[nn.Module]:
        """This rank's stage modules (``StageSource.build``), MoE experts sharded over its EP group."""
        mesh, groups = self.mesh, self.expert_groups
        with waits.limit(self.timeout):  # the cut's own collectives (balance="time") wait the trainer's limit
            modules = list(self.source.build(model, self.schedule, mesh.pp_rank))
        if groups.ep_group is not None:
            shard_experts(modules, groups.ep_group)  # expert parallelism over the stage's EP group
        # This EP rank's rows of a model tensor (fused experts): stored as one tensor sharded over ``row_mesh``.
        self.row_shards = set(self.source.row_shards(modules))
        self.row_mesh = groups.ep_mesh if self.row_shards else None
        if self.row_shards:
            check_row_group(self.source.row_group(), groups)
        return modules

    def _owns_routers(self) -> list[bool]:
        """Per pipeline stage of this rank: whether its routers' biases are this rank's to save (data-parallel
        rank 0's first copy, as for a dense parameter)."""
        return [self.mesh.dp_rank == 0 and not is_mirror_copy(self.placement, s) for s in self.placement.stages_of(self.mesh.pp_rank)]

    def _prepare_update(self, modules: Sequence[nn.Module], optimizer_fn) -> None:
        """The pipeline, the optimizer over the updated tensors (FP32 masters under mixed precision),
        every rank's start from the same weights, and ZeRO-1's deferred all-gathers hooked in."""
        mesh, where = self.mesh, self._where("building the trainer")
        self.update = WeightUpdate(self.ownership.updated, self.reducer, mixed=self.mixed)
        self.pipe = Pipeline(modules, self.schedule, process_group=mesh.pp_group, timeout=self.timeout)
        self.update.hook_stages(self.pipe, self.num_chunks)  # ZeRO-1: each stage awaits its all-gathers before its forward
        self.optimizer = optimizer_fn(self.update.masters)
        agree_optimizer(self.optimizer, self.checkpoint_group, self.timeout, where)  # before the initial weights' broadcast
        self._agree_group = cpu_group(mesh.pp_group, self.timeout)  # small CPU exchanges (mirrors_equal)
        broadcast_start(self.ownership.dense, mesh, self.timeout, self._where("broadcasting the initial weights to the replicas"))
        if self.is_dual:  # every mirrored copy from one copy's weights
            self.pipe.sync_mirrored_weights()
        self.routing.zero_loads()  # balance="time" ran the layers
        self.update.start(modules)  # mixed precision: masters from the agreed weights

    @property
    def stage_names(self) -> list[tuple[str, ...]] | None:
        """The layers of each model stage (a model cut by split; None for a custom ``stages``)."""
        return self.source.stage_names if isinstance(self.source, SplitStages) else None

    @property
    def held_buffers(self) -> list[tuple[str, torch.Tensor, bool]]:
        """``(name, buffer, owned)`` of the routing biases this rank holds (checkpoints store them; owned by
        data-parallel rank 0's first copy): a ``twinpipe.moe`` router's ``bias``, a DeepSeek-V3 gate's."""
        return self.routing.buffers

    def checkpoint_view(self) -> CheckpointView:
        """What ``save_checkpoint``/``load_checkpoint`` save and load of this trainer (all they read)."""
        c = self.config
        return CheckpointView(
            rank_name=self.rank_name, group=self.checkpoint_group, timeout=self.timeout,
            parameter_names=self.parameter_names, model_record=self.model_record,
            written_by={"schedule": c.schedule, "dp": self.mesh.dp, "pp": self.mesh.pp, "ep": self.expert_groups.ep,
                        "precision": c.precision, "zero": c.zero},
            optimizer=self.optimizer, held=self.held, buffers=self.held_buffers, tied=self.tied,
            row_shards=frozenset(self.row_shards), row_mesh=self.row_mesh, placed=self.placed,
            zero_unsaved_buffers=not self.source.initial_biases_kept,
            optimized_tensor=self.optimized_tensor, finish_update=self.finish_update, loaded_weights=self.loaded_weights)

    @property
    def is_dual(self) -> bool:
        """Whether the schedule keeps two copies of the model (DualPipe, Chimera, BitPipe)."""
        return len(self.placement.chains) > 1

    @property
    def rank_name(self) -> str:
        """This rank as messages name it: ``"rank dp=1 pp=0"``."""
        return f"rank dp={self.mesh.dp_rank} pp={self.mesh.pp_rank}"

    def _where(self, what: str) -> str:
        return f"{self.rank_name}: {what}"

    def step(self, step: int, *, stop: bool = False, save: bool = False) -> StepResult:
        """Train on global batch ``step`` (from the sampler). ``stop``, ``save``: this rank's request (a
        signal arrived, a save is due by its clock), agreed in the step's all-reduce: the result's
        ``stop``/``save`` are True on every rank when any rank asked, so all ranks act alike."""
        result = self.train_step.run(step, (bool(stop), bool(save)))  # train/step.py
        result.rebalance = self.eplb.after_step() if self.eplb else None  # collective over the EP groups
        self.skipped_steps += result.skipped
        return result

    def evaluate(self, batches: BatchSampler, count: int) -> EvalResult:
        """The held-out loss on ``batches``' first ``count`` batches, forward only (``evaluation.py``); collective."""
        return evaluate(self, batches, count)

    def finish_update(self) -> None:
        """Await the all-gathers the last update left pending (ZeRO-1; nothing otherwise), so every weight held is
        updated. Whatever reads the weights between steps calls it first (a stage's forward awaits its own).
        Raises ``PipelineBrokenError`` when an all-gather failed or a failed step abandoned them."""
        self.update.finish()

    def state_bytes(self) -> dict[str, int]:
        """This rank's bytes of model state by part: parameters held, gradients, FP32 masters, optimizer state (``memory.state_bytes``)."""
        masters = self.update.optimized.values() if self.mixed else ()
        return state_bytes(self.params, masters, self.optimizer)

    def loaded_weights(self) -> None:
        """New values were written into the optimizer's tensors (a checkpoint): the bf16 weights refreshed (mixed precision)."""
        self.finish_update()  # none pending after load_checkpoint (it awaits them before loading)
        self.update.refresh()

    @property
    def defer_gather(self) -> bool:
        """ZeRO-1: whether an update's all-gathers are awaited by each stage's next forward (the
        default) rather than inside ``step()`` (False: the eager order; bench/bench_zero.py compares)."""
        return self.update.defer_gather

    @defer_gather.setter
    def defer_gather(self, value: bool) -> None:
        self.update.defer_gather = bool(value)

    @property
    def updated_parameters(self) -> list[torch.Tensor]:
        """The parameters this rank's optimizer updates (through their masters under mixed
        precision): all it holds, or with ZeRO-1 its shard of the dense ones and its experts."""
        return list(self.ownership.updated)

    def optimized_tensor(self, p: torch.Tensor) -> torch.Tensor | None:
        """The tensor this rank's optimizer updates for parameter ``p``: its FP32 master (mixed
        precision) or ``p`` itself; None when another data-parallel rank updates it (ZeRO-1)."""
        return self.update.optimized.get(id(p))

    def mirrors_equal(self) -> bool:
        """Whether every copy of every model stage is bitwise equal across the pipeline (collective)."""
        self.finish_update()
        if not self.is_dual:
            return True
        return mirrors_equal(self.pipe, self.placement, self.mesh.pp_rank, self._agree_group, self.timeout, self.rank_name)
