"""One training step, in the order ``trainer.py``'s docstring gives: the batch, the pipeline, the
gradient reductions, the step's one vector, the non-finite check, clipping and the update.

``TrainStep`` is built once by ``Trainer`` from its parts (``StepParts``) and runs every step; it
holds no state between steps but the weights' pending all-gathers (``update.py``).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from twinpipe.moe.grads import reduce_replica_grads
from twinpipe.runtime import waits
from twinpipe.runtime.batches import BatchLayout
from twinpipe.runtime.errors import (
    PipelineAbortedError, PipelineBrokenError, PipelineMismatchError, PipelineOutOfStepError, PipelinePeerFailedError,
)
from twinpipe.runtime.pipeline import Pipeline
from twinpipe.schedule.placement import Placement
from twinpipe.train import precision
from twinpipe.train.config import TrainConfig
from twinpipe.train.data import BatchSampler, replica_rows
from twinpipe.train.experts import PlacedRows
from twinpipe.train.grads import clip_coefficient, clip_grads, scale_grads, squared_norms
from twinpipe.train.mesh import TrainMesh
from twinpipe.train.ownership import Ownership
from twinpipe.train.routing import RoutingBalance
from twinpipe.train.stage_source import StageSource
from twinpipe.train.step_vector import StepVector, any_nonfinite
from twinpipe.train.tied import TiedPairs
from twinpipe.train.update import WeightUpdate

__all__ = ["StepParts", "StepResult", "TrainStep", "NonFiniteStepError"]


@dataclass(kw_only=True)
class StepResult:
    step: int
    loss: float  # mean over every micro-batch of the global batch
    losses: torch.Tensor  # per global micro-batch, in order
    grad_norm: float | None
    times: dict[str, float] = field(default_factory=dict)
    skipped: bool = False  # the loss or the gradients were not finite: no rank updated (on_nonfinite="skip")
    stop: bool = False  # some rank asked ``step(stop=True)``: the same on every rank (agreed in the step's all-reduce)
    save: bool = False  # some rank asked ``step(save=True)``: the same on every rank
    rebalance: object = None  # EPLB in the loop: this rank's RebalanceReport when the step ended with a rebalance


class NonFiniteStepError(FloatingPointError):
    """A step's loss, gradient norm or gradients were not finite, with ``on_nonfinite="raise"``:
    raised on every rank, before any update (the step can be retried or skipped alike everywhere)."""


# Raised by every rank of the step alike (agreement, the same summed vector), or heard from a peer:
# no failure notice to publish.
_RAISED_ALIKE = (PipelineMismatchError, PipelineAbortedError, PipelineBrokenError, PipelineOutOfStepError,
                 PipelinePeerFailedError, NonFiniteStepError)


@dataclass(frozen=True, kw_only=True)
class StepParts:
    """What a step uses, built once by ``Trainer`` (each part's module says what it does)."""

    config: TrainConfig
    mesh: TrainMesh
    sampler: BatchSampler
    source: StageSource  # its sync_mirrored_grads and batch
    pipe: Pipeline
    placement: Placement
    layout: BatchLayout  # this rank's share of the global batch
    parameter_names: Sequence[tuple[str, object]]  # the model's, in order: the vector's norm entries
    ownership: Ownership  # owned, updated, reducer and its parts
    update: WeightUpdate
    optimizer: torch.optim.Optimizer  # over update.masters
    routing: RoutingBalance
    tied: TiedPairs
    experts: bool  # MoE experts: reduced as twinpipe.moe.reduce_replica_grads says
    placed: PlacedRows | None = None  # EPLB in the loop: replicas' gradients summed, each expert counted once in the norm
    where: Callable[[str], str]  # "rank dp=.. pp=..: <what>"


class TrainStep:
    """Runs one step on ``parts``; ``criterion``: what the last stage runs (the model's loss, with
    MTP's ``MTPLoss`` around it; ``memory.measured_step`` wraps it for one step)."""

    def __init__(self, parts: StepParts, criterion):
        self.parts, self.criterion = parts, criterion
        index = {name: i for i, (name, _) in enumerate(parts.parameter_names)}
        device = parts.pipe.device
        self._owned_index = torch.tensor([index[n] for n in parts.ownership.owned_names], dtype=torch.long, device=device)
        self.num_chunks = parts.config.num_microbatches(parts.mesh.dp)
        self.timeout = float(parts.config.timeout)

    def run(self, step: int, requests: tuple[bool, bool]) -> StepResult:
        """Train on global batch ``step``; ``requests``: this rank's ``(stop, save)``. A failure that
        not every rank raises alike is published to the ranks waiting for this one (they hear of it
        now, not at their timeout)."""
        try:
            return self._run(step, requests)
        except _RAISED_ALIKE:
            raise  # every rank raises it, from the same sums or agreement: nothing to tell
        except BaseException as exc:
            p = self.parts
            waits.publish_failure(p.where(f"step {step} failed (global rank {dist.get_rank()}): {type(exc).__name__}: {exc}"),
                                  [p.mesh.pp_group, p.mesh.dp_group, *p.ownership.reducer.mirror_groups])
            raise

    def _run(self, step: int, requests: tuple[bool, bool]) -> StepResult:
        p, times = self.parts, {}
        start = time.perf_counter()
        overlap = p.ownership.overlap_dp and p.ownership.reducer.active
        loss, digest = self._pipeline(step, overlap)
        times["pipeline"] = time.perf_counter() - start
        times["busy"] = p.pipe.last_busy_s  # of "pipeline": running this rank's ops, not waiting for peers
        mark = time.perf_counter()
        p.source.sync_mirrored_grads(p.pipe)
        times["mirror"] = time.perf_counter() - mark
        mark = time.perf_counter()
        self._reduce(step, overlap)
        times["dp"] = time.perf_counter() - mark
        mark = time.perf_counter()
        scale_grads(p.ownership.updated, self.num_chunks * p.mesh.dp)
        clip = p.config.max_norm is not None
        vec = self._sum_vector(step, loss, digest, clip, requests)
        losses = vec.losses.clone()
        stop, save = (bool(v) for v in vec.requests.tolist())
        problem = vec.problem(p.parameter_names)
        norm, factor = clip_coefficient(vec.norms, p.config.max_norm) if clip else (None, 1.0)
        if problem is not None:
            self._refuse_update(step, problem)  # raises, or the step is skipped
        else:
            clip_grads(p.ownership.updated, factor)
            p.update.finish()  # normally done: every stage's forward awaited its all-gathers
            p.update.apply(p.optimizer, step, p.where(f"step {step}"))
            p.routing.move_biases(vec.loads)
        p.routing.zero_loads()
        times["update"] = time.perf_counter() - mark
        times["total"] = time.perf_counter() - start
        return StepResult(step=step, loss=float(losses.mean()), losses=losses, grad_norm=norm, times=times, skipped=problem is not None,
                          stop=stop, save=save)

    def start_reduction(self, stage: int) -> None:
        """The pipeline's ``on_grads_ready``: ``stage``'s gradients are final, start its buckets."""
        own = self.parts.ownership
        own.reducer.start(own.part_of[stage])

    def _pipeline(self, step: int, overlap: bool) -> tuple[torch.Tensor | None, int]:
        """``Pipeline.step`` on this replica's rows of batch ``step``: the losses of the micro-batches
        this rank ends (None elsewhere) and the global batch's 16-bit digest."""
        p = self.parts
        x, y = p.sampler.batch(step, p.config.batch_size)
        digest = zlib.crc32(y.cpu().numpy().tobytes(), zlib.crc32(x.cpu().numpy().tobytes())) & 0xFFFF
        rows = replica_rows(p.config.batch_size, p.mesh.dp, p.mesh.dp_rank)
        x, y = x[rows].to(p.pipe.device), y[rows].to(p.pipe.device)
        precision.zero_main_grads(p.ownership.params)  # .grad dropped, FP32 main_grad (mixed precision) zeroed
        if p.update.gather_before_step:
            p.update.finish()
        try:
            inputs, labels = p.source.batch(p.layout, x, y)
            loss, _ = p.pipe.step(*inputs, num_chunks=self.num_chunks, criterion=self.criterion, labels=labels,
                                  on_grads_ready=self.start_reduction if overlap else None)
        except BaseException:
            p.ownership.reducer.abandon()  # its peers' waits time out, naming the step
            raise
        return loss, digest

    def _reduce(self, step: int, overlap: bool) -> None:
        """Tied pairs summed over the pipeline, then data parallel (the parts not started during the
        pipeline step), then MoE experts' replicas."""
        p, where = self.parts, self.parts.where(f"step {step}")
        reducer = p.ownership.reducer
        if p.tied.pairs:  # before the data-parallel reduction: it moves main_grad, or reduce-scatters (ZeRO-1)
            p.tied.sum_grads(p.pipe.module, p.placement.stages_of(p.mesh.pp_rank), p.placement,
                             group=p.mesh.pp_group, timeout=self.timeout, where=where, device=p.pipe.device)
        if overlap:
            for part in p.ownership.tied_parts:
                reducer.start(part)
            reducer.wait(where)
        else:
            reducer.all_reduce(where)
        if p.experts or p.placed is not None:
            reduce_replica_grads(p.pipe.module, self.timeout)
        if p.ownership.expert_reducer is not None:  # the same experts in every EP group: their gradients summed
            p.ownership.expert_reducer.all_reduce(where)

    def _sum_vector(self, step: int, loss: torch.Tensor | None, digest: int, clip: bool,
                    requests: tuple[bool, ...] = ()) -> StepVector:
        """The step's one vector (``step_vector.py``), summed over the pipeline, then the replicas:
        this rank's squared norms of the parameters it owns (when clipping; else whether its gradients
        are finite), the losses of its micro-batches, its routers' loads, its requests and the digest."""
        p, m = self.parts, self.num_chunks
        dp, device = p.mesh.dp, p.pipe.device
        n_loads = p.routing.vector_size
        vec = StepVector(len(p.parameter_names) if clip else 0, dp * m, n_loads, len(requests), device)
        if requests:
            vec.requests[:] = torch.tensor(requests, dtype=torch.float64)
        if n_loads:
            p.routing.add_loads(vec.loads)
        vec.set_digest(digest)
        if clip:
            counted = p.placed.counted() if p.placed is not None else None
            vec.norms[self._owned_index] = squared_norms(p.ownership.owned, counted)  # a non-finite gradient makes its norm non-finite
        else:
            vec.nonfinite[0] = any_nonfinite(p.ownership.owned)
        if loss is not None:
            idx = torch.tensor(list(p.layout.label_microbatches), device=device) + p.mesh.dp_rank * m
            vec.losses[idx] = loss.detach().to(torch.float64)
        vec.sum([(p.mesh.pp_group, "norms and losses over the pipeline"),
                 (p.mesh.dp_group, "norms and losses over data-parallel replicas")],
                self.timeout, dp * p.mesh.pp, p.where(f"step {step}"))
        return vec

    def _refuse_update(self, step: int, problem: str) -> None:
        """No rank updates (every rank sees the same sums): raise, or let the step be skipped."""
        what = self.parts.where(f"step {step}: not finite: {problem}")
        if self.parts.config.on_nonfinite == "raise":
            raise NonFiniteStepError(f"{what}. Nothing was updated on any rank (on_nonfinite='raise'; 'skip' skips such steps)")
