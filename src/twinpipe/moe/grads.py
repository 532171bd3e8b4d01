"""Gradients of the parameters every expert-parallel rank holds a copy of."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.moe.agree import agree, all_reduce, ep_timeout, frame_device
from twinpipe.moe.exchange import ExpertExchange

__all__ = ["reduce_dense_grads", "reduce_replica_grads", "expert_parameters"]


def expert_parameters(module: nn.Module) -> set[int]:
    """``id()`` of every routed-expert parameter of ``module``'s MoE blocks (``MoEBlock``, and any
    other ``ExpertExchange`` such as ``twinpipe.hf.experts.EPMoE``): the parameters each
    EP rank holds its own share of (everything else is replicated over the EP group)."""
    return {id(p) for block in module.modules() if isinstance(block, ExpertExchange) for p in block.experts.parameters()}


def reduce_dense_grads(module: nn.Module, ep_group, timeout: float | None = None) -> None:
    """Sum over ``ep_group`` the gradients of ``module``'s parameters that are not routed experts.

    Across an expert-parallel group, attention, router, norms and shared experts are replicated
    and see different tokens (data parallel), so their gradients must be summed after backward;
    each routed expert lives on one rank and already holds its full gradient. Call on every rank
    of the group, after ``step()``. The ranks first compare what they would sum (ValueError on
    every rank if it differs); each wait lasts at most ``timeout`` s (default: the limit in force,
    see ``twinpipe.runtime.waits``, else ``twinpipe.checks.DEFAULT_TIMEOUT``).
    """
    timeout = ep_timeout(timeout)
    experts = expert_parameters(module)
    dense = [p for p in module.parameters() if id(p) not in experts and p.requires_grad]
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return
    # Checked on every call (one small all-gather): the module's parameters are the caller's to change.
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in dense})
    agree(ep_group, {"dense parameters": len(dense), "elements": sum(p.numel() for p in dense), "dtypes": dtypes},
          "reduce_dense_grads", timeout, frame_device(dense[0]) if dense else None)
    if not dense:
        return
    for p in dense:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in dense])
    all_reduce(flat, ep_group, timeout, "reduce_dense_grads")
    offset = 0
    for p in dense:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def reduce_replica_grads(module: nn.Module, timeout: float | None = None) -> None:
    """Sum the gradients of the replicas of each routed expert, over slots and EP ranks, and give
    every replica the sum: replicas then stay identical through any optimizer step.

    A replica's gradient covers only the token copies sent to it; the expert's gradient is the sum
    over its replicas, added on each rank in slot order, then over the EP ranks. For every MoE
    block with expert parallelism (``MoEBlock``, ``twinpipe.hf.experts.EPMoE``). Only replicated
    experts are exchanged (one all-reduce per block over its EP
    group); a missing gradient counts as zero. Call on every rank of the group after ``step()``
    (deferred weight gradients included), before the optimizer step. The ranks first compare
    their blocks (ValueError on every rank if they differ); each wait lasts at most ``timeout`` s
    (default: the limit in force, else ``twinpipe.checks.DEFAULT_TIMEOUT``).
    """
    timeout = ep_timeout(timeout)
    blocks = [b for b in module.modules() if isinstance(b, ExpertExchange)]
    _agree_blocks(blocks, timeout)
    for block in blocks:
        phy2log = block.phy2log
        counts = torch.bincount(phy2log, minlength=block.num_experts)
        shared = torch.nonzero(counts > 1).reshape(-1)
        if len(shared) == 0:
            continue
        row_of = {int(e): i for i, e in enumerate(shared)}
        mine = phy2log[block.first_slot : block.first_slot + block.local].tolist()
        # Each replicated slot's gradient tensors (made zero where missing), written in place below.
        grads = {i: block._slot_grads(i) for i, e in enumerate(mine) if e in row_of}
        ref = next(block.experts.parameters())
        # In the gradients' dtype (the FP32 main_grad of a bf16 parameter under mixed precision).
        main = getattr(ref, "main_grad", None)
        dtype = main.dtype if main is not None else ref.dtype
        table = torch.zeros(len(shared), block._slot_numel(), dtype=dtype, device=ref.device)
        for i, slot_grads in grads.items():
            table[row_of[mine[i]]] += torch.cat([g.reshape(-1) for g in slot_grads])
        if block.ep > 1:
            all_reduce(table, block.ep_group, timeout, "reduce_replica_grads")
        for i, slot_grads in grads.items():
            offset = 0
            for g in slot_grads:
                g.copy_(table[row_of[mine[i]], offset : offset + g.numel()].view_as(g))
                offset += g.numel()


def _agree_blocks(blocks: list[ExpertExchange], timeout: float) -> None:
    """One check per EP group, on every call: which experts are replicated (hence the all-reduces
    that follow and their sizes) comes from each rank's placements, which change between calls."""
    by_group: dict[int, list[ExpertExchange]] = {}
    for block in blocks:
        if block.ep > 1:
            by_group.setdefault(id(block.ep_group), []).append(block)
    for group_blocks in by_group.values():
        layouts = [b._layout() for b in group_blocks]
        facts = {"blocks": len(group_blocks)} | {k: [layout[k] for layout in layouts] for k in layouts[0]}
        agree(group_blocks[0].ep_group, facts, "reduce_replica_grads", timeout,
              frame_device(group_blocks[0].routed_tokens))
