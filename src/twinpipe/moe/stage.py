"""``MoEStage``: a pipeline stage of MoE blocks whose F&B ops overlap part by part."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from twinpipe.moe.block import MoEBlock
from twinpipe.overlap.stage import PartedStage

__all__ = ["MoEStage", "expert_counts"]


class MoEStage(PartedStage):
    """A stage made of ``blocks`` (MoE blocks) in order; its parts are theirs, named ``"i.part"``.

    All blocks of a stage must use the same expert-parallel group.
    """

    def __init__(self, blocks: Sequence[MoEBlock], overlap: bool = True):
        super().__init__()
        blocks = list(blocks)
        if not blocks or not all(isinstance(b, MoEBlock) for b in blocks):
            raise ValueError(f"blocks={blocks!r}: must be a non-empty sequence of MoEBlock")
        groups = {id(b.ep_group) for b in blocks}
        if len(groups) != 1:
            raise ValueError("blocks: all blocks of a stage must share one ep_group")
        self.blocks = nn.ModuleList(blocks)
        self.overlap = overlap

    def parts(self) -> list:
        out = []
        for i, block in enumerate(self.blocks):
            out += [type(p)(f"{i}.{p.name}", *_fields(p)) for p in block.parts()]
        return out

    def shard_experts_(self, ep_group) -> "MoEStage":
        for block in self.blocks:
            block.shard_experts_(ep_group)
        return self


def _fields(part) -> tuple:
    return (part.fn,) if part.kind == "compute" else (part.start, part.start_backward)


def expert_counts(module: nn.Module, reset: bool = True) -> dict[str, dict]:
    """Per MoE block of ``module``: token copies this rank routed to each expert and rows each
    local expert ran on, summed since the last reset (then reset, unless ``reset=False``)."""
    out = {}
    for name, block in module.named_modules():
        if isinstance(block, MoEBlock):
            out[name] = {"routed": block.routed_tokens.clone(), "expert_rows": block.expert_rows.clone(),
                         "first_expert": block.first_expert}
            if reset:
                block.reset_counts()
    return out
