"""Balance report: max/mean GPU (and node) load per layer, before and after rebalancing.

"Before" is the placement without EPLB: no replication, expert e on GPU e * num_gpus // experts,
i.e. experts split contiguously, experts/num_gpus per GPU when that divides.
"After" splits each expert's load evenly over its replicas.
A layer with zero total load counts as perfectly balanced (ratio 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import EplbArgumentError, check_count, check_weight


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """[layers, num_gpus] float32 load per GPU of a placement."""
    weight = weight.float()
    logcnt = torch.zeros_like(weight, dtype=torch.int64).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    per_slot = (weight / logcnt.clamp(min=1)).gather(1, phy2log)
    return per_slot.view(weight.size(0), num_gpus, -1).sum(-1)


def naive_gpu_loads(weight: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """[layers, num_gpus] loads without EPLB: experts placed contiguously, no copies."""
    weight = weight.float()
    num_experts = weight.size(1)
    gpu_of_expert = torch.arange(num_experts) * num_gpus // num_experts
    out = torch.zeros(weight.size(0), num_gpus)
    return out.index_add_(1, gpu_of_expert, weight)


def imbalance(loads: torch.Tensor) -> torch.Tensor:
    """[layers] max/mean of each row (1 for an all-zero row)."""
    mean = loads.mean(dim=1)
    ratio = loads.max(dim=1).values / mean
    return torch.where(mean > 0, ratio, torch.ones_like(ratio))


@dataclass(frozen=True)
class Imbalance:
    """Per-layer max/mean load ratios (>= 1, lower is better)."""

    per_layer: torch.Tensor

    @property
    def mean(self) -> float:
        return float(self.per_layer.double().mean())

    @property
    def worst(self) -> float:
        return float(self.per_layer.max())

    @property
    def worst_layer(self) -> int:
        return int(self.per_layer.argmax())


@dataclass(frozen=True, kw_only=True)
class BalanceReport:
    """Loads and imbalance before (no EPLB) and after a placement; node fields None for one node."""

    num_gpus: int
    num_nodes: int
    gpu_loads_before: torch.Tensor
    gpu_loads_after: torch.Tensor
    gpu_before: Imbalance
    gpu_after: Imbalance
    node_before: Imbalance | None
    node_after: Imbalance | None

    def to_dict(self) -> dict:
        """Summary numbers (mean and worst over layers, per-layer lists) for JSON."""

        def stats(x: Imbalance | None):
            if x is None:
                return None
            return {"mean": x.mean, "worst": x.worst, "per_layer": x.per_layer.tolist()}

        return {
            "num_gpus": self.num_gpus,
            "num_nodes": self.num_nodes,
            "gpu": {"before": stats(self.gpu_before), "after": stats(self.gpu_after)},
            "node": {"before": stats(self.node_before), "after": stats(self.node_after)},
        }


def balance_report(
    weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int, num_nodes: int = 1
) -> BalanceReport:
    """Compare a placement (``phy2log`` [layers, replicas]) with no EPLB on loads ``weight``.

    Node loads are reported when num_nodes > 1 and divides num_gpus (GPU g is on node
    g // (num_gpus/num_nodes)).
    """
    weight = check_weight(weight)
    check_count("num_gpus", num_gpus)
    check_count("num_nodes", num_nodes)
    if phy2log.dim() != 2 or phy2log.size(0) != weight.size(0) or phy2log.size(1) % num_gpus:
        raise EplbArgumentError(
            "phy2log",
            f"phy2log has shape {tuple(phy2log.shape)}; allowed: [{weight.size(0)}, R] with R a multiple "
            f"of num_gpus={num_gpus}",
        )
    before = naive_gpu_loads(weight, num_gpus)
    after = gpu_loads(weight, phy2log, num_gpus)
    node_before = node_after = None
    if num_nodes > 1 and num_gpus % num_nodes == 0:
        node_before = Imbalance(imbalance(before.view(len(before), num_nodes, -1).sum(-1)))
        node_after = Imbalance(imbalance(after.view(len(after), num_nodes, -1).sum(-1)))
    return BalanceReport(
        num_gpus=num_gpus,
        num_nodes=num_nodes,
        gpu_loads_before=before,
        gpu_loads_after=after,
        gpu_before=Imbalance(imbalance(before)),
        gpu_after=Imbalance(imbalance(after)),
        node_before=node_before,
        node_after=node_after,
    )
