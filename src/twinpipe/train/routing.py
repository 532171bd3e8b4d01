"""Routing balance in training: DeepSeek-V3's routing biases moved against the step's summed loads.

Every router this rank holds (``StageSource.routers``) adds its token counts to the step's vector of
loads, one slot per expert of every router of the whole model (``StageSource.routing_biases``), so
that after the step's all-reduce every copy and replica of a router sees the same sums and moves its
bias alike (``twinpipe.moe.bias.update_bias_``). A bias is owned, as a dense parameter is, by
data-parallel rank 0's first copy: checkpoints write it there.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from twinpipe.checks import bad
from twinpipe.moe.bias import update_bias_
from twinpipe.train.stage_source import StageSource
from twinpipe.train.step_vector import few

__all__ = ["RoutingBalance"]


def _slices(every: Sequence[tuple[str, int]], held: Sequence[str]) -> tuple[list[tuple[int, int]], int]:
    """Where each of the ``held`` routers' loads sit in the vector of ``every`` router's ``(name,
    experts)``, in order, and the vector's length."""
    where, offset = {}, 0
    for name, experts in every:
        where[name] = (offset, offset + experts)
        offset += experts
    missing = [name for name in held if name not in where]
    if missing:
        raise ValueError(f"routing bias {missing[0]!r} of this rank's stages is not among the model's "
                         f"({few([n for n, _ in every]) or 'none'}): the stages and the model disagree")
    return [where[name] for name in held], offset


class RoutingBalance:
    """The routers of this rank's stage ``modules`` and their places in the model's vector of loads
    (``size`` entries); ``owns[i]``: whether module i's biases are this rank's to save (data-parallel
    rank 0's first copy); ``gamma``: ``bias_update_speed``."""

    def __init__(self, source: StageSource, model: nn.Module, modules: Sequence[nn.Module], owns: Sequence[bool],
                 gamma: float):
        held = [(owned, *slot) for owned, m in zip(owns, modules, strict=True) for slot in source.routers(m)]
        self.gamma = gamma
        self._slots = [(name, router, owned) for owned, name, _, router in held]
        self.routers = [router for *_, router in held]
        self._places, self.size = _slices(list(source.routing_biases(model)), [key for _, _, key, _ in held])
        if gamma and not self.size:
            raise bad("bias_update_speed", gamma, f"must be 0 for {source.without_routers(model)}: nothing to balance")

    @property
    def buffers(self) -> list[tuple[str, torch.Tensor, bool]]:
        """``(name, bias, owned)`` of the routing biases held, read from the routers each time (a
        dtype cast replaces a module's buffers)."""
        return [(name, router.bias, owned) for name, router, owned in self._slots]

    @property
    def vector_size(self) -> int:
        """Entries of loads in the step's vector: the model's experts with balancing, else none."""
        return self.size if self.gamma else 0

    def add_loads(self, loads: torch.Tensor) -> None:
        """This rank's token copies per expert into ``loads`` (the step's vector; exact float64 counts)."""
        for router, (start, end) in zip(self.routers, self._places):
            loads[start:end] += router.loads.to(torch.float64)

    def move_biases(self, loads: torch.Tensor) -> None:
        """Every held router's bias moved against its summed loads (the same on every copy and replica)."""
        if self.gamma:
            for router, (start, end) in zip(self.routers, self._places):
                update_bias_(router.bias, loads[start:end], self.gamma)

    def zero_loads(self) -> None:
        """A step counts its own tokens only."""
        for router in self.routers:
            router.loads.zero_()
