"""One training step on a (dp, pp) mesh: pipeline step, gradient reductions, clipping, optimizer.

Per step, in this order (the order the single-process reference follows, so results are exact;
docs/architecture.md follows one step file by file):
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
collective whose sizes depend on it.
"""

from __future__ import annotations

import datetime
import hashlib
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.moe.grads import reduce_replica_grads
from twinpipe.runtime.batches import batch_layout
from twinpipe.runtime.collectives import cpu_group, gather_objects
from twinpipe.runtime import waits
from twinpipe.runtime.errors import (
    PipelineAbortedError, PipelineBrokenError, PipelineMismatchError, PipelineOutOfStepError, PipelinePeerFailedError,
)
from twinpipe.runtime.pipeline import Pipeline
from twinpipe.schedule.spec import resolve
from twinpipe.checks import bad
from twinpipe.train.checkpoint_view import CheckpointView
from twinpipe.train.config import TrainConfig, model_record
from twinpipe.train.data import BatchSampler, replica_rows
from twinpipe.train.evaluation import EvalResult, evaluate
from twinpipe.train.experts import check_experts, expert_ids, shard_experts
from twinpipe.train.grads import (
    clip_coefficient, clip_grads, scale_grads, squared_norms,
)
from twinpipe.train.memory import planned_options
from twinpipe.train.mesh import TrainMesh
from twinpipe.train.mtp import rank_criterion
from twinpipe.precisions import BF16_MIXED
from twinpipe.train import precision
from twinpipe.train.update import WeightUpdate
from twinpipe.train.zero import first_forward_in_fb  # noqa: F401  (re-exported)
from twinpipe.train.split_source import SplitStages, model_parameter_names, model_routers  # noqa: F401  (re-exported)
from twinpipe.train.ownership import broadcast_start, own_parameters
from twinpipe.train.settings import agree_optimizer, agree_settings
from twinpipe.train.routing import RoutingBalance
from twinpipe.train.tied import TiedPairs
from twinpipe.train.stage_source import StageSource, check_source
from twinpipe.train.step_vector import StepVector, any_nonfinite

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


