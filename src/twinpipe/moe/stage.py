"""``MoEStage``: a pipeline stage of MoE blocks whose F&B ops overlap part by part."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from twinpipe.moe.block import MoEBlock
from twinpipe.moe.exchange import ExpertExchange
from twinpipe.overlap.stage import PartedSequential

__all__ = ["MoEStage", "expert_counts"]


class MoEStage(PartedSequential):
    """A stage made of ``blocks`` (MoE blocks) in order; its parts are theirs, named ``"i.part"``.

    All blocks of a stage must use the same expert-parallel group. To put other layers around
    them (an embedding, a head), use ``twinpipe.overlap.PartedSequential`` directly.
    """

    def __init__(self, blocks: Sequence[MoEBlock], overlap: bool = True):
        blocks = list(blocks)
        if not blocks or not all(isinstance(b, MoEBlock) for b in blocks):
            raise ValueError(f"blocks={blocks!r}: must be a non-empty sequence of MoEBlock")
        if len({id(b.ep_group) for b in blocks}) != 1:
            raise ValueError("blocks: all blocks of a stage must share one ep_group")
        super().__init__(blocks, overlap)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def shard_experts_(self, ep_group, phy2log=None) -> "MoEStage":
        """``MoEBlock.shard_experts_`` on every block (same placement for all)."""
        for block in self.blocks:
            block.shard_experts_(ep_group, phy2log)
        return self


def expert_counts(module: nn.Module, reset: bool = True) -> dict[str, dict]:
    """Per MoE block of ``module`` (``MoEBlock``, or a ``transformers`` block sharded by
    ``twinpipe.hf.experts.shard_experts_``): token copies this rank routed to each logical expert and rows
    each local slot ran on, summed since the last reset (then reset, unless ``reset=False``)."""
    out = {}
    for name, block in module.named_modules():
        if isinstance(block, ExpertExchange):
            out[name] = {"routed": block.routed_tokens.clone(), "expert_rows": block.expert_rows.clone(),
                         "first_slot": block.first_slot}
            if reset:
                block.reset_counts()
    return out
