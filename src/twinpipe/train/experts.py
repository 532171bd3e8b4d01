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

from torch import nn

from twinpipe.checks import bad
from twinpipe.moe.block import MoEBlock
from twinpipe.moe.grads import expert_parameters

__all__ = ["check_experts", "shard_experts", "expert_ids"]


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
