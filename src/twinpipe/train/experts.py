"""Expert parallelism in training: the experts of a stage's MoE blocks spread over an EP group of its
data-parallel ranks.

The EP groups of a pipeline stage are ``dp/ep`` groups of ``ep`` consecutive data-parallel ranks
(``mesh.TrainMesh.expert_groups``; by default ``ep = dp``, one group, as in DeepSeek-V3): the ranks
of a group run the same stage on different rows and hold different experts, and the MoE all-to-all
carries each replica's tokens to the experts' owners in its group. Layout: with ``E`` experts per
block, EP rank ``e`` holds experts ``e*E/ep .. (e+1)*E/ep - 1`` of every MoE block of its stages
(``MoEBlock.shard_experts_``: one slot per expert), so ``ep`` must divide ``E``; the same rank of
every EP group holds the same experts, their gradients summed over the expert-data-parallel group
(``ownership.py``). DualPipe's mirrored copy of a stage lives on rank ``(d, P-1-r)`` and holds the
same experts as ``(d, r)``, so the mirrored exchange pairs the same parameters.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from twinpipe.checks import bad
from twinpipe.moe.block import MoEBlock
from twinpipe.moe.exchange import ExpertExchange
from twinpipe.moe.grads import expert_parameters
from twinpipe.moe.move import regroup_rows

__all__ = ["check_experts", "shard_experts", "expert_ids", "initial_placement", "PlacedRows"]


def check_experts(model: nn.Module, ep: int, name: str = "ep") -> int:
    """The number of experts per MoE block of ``model`` (0 for a dense model), or ValueError naming
    ``name`` (``ep``, or ``dp`` where the expert-parallel size defaults to it) when the model cannot be
    laid out over ``ep`` expert-parallel ranks."""
    blocks = [(where, b) for where, b in model.named_modules() if isinstance(b, MoEBlock)]
    for where, block in blocks:
        if block.ep != 1 or len(block.experts) != block.num_experts or block.num_slots != block.num_experts:
            raise ValueError(f"model: MoE block {where!r} is already sharded ({len(block.experts)} of "
                             f"{block.num_experts} experts here); model_fn must build every block with all experts "
                             "local (ep_group=None): the trainer spreads them over the expert-parallel ranks")
    counts = sorted({b.num_experts for _, b in blocks})
    for experts in counts:
        if experts % ep:
            divisors = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
            raise bad(name, ep, f"must divide {experts} (allowed are {divisors}): the model's MoE blocks have {experts} "
                      f"experts, and expert parallelism spreads them evenly over the {name} ranks of a stage")
    return counts[-1] if counts else 0


def shard_experts(modules: Sequence[nn.Module], ep_group) -> None:
    """Keep this rank's experts (of its EP group ``ep_group``) in every MoE block of ``modules`` (no-op
    without blocks)."""
    for module in modules:
        for block in module.modules():
            if isinstance(block, MoEBlock):
                block.shard_experts_(ep_group)


def expert_ids(modules: Sequence[nn.Module]) -> set[int]:
    """``id()`` of every routed-expert parameter held in ``modules``."""
    return set().union(*(expert_parameters(m) for m in modules))


def check_row_group(row_group, groups) -> None:
    """A stage source's group for the rows of its expert tensors (None: not sharded) must be the
    mesh's EP group (``TrainMesh.expert_groups``): checkpoints store those rows sharded over it."""
    import torch.distributed as dist

    if row_group is None:
        return
    mine = dist.get_process_group_ranks(row_group)
    if groups.ep_group is None or mine != dist.get_process_group_ranks(groups.ep_group):
        expected = dist.get_process_group_ranks(groups.ep_group) if groups.ep_group is not None else "None"
        raise bad("stages.ep_group", mine, f"must be the mesh's EP group for ep={groups.ep} ({expected}: "
                  "mesh.expert_groups(ep).ep_group; the rows of each expert tensor are stored sharded over it)")


def initial_placement(num_experts: int, redundant: int) -> torch.Tensor:
    """A run's first placement with ``redundant`` extra slots: every expert once, in id order, then one
    replica each of experts 0, 1, ... (EPLB re-places them from the loads it measures)."""
    return torch.cat([torch.arange(num_experts), torch.arange(redundant) % num_experts])


class PlacedRows:
    """The fused expert tensors of this rank's sharded MoE blocks (``twinpipe.hf.experts.EPMoE``: one
    row per local slot), seen by logical expert: checkpoints store one row per expert, by expert id,
    whatever the placement (``to_experts``/``to_slots``, collective over the block's EP group when the
    placement is not one slot per expert in id order), and the gradient norm counts one replica of
    each expert (``counted``)."""

    def __init__(self, modules: Sequence[nn.Module], timeout: float):
        self.timeout = timeout
        self.blocks = {id(p): b for m in modules for b in m.modules() if isinstance(b, ExpertExchange)
                       for p in b.experts.parameters() if p.dim() and p.shape[0] == b.local}

    def placed(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s rows are not expert ``ep_rank * E/ep + i`` in row i (replicas, or moved)."""
        block = self.blocks.get(id(p))
        return block is not None and not torch.equal(block.phy2log, torch.arange(block.num_experts))

    def phy2log(self, p: torch.Tensor) -> list[int]:
        """The placement of ``p``'s block: the logical expert of every slot."""
        return self.blocks[id(p)].phy2log.tolist()

    def by_expert(self, p: torch.Tensor, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor for this EP rank's ``E/ep`` rows of ``p`` by expert id (``like``'s row shape and device)."""
        block = self.blocks[id(p)]
        return torch.empty((block.num_experts // block.ep, *like.shape[1:]), dtype=dtype, device=like.device)

    def to_experts(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``t`` (``p``'s rows, or a master or state tensor of its shape) as this EP rank's ``E/ep`` rows by expert id."""
        block = self.blocks[id(p)]
        return regroup_rows(t, block.phy2log, torch.arange(block.num_experts), block.ep_group, self.timeout)

    def to_slots(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The inverse: this EP rank's rows by expert id -> ``p``'s rows in slot order (replicas filled)."""
        block = self.blocks[id(p)]
        return regroup_rows(t, torch.arange(block.num_experts), block.phy2log, block.ep_group, self.timeout)

    def counted(self) -> dict[int, torch.Tensor]:
        """``id(p)`` -> the rows of ``p`` to count in the gradient norm (each expert's lowest slot), for
        the parameters of blocks with replicas (after ``reduce_replica_grads`` every replica holds the sum)."""
        rows = {}
        for pid, block in self.blocks.items():
            phy2log = block.phy2log
            if len(phy2log) == block.num_experts:
                continue
            first = {}
            for slot, expert in enumerate(phy2log.tolist()):
                first.setdefault(expert, slot)
            lowest = set(first.values())
            rows[pid] = torch.tensor([i for i in range(block.local) if block.first_slot + i in lowest], dtype=torch.long)
        return rows
