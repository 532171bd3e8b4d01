"""Gradients of the parameters every expert-parallel rank holds a copy of."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.moe.block import MoEBlock

__all__ = ["reduce_dense_grads", "reduce_replica_grads"]


def reduce_dense_grads(module: nn.Module, ep_group) -> None:
    """Sum over ``ep_group`` the gradients of ``module``'s parameters that are not routed experts.

    Across an expert-parallel group, attention, router, norms and shared experts are replicated
    and see different tokens (data parallel), so their gradients must be summed after backward;
    each routed expert lives on one rank and already holds its full gradient. Call on every rank
    of the group, after ``step()``.
    """
    experts = {id(p) for block in module.modules() if isinstance(block, MoEBlock) for p in block.experts.parameters()}
    dense = [p for p in module.parameters() if id(p) not in experts and p.requires_grad]
    if not dense or ep_group is None or dist.get_world_size(ep_group) == 1:
        return
    for p in dense:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in dense])
    dist.all_reduce(flat, group=ep_group)
    offset = 0
    for p in dense:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def reduce_replica_grads(module: nn.Module) -> None:
    """Sum the gradients of the replicas of each routed expert, over slots and EP ranks, and give
    every replica the sum: replicas then stay identical through any optimizer step.

    A replica's gradient covers only the token copies sent to it; the expert's gradient is the sum
    over its replicas. Only replicated experts are exchanged (one all-reduce per block over its EP
    group); a missing gradient counts as zero. Call on every rank of the group after ``step()``
    (deferred weight gradients included), before the optimizer step.
    """
    for block in module.modules():
        if not isinstance(block, MoEBlock):
            continue
        phy2log = block.phy2log
        counts = torch.bincount(phy2log, minlength=block.num_experts)
        shared = torch.nonzero(counts > 1).reshape(-1)
        if len(shared) == 0:
            continue
        row_of = {int(e): i for i, e in enumerate(shared)}
        params = [list(expert.parameters()) for expert in block.experts]
        size = sum(p.numel() for p in params[0])
        ref = params[0][0]
        table = torch.zeros(len(shared), size, dtype=ref.dtype, device=ref.device)
        mine = phy2log[block.first_slot : block.first_slot + block.local].tolist()
        for slot_params, e in zip(params, mine):
            if e in row_of:
                grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                         for p in slot_params]
                table[row_of[e]] += torch.cat(grads)
        if block.ep > 1:
            dist.all_reduce(table, group=block.ep_group)
        for slot_params, e in zip(params, mine):
            if e in row_of:
                offset = 0
                for p in slot_params:
                    p.grad = table[row_of[e], offset : offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