class Trainer:
    """Trains ``model_fn()`` (built on every rank with ``config.seed``) on ``mesh``.

    ``optimizer_fn(params)`` builds any ``torch.optim`` optimizer over this rank's parameters;
    ``criterion(output, labels)`` is one micro-batch's mean loss.

    ``stages``: how to cut a model that is not a sequence of one-tensor layers (a ``transformers``
    causal LM: ``twinpipe train --model``, ``twinpipe.hf.HFSource``), a ``StageSource``
    (``stage_source.py``: every method the trainer calls); None cuts by ``split`` with
    ``config.balance`` (``split_source.SplitStages``).
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
        self.experts = check_experts(model, mesh.dp)
        pipeline_stages = self.placement.stages_of(mesh.pp_rank)
        modules = self._build_stages(model)
        experts = expert_ids(modules)
        # Tied copies (an MTP head's embedding copy, a transformers model's tied head): kept equal to
        # their main parameter, not in the norm.
        self._tied = TiedPairs(self.source.tied_copies(model), model)
        self.tied = self._tied.pairs
        self._criterion = rank_criterion(criterion, modules, held=self.source.mtp_modules(model), depth=config.mtp_depth,
                                         weight=config.mtp_weight, where=f"schedule={config.schedule!r}: rank pp={mesh.pp_rank}")
        self.routing = RoutingBalance(self.source, model, modules, pipeline_stages, self.placement, mesh.dp_rank,
                                      config.bias_update_speed)
        if config.balance_alpha:
            self.source.add_balance_loss(model, modules, config.balance_alpha, bool(self.routing.size))
        own = self.ownership = own_parameters(modules, pipeline_stages, placement=self.placement, mesh=mesh, config=config,
                                              experts=experts, tied=self.tied, timeout=self.timeout)
        self.params, self.held, self.reducer, self.overlap_dp = own.params, own.held, own.reducer, own.overlap_dp
        self._dense, self._owned, self._updated = own.dense, own.owned, own.updated
        self._prepare_update(modules, optimizer_fn, device)

    def _build_stages(self, model: nn.Module) -> list[nn.Module]:
        """This rank's stage modules (``StageSource.build``), MoE experts sharded over the data-parallel group."""
        mesh = self.mesh
        with waits.limit(self.timeout):  # the cut's own collectives (balance="time") wait the trainer's limit
            modules = list(self.source.build(model, self.schedule, mesh.pp_rank))
        if mesh.dp > 1:
            shard_experts(modules, mesh.dp_group)  # expert parallelism over the stage's data-parallel group
        # Parameters holding this data-parallel rank's rows of a model tensor (a transformers model's
        # fused experts): stored in checkpoints as one tensor sharded over ``row_mesh``.
        self.row_shards = set(self.source.row_shards(modules))
        self.row_mesh = mesh.mesh["dp"] if self.row_shards else None
        ep_group = self.source.row_group()
        if self.row_shards and ep_group is not None and dist.get_process_group_ranks(ep_group) != dist.get_process_group_ranks(mesh.dp_group):
            raise bad("stages.ep_group", dist.get_process_group_ranks(ep_group),
                      f"must be the mesh's data-parallel group {dist.get_process_group_ranks(mesh.dp_group)} (the rows "
                      "of each expert tensor are stored sharded over it)")
        return modules

    def _prepare_update(self, modules: Sequence[nn.Module], optimizer_fn, device) -> None:
        """The pipeline, the optimizer over the updated tensors (FP32 masters under mixed precision),
        every rank's start from the same weights, and ZeRO-1's deferred all-gathers hooked in."""
        mesh = self.mesh
        index = {name: i for i, (name, _) in enumerate(self.parameter_names)}
        self._owned_index = torch.tensor([index[n] for n in self.ownership.owned_names], dtype=torch.long, device=device)
        self.update = WeightUpdate(self._updated, self.reducer, mixed=self.mixed)
        self.pipe = Pipeline(modules, self.schedule, process_group=mesh.pp_group, timeout=self.timeout)
        self.update.hook_stages(self.pipe, self.num_chunks)  # ZeRO-1: each stage awaits its all-gathers before its forward
        self.optimizer = optimizer_fn(self.update.masters)
        agree_optimizer(self.optimizer, self.checkpoint_group, self.timeout, self._where("building the trainer"))  # before the initial weights' broadcast
        self._agree_group = cpu_group(mesh.pp_group, self.timeout)  # small CPU exchanges (mirrors_equal)
        broadcast_start(self._dense, mesh, self.timeout, self._where("broadcasting the initial weights across data-parallel replicas"))
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
        """``(name, buffer, owned)`` of the routing biases this rank holds (checkpoints store them):
        ``<router>.bias`` of a ``twinpipe.moe`` router, ``model.layers.N.mlp.gate.e_score_correction_bias``
        of a transformers DeepSeek-V3 gate; owned by data-parallel rank 0's first copy."""
        return self.routing.buffers

    def checkpoint_view(self) -> CheckpointView:
        """What ``save_checkpoint``/``load_checkpoint`` save and load of this trainer (all they read)."""
        c = self.config
        return CheckpointView(
            rank_name=self.rank_name, group=self.checkpoint_group, timeout=self.timeout,
            parameter_names=self.parameter_names, model_record=self.model_record,
            written_by={"schedule": c.schedule, "dp": self.mesh.dp, "pp": self.mesh.pp, "precision": c.precision, "zero": c.zero},
            optimizer=self.optimizer, held=self.held, buffers=self.held_buffers, tied=self.tied,
            row_shards=frozenset(self.row_shards), row_mesh=self.row_mesh, zero_unsaved_buffers=not self.source.initial_biases_kept,
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
        try:
            return self._step(step, (bool(stop), bool(save)))
        except _RAISED_ALIKE:
            raise  # every rank raises it, from the same sums or agreement: nothing to tell
        except BaseException as exc:  # the ranks waiting for this one hear of it now, not at their timeout
            waits.publish_failure(getattr(exc, "first", "") or self._where(
                f"step {step} failed (global rank {dist.get_rank()}): {type(exc).__name__}: {exc}"),
                [self.mesh.pp_group, self.mesh.dp_group, *self.reducer.mirror_groups])
            raise

    def evaluate(self, batches: BatchSampler, count: int) -> EvalResult:
        """The held-out loss on ``batches``' first ``count`` batches, forward only, nothing of training moved
        (``evaluation.py``); collective, between steps."""
        return evaluate(self, batches, count)

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
        if self.update.gather_before_step:
            self.finish_update()
        try:
            inputs, labels = self.source.batch(self.layout, x, y)
            loss, _ = self.pipe.step(*inputs, num_chunks=m, criterion=self._criterion, labels=labels,
                                     on_grads_ready=self._start_reduction if overlap else None)
        except BaseException:
            self.reducer.abandon()  # its peers' waits time out, naming the step
            raise
        times["pipeline"] = time.perf_counter() - start
        times["busy"] = self.pipe.last_busy_s  # of "pipeline": running this rank's ops, not waiting for peers
        mark = time.perf_counter()
        self.source.sync_mirrored_grads(self.pipe)
        times["mirror"] = time.perf_counter() - mark
        mark = time.perf_counter()
        if self.tied:  # before the data-parallel reduction: it moves main_grad, or reduce-scatters (ZeRO-1)
            self._tied.sum_grads(self.pipe.module, self.placement.stages_of(self.mesh.pp_rank), self.placement,
                                 group=self.mesh.pp_group, timeout=self.timeout, where=self._where(f"step {step}"),
                                 device=self.pipe.device)
        if overlap:
            for part in self.ownership.tied_parts:
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
        vec = self._sum_vector(step, loss, digest, clip, requests)
        losses = vec.losses.clone()
        stop, save = (bool(v) for v in vec.requests.tolist())
        problem = vec.problem(self.parameter_names)
        norm, factor = clip_coefficient(vec.norms, self.config.max_norm) if clip else (None, 1.0)
        if problem is not None:
            self._refuse_update(step, problem)  # raises, or counts the step as skipped
        else:
            clip_grads(self._updated, factor)
            self.finish_update()  # normally done: every stage's forward awaited its all-gathers
            self.update.apply(self.optimizer, step, self._where(f"step {step}"))
            self.routing.move_biases(vec.loads)
        self.routing.zero_loads()
        times["update"] = time.perf_counter() - mark
        times["total"] = time.perf_counter() - start
        return StepResult(step, float(losses.mean()), losses, norm, times, skipped=problem is not None, stop=stop, save=save)

    def _sum_vector(self, step: int, loss: torch.Tensor | None, digest: int, clip: bool,
                    requests: tuple[bool, ...] = ()) -> StepVector:
        """The step's one vector (``step_vector.py``), summed over the pipeline, then the replicas:
        this rank's squared norms of the parameters it owns (when clipping; else whether its gradients
        are finite), the losses of its micro-batches, its routers' loads, its requests and the digest."""
        dp, m = self.mesh.dp, self.num_chunks
        n_loads = self.routing.vector_size
        vec = StepVector(len(self.parameter_names) if clip else 0, dp * m, n_loads, len(requests), self.pipe.device)
        if requests:
            vec.requests[:] = torch.tensor(requests, dtype=torch.float64)
        if n_loads:
            self.routing.add_loads(vec.loads)
        vec.set_digest(digest)
        if clip:
            vec.norms[self._owned_index] = squared_norms(self._owned)  # a non-finite gradient makes its norm non-finite
        else:
            vec.nonfinite[0] = any_nonfinite(self._owned)
        if loss is not None:
            idx = torch.tensor(list(self.layout.label_microbatches), device=self.pipe.device) + self.mesh.dp_rank * m
            vec.losses[idx] = loss.detach().to(torch.float64)
        vec.sum([(self.mesh.pp_group, "norms and losses over the pipeline"),
                 (self.mesh.dp_group, "norms and losses over data-parallel replicas")],
                self.timeout, dp * self.mesh.pp, self._where(f"step {step}"))
        return vec

    def _refuse_update(self, step: int, problem: str) -> None:
        """No rank updates (every rank sees the same sums): count the step as skipped, or raise."""
        what = self._where(f"step {step}: not finite: {problem}")
        if self.config.on_nonfinite == "raise":
            raise NonFiniteStepError(f"{what}. Nothing was updated on any rank (on_nonfinite='raise'; 'skip' skips such steps)")
        self.skipped_steps += 1

    def finish_update(self) -> None:
        """Await the all-gathers the last update left pending (ZeRO-1; nothing otherwise): afterwards
        every parameter this rank holds has its updated value. Whatever reads the weights between steps
        calls it first (checkpoints, ``mirrors_equal``, ``loaded_weights``); a stage's forward awaits its
        own. Raises ``PipelineBrokenError`` when an all-gather failed or a failed step abandoned them."""
        self.update.finish()

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
        master = sum(size(t) for t in self.update.optimized.values()) if self.mixed else 0
        optimizer = sum(size(v) for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))
        return {"params": params, "grads": grads, "master": master, "optimizer": optimizer}

    def loaded_weights(self) -> None:
        """New values were written into the optimizer's tensors (a checkpoint): refresh the bf16
        weights from the masters (mixed precision)."""
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
        return list(self._updated)

    def optimized_tensor(self, p: torch.Tensor) -> torch.Tensor | None:
        """The tensor this rank's optimizer updates for parameter ``p``: its FP32 master (mixed
        precision) or ``p`` itself; None when another data-parallel rank updates it (ZeRO-1)."""
        return self.update.optimized.get(id(p))

    def _start_reduction(self, stage: int) -> None:
        """The pipeline's ``on_grads_ready``: ``stage``'s gradients are final, start its buckets."""
        self.reducer.start(self.ownership.part_of[stage])

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
