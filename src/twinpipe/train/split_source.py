"""``SplitStages``: the ``StageSource`` of a model of one-tensor layers (``twinpipe.train.model.GPT``,
an ``nn.Sequential``), cut by ``stages.split`` (``TrainConfig.balance``)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.checks import bad
from twinpipe.moe.router import TopKRouter
from twinpipe.runtime.collectives import collective
from twinpipe.runtime.weight_grad import defer_weight_grads
from twinpipe.train.mtp import mtp_heads
from twinpipe.train.stage_source import RouterSlot
from twinpipe.train.stages import Stage, model_layers, split, stage_modules

__all__ = ["SplitStages", "model_parameter_names", "model_routers", "model_tied_copies"]


def model_parameter_names(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """Every parameter of a splittable model, by name in the unsplit model, in run order."""
    return [(f"{name}.{sub}", p.shape) for name, layer in model_layers(model) for sub, p in layer.named_parameters()]


def model_routers(model: nn.Module) -> list[tuple[str, TopKRouter]]:
    """``(name in the unsplit model, router)`` of every ``TopKRouter`` of a splittable model, in run order."""
    return [(f"{name}.{sub}" if sub else name, m) for name, layer in model_layers(model)
            for sub, m in layer.named_modules() if isinstance(m, TopKRouter)]


def model_tied_copies(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """``(main, copy)`` names of a splittable model's tied weights: what it declares as ``tied_copies``
    (GPT: its MTP head's embedding copy), else none (an ``nn.Sequential``)."""
    return tuple(getattr(model, "tied_copies", ()))


class SplitStages:
    """Cuts a splittable model by ``balance`` (``"params"``, ``"time"``: global rank 0 measures on
    ``sample()``, a micro-batch of inputs, and tells every rank; or layer counts). ``stage_names``:
    the layers of each model stage, once built."""

    initial_biases_kept = False  # routing biases a checkpoint lacks were never moved: zeroed on load

    def __init__(self, balance: str | Sequence[int], sample: Callable[[], torch.Tensor], timeout: float, where: Callable[[str], str]):
        self.balance, self.sample, self.timeout, self.where = balance, sample, timeout, where
        self.stage_names: list[tuple[str, ...]] | None = None

    def parameter_names(self, model: nn.Module) -> list:
        return model_parameter_names(model)

    def build(self, model: nn.Module, schedule, pp_rank: int) -> list[nn.Module]:
        cut = split(model, schedule.placement.num_model_stages, self._layer_counts(model, schedule.placement.num_model_stages))
        self.stage_names = [s.names for s in cut]
        return [defer_weight_grads(m) for m in stage_modules(cut, schedule, schedule.num_ranks, pp_rank)]

    def _layer_counts(self, model: nn.Module, n: int) -> str | Sequence[int]:
        """How to cut the model; with ``balance="time"``, global rank 0's measurement, for every rank."""
        if self.balance != "time":
            return self.balance
        device = next(model.parameters()).device
        counts = torch.zeros(n, dtype=torch.long, device=device)
        if dist.get_rank() == 0:  # one measurement, sent to every rank
            sample = self.sample().to(device)
            counts = torch.tensor([len(s.names) for s in split(model, n, "time", sample=sample)], device=device)
        collective(dist.broadcast, counts, src=0, group=None, timeout=self.timeout,
                   what=self.where("agreeing on the time-balanced split"))
        return counts.cpu().tolist()

    def batch(self, layout, x, y) -> tuple:
        return (layout.inputs(x), layout.labels(y))

    def sync_mirrored_grads(self, pipe) -> None:
        pipe.sync_mirrored_grads()  # a no-op without mirrored copies

    def tied_copies(self, model: nn.Module) -> tuple:
        return model_tied_copies(model)

    def mtp_modules(self, model: nn.Module) -> int:
        return sum(len(h.mtp) for h in mtp_heads([model]))

    def row_shards(self, modules: Sequence[nn.Module]) -> set[int]:
        return set()

    def row_group(self):
        return None

    def routing_biases(self, model: nn.Module) -> list[tuple[str, int]]:
        return [(name, router.num_experts) for name, router in model_routers(model)]

    def routers(self, module: nn.Module) -> list[RouterSlot]:
        if not isinstance(module, Stage):
            return []
        return [(f"{name}.{sub}.bias" if sub else f"{name}.bias", f"{name}.{sub}" if sub else name, m)
                for name, layer in zip(module.names, module.layers)
                for sub, m in layer.named_modules() if isinstance(m, TopKRouter)]

    def without_routers(self, model: nn.Module) -> str:
        return "a model without MoE routers"

    def add_balance_loss(self, model: nn.Module, modules: Sequence[nn.Module], alpha: float, routed: bool) -> None:
        raise bad("balance_alpha", alpha, "must be 0 for a model cut by split: a twinpipe.moe router takes its own "
                  "(TopKRouter(balance_alpha=...), GPTConfig.balance_alpha)")
