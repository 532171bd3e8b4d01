"""``Balancer``: EPLB in the loop. Measures the routed loads of a model's MoE blocks, and every
``interval`` steps re-places the experts of the blocks whose rank loads are too uneven.

This module uses ``twinpipe.moe`` (the layers it balances); eplb's placement modules never import
it. Every rank of the EP groups runs the same ``Balancer`` calls. The ranks compare their
balancers' settings when they are built, and decide every rebalance from the same loads (the
ranks' windows summed over the group), so all compute the same placement and move experts
together, or all raise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twinpipe.checks import DEFAULT_TIMEOUT, bad, check_bool, check_float, check_int
from twinpipe.moe.agree import agree, all_reduce, frame_device
from twinpipe.moe.loads import ExpertLoads
from twinpipe.moe.move import MoveReport, apply_placement_, check_optimizer_holds_experts
from twinpipe.runtime.collectives import checked_timeout

from .balance import rebalance_experts
from .report import gpu_loads, imbalance

__all__ = ["Balancer", "LayerRebalance", "RebalanceReport"]


@dataclass(frozen=True)
class LayerRebalance:
    """One block at one rebalance: max/mean EP-rank load of the window's loads under the old and
    the new placement (``after == before`` when nothing changed), and what moved."""

    name: str
    before: float
    after: float
    move: MoveReport | None  # None: placement kept (balanced enough, or no better one found)


@dataclass(frozen=True)
class RebalanceReport:
    step: int
    layers: tuple[LayerRebalance, ...]

    @property
    def bytes_sent(self) -> int:
        return sum(layer.move.bytes_sent for layer in self.layers if layer.move)

    @property
    def bytes_all(self) -> int:
        """Bytes that sending every slot's expert of the re-placed blocks would have cost."""
        return sum(layer.move.bytes_all for layer in self.layers if layer.move)

    def __str__(self) -> str:
        lines = [f"rebalance at step {self.step}:"]
        for layer in self.layers:
            what = (f"{layer.move.transfers} experts sent, {layer.move.local_copies} local copies, "
                    f"{layer.move.bytes_sent} of {layer.move.bytes_all} bytes") if layer.move else "kept"
            lines.append(f"  {layer.name}: max/mean rank load {layer.before:.3f} -> {layer.after:.3f} ({what})")
        return "\n".join(lines)


