"""Split a model into pipeline stages, and give each rank the stage modules it holds.

A splittable model is a sequence of layers, each taking and returning one tensor: an
``nn.Sequential``, or a module whose children run in registration order with one
``nn.ModuleList`` of blocks among them (an embedding before it, a head after it, as in
``twinpipe.train.model.GPT``). Stages keep the model's own parameter names, so checkpoints are
stored by those names and load under any split; a MoE block's expert slot is named after the
expert it runs, so an expert keeps its name on whichever expert-parallel rank holds it.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from twinpipe.checks import bad, check_int, check_ints
from twinpipe.moe.block import MoEBlock
from twinpipe.overlap import stage as overlap_stage
from twinpipe.schedule.placement import Placement
from twinpipe.schedule.spec import ScheduleSpec, resolve
from twinpipe.train.balance import param_weights, partition, time_weights

__all__ = ["Stage", "PartedStage", "model_layers", "split", "is_mirror_copy", "stage_modules"]

BALANCE = ("params", "time")


class Stage(nn.Module):
    """A contiguous run of a model's layers; ``names`` are the layers' names in the model."""

    def __init__(self, names: Sequence[str], layers: Sequence[nn.Module]):
        super().__init__()
        self.names = tuple(names)
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def named_model_parameters(self):
        """``(name in the unsplit model, parameter)`` pairs, in model order."""
        for name, layer in zip(self.names, self.layers):
            for sub, p in _layer_parameters(layer):
                yield f"{name}.{sub}", p

    def extra_repr(self) -> str:
        return f"layers {self.names[0]}..{self.names[-1]}" if len(self.names) > 1 else f"layer {self.names[0]}"


class PartedStage(Stage, overlap_stage.PartedStage):
    """A stage with MoE blocks (layers that declare ``parts()``, ``twinpipe.overlap``): in F&B ops
    (DualPipe, DualPipeV) one micro-batch's forward parts run interleaved with another's backward
    parts, so each all-to-all of one runs while the other computes. Results are those of ``Stage``."""

    def __init__(self, names: Sequence[str], layers: Sequence[nn.Module]):
        super().__init__(names, layers)
        self.overlap = True

    parts = overlap_stage.PartedSequential.parts  # the layers' parts in order; other layers one part each
    forward = overlap_stage.PartedStage.forward


def _layer_parameters(layer: nn.Module):
    """``layer.named_parameters()``, with each MoE expert slot named after its logical expert
    (``experts.<slot>.`` -> ``experts.<expert>.``): the name the expert has in the unsplit model."""
    renames = {}
    for prefix, block in layer.named_modules():
        if isinstance(block, MoEBlock):
            head = f"{prefix}." if prefix else ""
            phy2log = block.phy2log
            for slot in range(len(block.experts)):
                renames[f"{head}experts.{slot}."] = f"{head}experts.{int(phy2log[block.first_slot + slot])}."
    for sub, p in layer.named_parameters():
        for old, new in renames.items():
            if sub.startswith(old):
                sub = new + sub[len(old):]
                break
        yield sub, p


def model_layers(model: nn.Module, blocks: str | None = None) -> list[tuple[str, nn.Module]]:
    """The model's layers in run order, with their names (``blocks`` names the block list)."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__}: must be an nn.Module (an nn.Sequential or a model with a block list)")
    children = list(model.named_children())
    lists = [name for name, child in children if isinstance(child, nn.ModuleList)]
    if blocks is None:
        if len(lists) != 1:
            raise ValueError(
                f"model={type(model).__name__}: has {len(lists)} nn.ModuleList children ({', '.join(lists) or 'none'}); "
                "it must be an nn.Sequential or have exactly one block list (else name it with blocks=)"
            )
        blocks = lists[0]
    elif blocks not in lists:
        raise ValueError(f"blocks={blocks!r}: {type(model).__name__} has no nn.ModuleList child of that name; it has {lists}")
    layers = []
    for name, child in children:
        if name == blocks:
            layers += [(f"{name}.{i}", block) for i, block in enumerate(child)]
        else:
            layers.append((name, child))
    return layers


def split(model: nn.Module, num_stages: int, balance: str | Sequence[int] = "params", *, sample: torch.Tensor | None = None,
          blocks: str | None = None) -> list[Stage]:
    """Cut ``model`` into ``num_stages`` contiguous stages (sharing its parameters): ``Stage``s, or
    ``PartedStage``s when a layer declares parts (MoE blocks), for the F&B overlap.

    ``balance``: ``"params"`` (equal parameter counts, as far as whole layers allow), ``"time"``
    (equal measured forward+backward time on ``sample``, the model's input) or a list of layer
    counts per stage.
    """
    check_int(num_stages, "num_stages", low=1)
    layers = model_layers(model, blocks)
    names = [n for n, _ in layers]
    if len(layers) < num_stages:
        raise bad("num_stages", num_stages, f"must be <= {len(layers)}: the model has only {len(layers)} layers "
                  f"({', '.join(names)}), and a stage needs at least one; use fewer stages or a model with more blocks")
    if isinstance(balance, str):
        if balance == "params":
            counts = partition(param_weights([m for _, m in layers]), num_stages)
        elif balance == "time":
            if not isinstance(sample, torch.Tensor):
                raise ValueError("balance='time' measures each layer: pass sample= (one input batch of the model)")
            counts = partition(time_weights([m for _, m in layers], sample), num_stages)
        else:
            raise bad("balance", balance, f"allowed are {', '.join(map(repr, BALANCE))} or a list of layer counts per stage")
    else:
        counts = list(check_ints(balance, "balance", low=1, length=num_stages, why="layer counts per stage"))
        if sum(counts) != len(layers):
            raise bad("balance", balance, f"must sum to the model's {len(layers)} layers (layer counts per stage)")
    # One stage class for the whole model (the pipeline overlaps F&B ops only when a rank's stages agree).
    kind = PartedStage if any(hasattr(m, "parts") for _, m in layers) else Stage
    stages, start = [], 0
    for count in counts:
        chunk = layers[start : start + count]
        stages.append(kind([n for n, _ in chunk], [m for _, m in chunk]))
        start += count
    return stages


def is_mirror_copy(placement: Placement, stage: int) -> bool:
    """True for a stage of a second (third, ...) copy of the model: left out of norms and checkpoints."""
    return placement.chain_of_stage(stage) > 0


def stage_modules(stages: Sequence[nn.Module], schedule: str | ScheduleSpec, num_ranks: int, rank: int, **options) -> list[nn.Module]:
    """The modules pipeline ``rank`` passes to ``Pipeline`` under ``schedule``, in its local order.

    ``schedule`` is a registered name with its ``options``, or anything ``twinpipe.schedule.resolve``
    takes (a ``ScheduleSpec``: resolved once, passed on). ``stages`` is the split model
    (``split(model, placement.num_model_stages)``); see
    ``twinpipe.stages_of_rank`` for the stage numbers. A rank holding two copies of one model stage
    gets a deep copy for the second, so the copies never share parameters or gradients.
    """
    spec = resolve(schedule, num_ranks, **options)
    placement = spec.placement
    needed = placement.num_model_stages
    if len(stages) != needed:
        raise ValueError(
            f"stages: {len(stages)} given, but {spec.name!r} on {num_ranks} ranks runs a model cut into {needed} stages"
        )
    check_int(rank, "rank", low=0, high=num_ranks - 1)
    modules, used = [], set()
    for s in placement.stages_of(rank):
        k = placement.model_stage(s)
        modules.append(copy.deepcopy(stages[k]) if k in used else stages[k])
        used.add(k)
    return modules
