"""Gradients of the parameters every expert-parallel rank holds a copy of."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.moe.block import MoEBlock

__all__ = ["reduce_dense_grads"]


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
