"""Measured expert loads: token copies per logical expert of every MoE block, summed over the EP
group, per step and over a sliding window of steps."""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from twinpipe.checks import check_int
from twinpipe.moe.agree import agree, all_reduce, ep_timeout, frame_device
from twinpipe.moe.exchange import ExpertExchange

__all__ = ["ExpertLoads", "moe_blocks"]


def moe_blocks(model) -> list[tuple[str, ExpertExchange]]:
    """``(name, block)`` of every MoE block of ``model`` (``MoEBlock``, or a ``transformers`` block
    sharded by ``twinpipe.hf.experts.shard_experts_``) (a module or a sequence of modules, e.g.
    a rank's pipeline stages, named ``"i.name"`` then); ValueError when there is none."""
    modules = [("", model)] if isinstance(model, nn.Module) else [(f"{i}.", m) for i, m in enumerate(model)]
    found = []
    for prefix, module in modules:
        if not isinstance(module, nn.Module):
            raise ValueError(f"model holds a {type(module).__name__}: must be a module or a sequence of modules")
        found += [(prefix + name, b) for name, b in module.named_modules() if isinstance(b, ExpertExchange)]
    if not found:
        raise ValueError(f"model ({type(model).__name__}) has no MoEBlock (nor a transformers MoE block "
                         "sharded by twinpipe.hf.experts.shard_experts_): nothing to measure or balance")
    return found


class ExpertLoads:
    """Per-step loads of every MoE block of ``model``: ``record()`` after each step takes the
    blocks' routed-token counters (and resets them), sums them over each block's EP group and
    keeps the last ``window`` steps. Call ``record()`` on every rank of the EP groups; each wait
    lasts at most ``timeout`` s (default: the limit in force where it is made, see
    ``twinpipe.runtime.waits``, else ``twinpipe.checks.DEFAULT_TIMEOUT``)."""

    def __init__(self, model, window: int = 100, timeout: float | None = None):
        check_int(window, "window", low=1, why="steps")
        self.timeout = ep_timeout(timeout)
        self.blocks = moe_blocks(model)
        self.window = window
        self._steps: deque = deque(maxlen=window)
        self._agreed = False

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.blocks]

    def record(self) -> list[torch.Tensor]:
        """This step's [E] token copies per logical expert, one per block (all EP ranks' tokens)."""
        step = []
        by_group: dict[int, list[int]] = {}
        for i, (_, block) in enumerate(self.blocks):
            step.append(block.routed_tokens.detach().clone())
            block.routed_tokens.zero_()
            if block.ep > 1:
                by_group.setdefault(id(block.ep_group), []).append(i)
        for indices in by_group.values():  # one all-reduce per EP group
            group = self.blocks[indices[0]][1].ep_group
            flat = torch.cat([step[i] for i in indices])
            if not self._agreed:  # its size comes from the blocks, fixed since __init__: checked once
                agree(group, {"blocks": [self.blocks[i][0] for i in indices],
                              "num_experts": [self.blocks[i][1].num_experts for i in indices]},
                      "ExpertLoads.record", self.timeout, frame_device(flat))
            all_reduce(flat, group, self.timeout, "ExpertLoads.record")
            for i, part in zip(indices, flat.split([len(step[i]) for i in indices])):
                step[i] = part
        self._agreed = True
        step = [s.cpu() for s in step]
        self._steps.append(step)
        return step

    @property
    def history(self) -> list[list[torch.Tensor]]:
        """The window's steps, oldest first: per step, one [E] tensor per block."""
        return [list(s) for s in self._steps]

    def window_sum(self) -> list[torch.Tensor]:
        """Per block, [E] token copies per expert summed over the window (zeros before any step)."""
        if not self._steps:
            return [torch.zeros(b.num_experts, dtype=torch.long) for _, b in self.blocks]
        return [torch.stack(per_block).sum(0) for per_block in zip(*self._steps)]
