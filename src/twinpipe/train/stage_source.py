"""``StageSource``: what the trainer needs of a model cut into pipeline stages, declared once.

Two sources provide it: ``split_source.SplitStages`` (a model of one-tensor layers such as
``twinpipe.train.model.GPT``, cut by ``stages.split``) and ``twinpipe.hf.HFSource`` (a
``transformers`` causal LM). The trainer calls these methods and nothing else of its stages.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from torch import nn

__all__ = ["StageSource", "RouterSlot", "check_source"]

# (buffer name in checkpoints, name in the vector of loads, router with ``loads`` and ``bias``)
RouterSlot = tuple[str, str, object]


@runtime_checkable
class StageSource(Protocol):
    # Routing biases a checkpoint lacks keep their values (read from a model folder), else are zeroed.
    initial_biases_kept: bool

    def parameter_names(self, model: nn.Module) -> list[tuple[str, Sequence[int]]]:
        """``(name, shape)`` of every parameter of the unsplit model, in run order."""

    def build(self, model: nn.Module, schedule, pp_rank: int) -> list[nn.Module]:
        """This rank's stage modules in ``Pipeline`` order, each with ``named_model_parameters()``
        (names of the unsplit model), weight gradients deferred."""

    def batch(self, layout, x, y) -> tuple:
        """``(inputs, labels)`` of ``Pipeline.step`` from this replica's rows and the rank's ``batch_layout``."""

    def sync_mirrored_grads(self, pipe) -> None:
        """After the pipeline step: every copy of a parameter gets the same sum (mirrored copies)."""

    def tied_copies(self, model: nn.Module) -> tuple[tuple[str, str], ...]:
        """``(main name, copy name)`` pairs of tied weights: summed by the trainer, counted once."""

    def mtp_modules(self, model: nn.Module) -> int:
        """How many multi-token-prediction modules the model holds."""

    def row_shards(self, modules: Sequence[nn.Module]) -> set[int]:
        """``id()`` of the parameters holding this data-parallel rank's rows of a model tensor."""

    def row_group(self):
        """The process group ``row_shards`` are sharded over (None: none)."""

    def routing_biases(self, model: nn.Module) -> list[tuple[str, int]]:
        """``(name, experts)`` of every router of the unsplit model, in order: the vector of loads."""

    def routers(self, module: nn.Module) -> list[RouterSlot]:
        """The routers of one built stage module, in order."""

    def without_routers(self, model: nn.Module) -> str:
        """What a model without routers is called in errors ("a model without MoE routers")."""

    def add_balance_loss(self, model: nn.Module, modules: Sequence[nn.Module], alpha: float, routed: bool) -> None:
        """Add the sequence-wise balance loss of weight ``alpha`` to ``modules`` (``routed``: the model
        has routers), or raise naming ``balance_alpha`` where the source cannot."""


def check_source(stages) -> None:
    """ValueError naming ``stages`` and what it lacks, unless it provides every ``StageSource`` member."""
    if not isinstance(stages, StageSource):
        members = sorted(n for n in vars(StageSource) if not n.startswith("_")) + ["initial_biases_kept"]
        missing = [n for n in members if n not in dir(stages)]
        raise ValueError(f"stages={type(stages).__name__}: must be a twinpipe.train.StageSource such as twinpipe.hf.HFSource "
                         f"(it lacks {', '.join(missing)})")
