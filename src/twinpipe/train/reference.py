"""The same training in one process, for checking a pipelined run bit for bit.

It runs the whole model on each micro-batch and adds gradients in the order the trainer defines
(``twinpipe.train.grads``): per direction, then directions, then replicas, then scaled; norms,
clipping and the optimizer are the trainer's own functions; mixed precision (FP32 masters, bf16
compute, FP32 gradient buffers) is ``precision.py``'s, as in the trainer.

The data-parallel replicas are copies of the model in this process, run side by side on their own
rows. With MoE blocks and ``dp > 1`` each copy holds its replica's share of the experts, as the
trainer lays them out, over EP groups of ``ep`` replicas simulated in this process
(``twinpipe.moe.local``): an expert runs once per micro-batch on the rows of its EP group's
micro-batches, concatenated in replica order, as it does on its rank. Each EP group holds its own
copy of the experts; their gradients are summed over the groups left to right, as the dense ones
over the replicas. Running each replica alone instead hands an expert fewer
rows, and a BLAS product's row can come out differently with another number of rows or in another
place among them (on the AVX-512 CI machine, MKL computes the last ``rows % 4`` rows of a
double-precision product with another kernel): the same numbers only up to rounding, on some CPUs.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from twinpipe.moe import local
from twinpipe.moe.block import MoEBlock
from twinpipe.moe.bias import update_bias_
from twinpipe.moe.grads import expert_parameters
from twinpipe.overlap.stage import PartedSequential
from twinpipe.precisions import BF16_MIXED
from twinpipe.runtime.batches import microbatch_rows
from twinpipe.runtime.weight_grad import defer_weight_grads
from twinpipe.runtime.main_grad import grad_of
from twinpipe.schedule.spec import resolve
from twinpipe.train import precision
from twinpipe.train.data import BatchSampler, replica_rows
from twinpipe.train.grads import clip_coefficient, clip_grads, scale_grads, squared_norms
from twinpipe.train.mtp import MTPLoss, mtp_heads
from twinpipe.train.stages import model_layers
from twinpipe.train.config import TrainConfig
from twinpipe.train.split_source import model_routers, model_tied_copies

__all__ = ["ReferenceTrainer"]


class ReferenceTrainer:
    """Single-process twin of ``Trainer`` for ``dp`` replicas of a ``pp``-rank pipeline (MoE experts
    spread over EP groups of ``config.ep`` replicas, default ``dp``)."""

    def __init__(self, model_fn: Callable[[], nn.Module], sampler: BatchSampler, criterion, optimizer_fn,
                 config: TrainConfig, dp: int, pp: int, dtype: torch.dtype | None = None):
        self.config, self.sampler, self.criterion, self.dp = config, sampler, criterion, dp
        self.ep = config.expert_parallel(dp)
        if dp % self.ep:
            raise ValueError(f"ep={self.ep}: must divide dp={dp}")
        placement = resolve(config.schedule, pp, **dict(config.schedule_options)).placement
        self.directions = len(placement.chains)
        self.num_chunks = config.num_microbatches(dp)
        precision.check_dtype(config.precision, dtype)
        self.mixed = config.precision == BF16_MIXED
        torch.manual_seed(config.seed)
        self.model = defer_weight_grads(model_fn()).to(dtype=precision.MASTER_DTYPE if self.mixed else dtype)
        self.params = [p for _, layer in model_layers(self.model) for p in layer.parameters()]
        experts = expert_parameters(self.model)
        self._experts = [p for p in self.params if id(p) in experts]
        self._dense = [p for p in self.params if id(p) not in experts]
        self.replicas, self._group_experts = self._replicas(experts)
        self.routers = [r for _, r in model_routers(self.model)]
        self.criteria = [MTPLoss(criterion, mtp_heads([r])[0], config.mtp_weight) if config.mtp_depth else criterion
                         for r in self.replicas]
        named = self.named_parameters()
        self.tied = [(named[main], named[copy]) for main, copy in model_tied_copies(self.model)]
        where = {id(p): i for i, p in enumerate(self._dense)}
        self._tied_index = [(where[id(main)], where[id(copy)]) for main, copy in self.tied]  # in each replica's dense list
        self._norm_skip = [i for i, p in enumerate(self.params) if any(p is c for _, c in self.tied)]
        # What the optimizer updates: FP32 masters (mixed precision: the replicas compute in bf16) or the parameters.
        self.masters = precision.make_masters(self.params) if self.mixed else self.params
        if self.mixed:
            precision.to_compute([self.model, *self.replicas])
        self.optimizer = optimizer_fn(self.masters)

    def _replicas(self, experts: set[int]) -> tuple[list[nn.Module], list[list[torch.Tensor]]]:
        """The data-parallel replicas: the model itself for one; else copies whose dense parameters
        are their own and whose MoE blocks share their EP group's experts (the first group: the
        model's; each other group: a copy of its own), each replica keeping its share over a local EP
        group (as ``Trainer`` shards them over its EP group). Also each EP group's expert parameters,
        in the order of ``self._experts``."""
        if self.dp == 1:
            return [self.model], [self._experts]
        replicas, group_experts = [], []
        for g in range(self.dp // self.ep):
            holder = self.model if g == 0 else copy.deepcopy(self.model)  # whose experts this EP group shares
            ids = expert_parameters(holder)
            shared = {id(m): m for m in holder.modules() if any(id(p) in ids for p in m.parameters(recurse=False))}
            group_experts.append([p for _, layer in model_layers(holder) for p in layer.parameters() if id(p) in ids])
            group = local.LocalEPGroup(self.ep)
            for e in range(self.ep):
                replica = copy.deepcopy(holder, memo=dict(shared))
                for block in replica.modules():
                    if isinstance(block, MoEBlock):
                        block.shard_experts_(group.rank(e))
                replicas.append(replica)
        return replicas, group_experts

    def _replica_dense(self, replica: nn.Module) -> list[torch.Tensor]:
        """``replica``'s dense parameters, in the order of ``self._dense``."""
        experts = expert_parameters(replica)
        return [p for _, layer in model_layers(replica) for p in layer.parameters() if id(p) not in experts]

    @staticmethod
    def _stage(model: nn.Module) -> nn.Module:
        """The model as the trainer's stages run it: with MoE blocks, its layers as one sequence of
        parts (embedding and head one part each), else the model itself."""
        layers = [layer for _, layer in model_layers(model)]
        return PartedSequential(layers) if any(hasattr(layer, "parts") for layer in layers) else model

    def step(self, step: int) -> tuple[float, torch.Tensor, float | None]:
        """``(mean loss, per-micro-batch losses, global gradient norm or None)`` of batch ``step``."""
        dp = self.dp
        x, y = self.sampler.batch(step, self.config.batch_size)
        rows = [replica_rows(self.config.batch_size, dp, d) for d in range(dp)]
        dense = [self._replica_dense(r) for r in self.replicas] if dp > 1 else [self._dense]
        routers = self._start_replicas(dense)
        losses, replica_grads, expert_grads = self._run_directions([x[r] for r in rows], [y[r] for r in rows], dense)
        for mine in replica_grads:  # then each replica's tied pairs: main + copy to both (train/tied.py)
            for i, j in self._tied_index:
                mine[i] = mine[i] + mine[j]
                mine[j] = mine[i].clone()
        total = replica_grads[0]
        for more in replica_grads[1:]:  # then the replicas, left to right
            total = [a.add_(b) for a, b in zip(total, more)]
        grad_of_param = dict(zip(map(id, self._dense + self._experts), total + expert_grads))
        for p, t in zip(self.params, self.masters):
            t.grad = grad_of_param[id(p)]
        norm = self._update(routers)
        return float(losses.mean()), losses, norm

    def _start_replicas(self, dense: list[list[torch.Tensor]]) -> list[list[nn.Module]]:
        """Every replica from the model's weights and routing biases, its routers' loads zeroed; the
        routers of each replica."""
        routers = [[r for _, r in model_routers(replica)] for replica in self.replicas]
        if self.dp > 1:
            with torch.no_grad():
                for params in dense:
                    for p, q in zip(params, self._dense):
                        p.copy_(q)
                for params in self._group_experts[1:]:  # the other EP groups' copies of the experts
                    for p, q in zip(params, self._experts):
                        p.copy_(q)
                for mine in routers:
                    for r, q in zip(mine, self.routers):
                        r.bias.copy_(q.bias)
        for mine in routers:
            for r in mine:
                r.loads.zero_()
        return routers

    def _run_directions(self, xs: list[torch.Tensor], ys: list[torch.Tensor], dense: list[list[torch.Tensor]]):
        """Forward and backward of every micro-batch on every replica, direction by direction (DualPipe's
        mirrored copies); ``(losses, each replica's dense gradients, the experts' gradients)``, summed per
        direction, then over directions."""
        dp, m = self.dp, self.num_chunks
        stages = [self._stage(r) for r in self.replicas]
        losses = torch.zeros(dp * m, dtype=torch.float64)
        per = m // self.directions
        replica_grads = expert_grads = None
        for c in range(self.directions):
            _fresh_grads([p for params in dense + self._group_experts for p in params])
            for j in range(c * per, (c + 1) * per):
                mb = [microbatch_rows(len(xr), m, range(j, j + 1)) for xr in xs]
                outs = local.forward(stages, [xr[s] for xr, s in zip(xs, mb)])
                mb_losses = [crit(*(o if isinstance(o, tuple) else (o,)), yr[s])
                             for crit, o, yr, s in zip(self.criteria, outs, ys, mb)]
                local.backward(mb_losses, [torch.ones_like(loss) for loss in mb_losses])
                for d, loss in enumerate(mb_losses):
                    losses[d * m + j] = float(loss.detach())
            grads = [[_grad(p) for p in params] for params in dense]
            experts = [[_grad(p) for p in params] for params in self._group_experts]
            if replica_grads is None:
                replica_grads, expert_grads = grads, experts
            else:  # then the directions
                replica_grads = [[a.add_(b) for a, b in zip(mine, more)] for mine, more in zip(replica_grads, grads)]
                expert_grads = [[a.add_(b) for a, b in zip(mine, more)] for mine, more in zip(expert_grads, experts)]
        expert_total = expert_grads[0]
        for more in expert_grads[1:]:  # an expert's copies, one per EP group, left to right
            expert_total = [a.add_(b) for a, b in zip(expert_total, more)]
        return losses, replica_grads, expert_total

    def _update(self, routers: list[list[nn.Module]]) -> float | None:
        """Scaling, clipping and the optimizer on the masters' gradients, the routing biases moved;
        the global gradient norm (None without clipping)."""
        scale_grads(self.masters, self.num_chunks * self.dp)
        norm = None
        if self.config.max_norm is not None:
            norms = squared_norms(self.masters)
            norms[self._norm_skip] = 0.0  # a tied copy counts as its main parameter, once
            norm, factor = clip_coefficient(norms, self.config.max_norm)
            clip_grads(self.masters, factor)
        self.optimizer.step()
        if self.mixed:
            precision.refresh(self.params, self.masters)
        if self.config.bias_update_speed:  # each router's loads summed over the replicas, then its bias moved
            for j, router in enumerate(self.routers):
                update_bias_(router.bias, sum(mine[j].loads for mine in routers), self.config.bias_update_speed)
        return norm

    def named_buffers(self) -> dict[str, torch.Tensor]:
        """The routing biases by name in the model (as ``Trainer.held_buffers`` names them)."""
        return {f"{name}.bias": r.bias for name, r in model_routers(self.model)}

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{sub}": p for name, layer in model_layers(self.model) for sub, p in layer.named_parameters()}

    def named_masters(self) -> dict[str, torch.Tensor]:
        """What the optimizer updates, by parameter name: the FP32 masters (mixed precision), else the parameters."""
        master = dict(zip(map(id, self.params), self.masters))
        return {name: master[id(p)] for name, p in self.named_parameters().items()}

    def load_state(self, parameters: dict[str, torch.Tensor], optimizer_state: dict[str, dict] | None = None,
                   buffers: dict[str, torch.Tensor] | None = None) -> None:
        """Continue from another run's weights (and, by parameter name, its optimizer state), e.g. a
        pipelined run's before each step, so a comparison measures one step's difference."""
        named = self.named_masters()
        missing = sorted(set(named) - set(parameters))
        if missing:
            raise ValueError(f"parameters: lacks {missing}")
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(parameters[name])
        if buffers is not None:
            with torch.no_grad():
                for name, b in self.named_buffers().items():
                    b.copy_(buffers[name])
        if self.mixed:
            precision.refresh(self.params, self.masters)
        if optimizer_state is not None:
            for name, p in named.items():
                state = optimizer_state.get(name, {})
                self.optimizer.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _grad(p: torch.Tensor) -> torch.Tensor:
    g = grad_of(p)
    return g if g is not None else torch.zeros_like(p)


def _fresh_grads(params) -> None:
    """No gradient yet: ``.grad`` dropped, a new zero ``main_grad`` (mixed precision; the old one is
    kept by the sums of the directions)."""
    for p in params:
        p.grad = None
        if getattr(p, "main_grad", None) is not None:
            p.main_grad = torch.zeros_like(p.main_grad)
