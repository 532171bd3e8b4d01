"""What a checkpoint saves and loads of a trainer: one declared object (``Trainer.checkpoint_view()``).

``save_checkpoint`` and ``load_checkpoint`` read this view and nothing else of the trainer, so the
trainer's insides can change without the checkpoint format changing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["CheckpointView"]


@dataclass(frozen=True, kw_only=True)
class CheckpointView:
    """A trainer as its checkpoints see it.

    ``held``: ``(model parameter name, parameter, owned)`` of every parameter this rank holds (an
    owned one is written by this rank); ``buffers``: the same for routing biases; ``tied``: ``(main
    name, copy name)`` pairs, the copy stored under the main's keys; ``row_shards``: ``id()`` of the
    parameters holding this data-parallel rank's rows of a model tensor, stored sharded over
    ``row_mesh``; ``optimized_tensor(p)``: the tensor the optimizer updates for ``p`` (its master),
    or None; ``finish_update()`` awaits pending all-gathers (ZeRO-1); ``loaded_weights()`` refreshes
    the compute weights after a load; ``zero_unsaved_buffers``: routing biases a checkpoint lacks are
    zeroed (the built-in models: nothing moved them then), else kept (a transformers model's folder values)."""

    rank_name: str  # "rank dp=.. pp=..", the prefix of every message
    group: object  # the gloo group over the world that saves and loads run on
    timeout: float
    parameter_names: Sequence[tuple[str, Sequence[int]]]
    model_record: dict
    written_by: dict  # schedule, dp, pp, precision, zero: what the marker records of the writing run
    optimizer: torch.optim.Optimizer
    held: Sequence[tuple[str, torch.Tensor, bool]]
    buffers: Sequence[tuple[str, torch.Tensor, bool]]
    tied: Sequence[tuple[str, str]]
    row_shards: frozenset = frozenset()
    row_mesh: object = None
    placed: object = None  # experts.PlacedRows: row_shards by logical expert, whatever the placement (EPLB)
    zero_unsaved_buffers: bool = True
    optimized_tensor: Callable[[torch.Tensor], torch.Tensor | None]
    finish_update: Callable[[], None]
    loaded_weights: Callable[[], None]

    def where(self, what: str) -> str:
        return f"{self.rank_name}: {what}"

    def stored_name(self) -> dict[str, str]:
        """Copy name -> main name of the tied pairs: the copy always equals its main parameter, so a
        checkpoint stores the weight and its optimizer state once, under the main name."""
        return {copy: main for main, copy in self.tied}
