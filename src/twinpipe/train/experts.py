"""Expert parallelism in training: the experts of a stage's MoE blocks spread over its data-parallel ranks.

The EP group of a pipeline stage is the stage's data-parallel group (as in DeepSeek-V3): the ``dp``
ranks that run the same stage on different rows also hold different experts, and the MoE
all-to-all carries each replica's tokens to the experts' owners. Layout: with ``E`` experts per
block, data-parallel rank ``d`` holds experts ``d*E/dp .. (d+1)*E/dp - 1`` of every MoE block of
its stages (``MoEBlock.shard_experts_``: one slot per expert, no replicas), so ``dp`` must divide
``E``. DualPipe's mirrored copy of a stage lives on rank ``(d, P-1-r)`` and holds the same experts
as ``(d, r)``, so the mirrored exchange pairs the same parameters.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from twinpipe.checks import bad
from twinpipe.moe.block import MoEBlock
from twinpipe.moe.grads import expert_parameters

__all__ = ["check_experts", "shard_experts", "expert_ids"]


def check_experts(model: nn.Module, dp: int) -> int:
    """The number of experts per MoE block of ``model`` (0 for a dense model), or ValueError when
    the model cannot be laid out over ``dp`` data-parallel (= expert-parallel) ranks."""
    blocks = [(name, b) for name, b in model.named_modules() if isinstance(b, MoEBlock)]
    for name, block in blocks:
        if block.ep != 1 or len(block.experts) != block.num_experts or block.num_slots != block.num_experts:
            raise ValueError(f"model: MoE block {name!r} is already sharded ({len(block.experts)} of "
                             f"{block.num_experts} experts here); model_fn must build every block with all experts "
                             "local (ep_group=None): the trainer spreads them over the data-parallel ranks")
    counts = sorted({b.num_experts for _, b in blocks})
    for experts in counts:
        if experts % dp:
            divisors = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
            raise bad("dp", dp, f"must divide {experts} (allowed are {divisors}): the model's MoE blocks have {experts} "
                      "experts, and expert parallelism spreads them evenly over the dp ranks of a stage")
    return counts[-1] if counts else 0


def shard_experts(modules: Sequence[nn.Module], dp_group) -> None:
    """Keep this rank's experts in every MoE block of ``modules`` (no-op without blocks)."""
    for module in modules:
        for block in module.modules():
            if isinstance(block, MoEBlock):
                block.shard_experts_(dp_group)


def expert_ids(modules: Sequence[nn.Module]) -> set[int]:
    """``id()`` of every routed-expert parameter held in ``modules``."""
    return set().union(*(expert_parameters(m) for m in modules))
