"""The update: the optimizer's step and where its new weights go.

Under ``precision="bf16-mixed"`` the optimizer updates FP32 masters, copied to the bf16 weights
after each update (``precision.py``). With ZeRO-1 (a ``ShardedReducer``) each rank updates its shard
and starts the all-gathers of the new weights: each stage module's forward awaits its own (a
forward pre-hook), ``finish`` the rest (``defer_gather = False`` awaits them in the update: the same
bits). An update that fails on this rank before its all-gathers started leaves its weights stale:
they are refused from then on (``PipelineBrokenError``), and the trainer tells the peers.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn

from twinpipe.train import precision
from twinpipe.train.grads import DataParallelReducer
from twinpipe.train.zero import ShardedReducer, first_forward_in_fb

__all__ = ["WeightUpdate"]


class WeightUpdate:
    """The tensors the optimizer updates for this rank's ``updated`` parameters (their FP32 masters
    with ``mixed``), and the publication of new weights through ``reducer``."""

    def __init__(self, updated: Sequence[torch.Tensor], reducer: DataParallelReducer, *, mixed: bool):
        self.updated, self.reducer, self.mixed = list(updated), reducer, mixed
        self.masters = precision.make_masters(self.updated) if mixed else self.updated
        self.optimized = {id(p): t for p, t in zip(self.updated, self.masters)}  # parameter -> the tensor the optimizer updates
        self.sharded = isinstance(reducer, ShardedReducer)
        self.defer_gather = self.sharded  # False: awaited inside the update (the eager order; bench/bench_zero.py compares)
        self.gather_before_step = False

    def hook_stages(self, pipe, num_chunks: int) -> None:
        """ZeRO-1: each stage module of ``pipe`` awaits its weights' all-gathers before its forward. The
        pre-hook does not see a forward run through a stage's parts (the forward half of an F&B op):
        a schedule whose first forward of a stage is one awaits every all-gather before the step."""
        if not self.sharded:
            return
        self.reducer.set_stages([[p for _, p in m.named_model_parameters()] for m in pipe.module])
        for j, module in enumerate(pipe.module):
            module.register_forward_pre_hook(functools.partial(self._await_weights, j, pipe.stages[j]))
        self.gather_before_step = first_forward_in_fb(pipe.schedule_for(num_chunks).ops[pipe.rank])

    def _await_weights(self, index: int, stage: int, module, args) -> None:
        """Forward pre-hook of stage module ``index``: its weights' pending all-gathers awaited
        (``PipelineBrokenError`` when they are incomplete, e.g. after this rank's update failed)."""
        self.reducer.wait_gather(index, f"before the forward of stage {stage}")

    def start(self, modules: Sequence[nn.Module]) -> None:
        """Mixed precision, once every rank holds the agreed weights: the masters from them, then the
        bf16 compute copy and the FP32 gradient buffers the masters read."""
        if self.mixed:
            precision.refresh(self.masters, self.updated)
            precision.to_compute(modules)
            for p, m in zip(self.updated, self.masters):
                m.grad = p.main_grad  # one tensor: what the trainer reduces is what the optimizer reads

    def apply(self, optimizer, step: int, where: str) -> None:
        """The optimizer's step, then its weights published; when either fails (ZeRO-1), this rank's
        weights are refused from now on (``ShardedReducer.refuse_weights``). ``where``: rank and step."""
        try:
            optimizer.step()
            self._publish(where)
        except BaseException as exc:
            if self.sharded:
                self.reducer.refuse_weights(where, f"the update of step {step} failed before its all-gathers "
                                                   f"({type(exc).__name__}: {exc})")
            raise

    def _publish(self, where: str) -> None:
        """The updated weights where the forward reads them: bf16 from the masters (mixed precision),
        every shard's to every data-parallel rank (ZeRO-1)."""
        self.refresh()
        if self.sharded:
            self.reducer.start_gather(where)
            if not self.defer_gather:
                self.finish()

    def refresh(self) -> None:
        """The bf16 compute weights from the masters (mixed precision; nothing otherwise)."""
        if self.mixed:
            precision.refresh(self.updated, [self.optimized[id(p)] for p in self.updated])

    def finish(self) -> None:
        """Await the all-gathers the last update left pending (ZeRO-1; nothing otherwise)."""
        if self.sharded:
            self.reducer.wait_gather(None, "before reading the weights")