class Balancer:
    """Call ``step()`` once per training step, after the optimizer step, on every rank.

    It records the step's expert loads (``loads``: an ``ExpertLoads`` over ``window`` steps); every
    ``interval`` steps, each block whose max/mean rank load over the window exceeds ``threshold``
    gets a new placement (``rebalance_experts`` with ``previous_phy2log``: the same balance while
    keeping as many replicas where they are as possible; ``refine`` as there), applied only if it
    is better, by moving the changed experts' weights and ``optimizer`` state between EP ranks.
    The slot count stays the blocks' own (set it with ``MoEBlock.shard_experts_(group, phy2log)``).
    Every wait of the loop (the loads' all-reduces, the moves, the checks before them) lasts at
    most ``timeout`` seconds.

    Construction is collective over the blocks' EP groups: the ranks compare ``interval``,
    ``window``, ``threshold``, ``refine``, the optimizer's class and the blocks, and all raise a
    ValueError naming what differs. Each rebalance decides from the ranks' window loads summed
    over the EP group (one all-reduce), so every rank takes the same decision.
    """

    def __init__(self, model, *, optimizer=None, interval: int = 100, window: int | None = None,
                 threshold: float = 1.1, refine: bool = False, timeout: float = DEFAULT_TIMEOUT):
        check_int(interval, "interval", low=1)
        if window is not None:
            check_int(window, "window", low=1)
        threshold = check_float(threshold, "threshold", low=1.0)  # a max/mean load ratio
        check_bool(refine, "refine")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise bad("optimizer", optimizer, "must be a torch.optim.Optimizer or None")
        self.timeout = checked_timeout(timeout)
        self.loads = ExpertLoads(model, interval if window is None else window, timeout=self.timeout)
        self.optimizer, self.interval, self.threshold = optimizer, interval, threshold
        self.refine = refine
        self.steps = 0
        self.reports: list[RebalanceReport] = []
        refused = None  # an optimizer whose state could not move with the experts: refused now, not at the first move
        try:
            for _, block in self.loads.blocks:
                check_optimizer_holds_experts(optimizer, block)
        except ValueError as exc:
            refused = exc
        for blocks in self._ep_groups():  # collective: every EP rank's balancer must decide alike
            settings = {"interval": interval, "window": self.loads.window, "threshold": threshold, "refine": refine,
                        "optimizer": None if optimizer is None else type(optimizer).__name__,
                        "blocks": [self.loads.blocks[i][0] for i in blocks]}
            block = self.loads.blocks[blocks[0]][1]
            agree(block.ep_group, settings, "Balancer", self.timeout, frame_device(block.routed_tokens), refused)
        if refused is not None:
            raise refused

    def _ep_groups(self) -> list[list[int]]:
        """Indices of the blocks (in block order) of each EP group with more than one rank."""
        groups: dict[int, list[int]] = {}
        for i, (_, block) in enumerate(self.loads.blocks):
            if block.ep > 1:
                groups.setdefault(id(block.ep_group), []).append(i)
        return list(groups.values())

    def _decision_loads(self) -> list[torch.Tensor]:
        """Per block, the window loads every EP rank decides from: the ranks' windows summed over
        the block's EP group (one all-reduce per group) and divided by its size. The window itself
        when the ranks' windows agree (each step's loads were summed when recorded), the same
        loads on every rank when they do not."""
        windows = self.loads.window_sum()
        for blocks in self._ep_groups():
            block = self.loads.blocks[blocks[0]][1]
            flat = torch.cat([windows[i] for i in blocks]).to(block.routed_tokens.device)
            all_reduce(flat, block.ep_group, self.timeout, "Balancer.rebalance: summing the EP ranks' load windows")
            for i, part in zip(blocks, flat.cpu().split([len(windows[i]) for i in blocks])):
                windows[i] = part // block.ep
        return windows

    def step(self) -> RebalanceReport | None:
        """Record this step's loads; every ``interval`` steps rebalance (returns the report)."""
        self.loads.record()
        self.steps += 1
        return self.rebalance() if self.steps % self.interval == 0 else None

    def imbalance(self) -> list[float]:
        """Per block, max/mean EP-rank load of the window's loads under its current placement."""
        return [_ratio(w, block.phy2log, block.ep) for w, (_, block) in zip(self.loads.window_sum(), self.loads.blocks)]

    def rebalance(self, force: bool = False) -> RebalanceReport:
        """Re-place the blocks above the threshold (all blocks with ``force``) now."""
        layers = []
        for weight, (name, block) in zip(self._decision_loads(), self.loads.blocks):
            old = block.phy2log
            before = _ratio(weight, old, block.ep)
            move, after = None, before
            if force or before > self.threshold:
                new = rebalance_experts(weight[None].double(), block.num_slots, 1, 1, block.ep,
                                        refine=self.refine, previous_phy2log=old[None])[0][0]
                candidate = _ratio(weight, new, block.ep)
                if candidate < before or (force and not torch.equal(new, old)):
                    move = apply_placement_(block, new, self.optimizer, self.timeout)
                    after = candidate
            layers.append(LayerRebalance(name, before, after, move))
        report = RebalanceReport(self.steps, tuple(layers))
        self.reports.append(report)
        return report


def _ratio(weight: torch.Tensor, phy2log: torch.Tensor, ep: int) -> float:
    return float(imbalance(gpu_loads(weight[None].double(), phy2log[None], ep))[0])
