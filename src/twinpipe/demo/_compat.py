"""``twinpipe.demo.Block(hidden, heads)``: the name the demo's own block had; now the trainer's block."""

from __future__ import annotations

from twinpipe.train.model import Block as _TrainerBlock
from twinpipe.train.model import GPTConfig

__all__ = ["Block"]


class Block(_TrainerBlock):
    """Pre-norm transformer block of width ``hidden`` with ``heads`` heads (``twinpipe.train.model.Block``)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__(GPTConfig(dim=hidden, heads=heads))
