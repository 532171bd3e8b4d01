"""Tied weights in training: each ``(main, copy)`` pair (an MTP head's embedding copy, a transformers
model's tied head) kept equal by giving both the same gradient, before the data-parallel reduction."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from twinpipe.runtime.main_grad import grad_of
from twinpipe.schedule.placement import Placement
from twinpipe.train.grads import sum_across
from twinpipe.train.stages import is_mirror_copy

__all__ = ["TiedPairs"]


class TiedPairs:
    """The tied ``pairs`` of ``model`` (its shapes and dtypes kept, the model itself not)."""

    def __init__(self, pairs: Sequence[tuple[str, str]], model: nn.Module):
        self.pairs = tuple(pairs)
        mains = dict(self.pairs)
        self._like = {main: (p.shape, p.dtype) for main, p in model.named_parameters() if main in mains}

    def sum_grads(self, modules: Sequence[nn.Module], stages: Sequence[int], placement: Placement, *, group,
                  timeout: float, where: str, device) -> None:
        """Each pair (main, copy): every copy of both gets ``main's gradient + copy's gradient`` of
        this replica, before the data-parallel reduction (which then gives both the same sum).

        After the mirrored sum every copy of a parameter holds this replica's gradient (``grad_of``:
        the FP32 ``main_grad`` under mixed precision); the rank holding a parameter's first copy puts
        it into a [2, ...] buffer, summed over the pipeline ``group`` (each slot has one non-zero
        contribution: exact), and every holder adds the two slots. ``modules``: this rank's stage
        modules, pipeline stages ``stages``; ``where``: rank and step, for the wait's message."""
        held = {}
        for stage, module in zip(stages, modules):
            for name, p in module.named_model_parameters():
                held.setdefault(name, []).append((p, not is_mirror_copy(placement, stage)))
        for main, copy in self.pairs:
            shape, dtype = self._like[main]
            both = torch.zeros(2, *shape, dtype=dtype, device=device)
            added = set()  # one tensor held under both names (shared) already holds both gradients: added once
            for slot, name in enumerate((main, copy)):
                for p, first in held.get(name, ()):
                    if first and grad_of(p) is not None and id(p) not in added:
                        both[slot] += grad_of(p)
                        added.add(id(p))
            sum_across(both, group, timeout, f"{where}: summing {main} and its copy {copy}")
            total = both[0] + both[1]
            for name in (main, copy):
                for p, _ in held.get(name, ()):
                    if getattr(p, "main_grad", None) is not None:
                        p.main_grad.copy_(total)  # the buffer stays (a master's .grad is the same tensor)
                    else:
                        p.grad = total.clone()
