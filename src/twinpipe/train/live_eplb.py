"""EPLB in the training loop (``TrainConfig.eplb_every``): ``twinpipe.eplb.Balancer`` on a rank's stages.

After every step the balancer records the loads of this rank's MoE blocks; every ``eplb_every`` steps
it re-places the experts of the blocks whose max/mean EP-rank load is above ``eplb_threshold``, moving
their weights and the optimizer's state for them between the EP ranks (``twinpipe.moe.apply_placement_``).
The math stays the same: a token still goes to the same logical expert, replicas only split the
tokens, and ``reduce_replica_grads`` gives every replica the sum of their gradients (step.py).
Checkpoints store experts by logical id (``experts.PlacedRows``), whatever the placement.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from twinpipe.checks import bad
from twinpipe.eplb.balancer import Balancer, RebalanceReport
from twinpipe.moe.exchange import ExpertExchange
from twinpipe.train.config import check_eplb_mesh

__all__ = ["LiveBalance", "start", "summary", "check_trainer"]


def check_trainer(config, ep: int, dp: int, *, gpt_experts: int, mirrored: bool) -> None:
    """``config.check_eplb_mesh`` for a ``Trainer``; and the model: a ``transformers`` MoE model only (``stages=HFSource``)."""
    if config.eplb_every and gpt_experts:
        raise bad("eplb_every", config.eplb_every, "works on transformers MoE models only for now (Trainer(stages=HFSource(...)), "
                  "twinpipe train --model): the built-in GPT's checkpoints name its experts by slot")
    check_eplb_mesh(eplb_every=config.eplb_every, redundant=config.redundant_experts, ep=ep, dp=dp, precision=config.precision,
               zero=config.zero, mirrored=mirrored)


class LiveBalance:
    """The balancer of this rank's stage ``modules`` and their MoE ``blocks``, as ``config``'s ``eplb_*`` fields
    say (built collectively over their EP groups)."""

    def __init__(self, modules: Sequence[nn.Module], blocks: Sequence[ExpertExchange], optimizer, config, timeout: float):
        for block in blocks:
            block.reset_counts()  # the cut's time measurement ran the layers: a step counts its own tokens
        self.balancer = Balancer(list(modules), optimizer=optimizer, interval=config.eplb_every, window=config.eplb_window,
                                 threshold=config.eplb_threshold, timeout=timeout)

    def after_step(self) -> RebalanceReport | None:
        """This step's loads recorded; a rebalance every ``config.eplb_every`` steps (its report)."""
        return self.balancer.step()

    def placements(self) -> dict[str, list[int]]:
        """Each block (by its name in this rank's stages, ``"i.name"``) -> its ``phy2log``."""
        return {name: block.phy2log.tolist() for name, block in self.balancer.loads.blocks}


def start(modules: Sequence[nn.Module], optimizer, config, timeout: float) -> LiveBalance | None:
    """``config``'s balancer for this rank's ``modules``, or None (EPLB off, or no MoE block here)."""
    blocks = [b for m in modules for b in m.modules() if isinstance(b, ExpertExchange)]
    if not config.eplb_every or not blocks:
        return None
    for block in blocks:
        if block.num_slots != block.num_experts + config.redundant_experts:
            raise bad("redundant_experts", config.redundant_experts, f"must be what the stages were built with: they hold "
                      f"{block.num_slots} slots for {block.num_experts} experts (HFSource(redundant_experts=...))")
    return LiveBalance(modules, blocks, optimizer, config, timeout)


def summary(report: RebalanceReport, placements: dict[str, list[int]]) -> dict:
    """A rebalance as the run's log keeps it (the step's entry): per block the max/mean rank load before
    and after, experts sent, and the placement now."""
    return {"experts_sent": sum(layer.move.transfers for layer in report.layers if layer.move),
            "bytes_sent": report.bytes_sent,
            "blocks": [{"name": layer.name, "before": layer.before, "after": layer.after, "moved": layer.move is not None,
                        "phy2log": placements.get(layer.name)} for layer in report.layers]}
