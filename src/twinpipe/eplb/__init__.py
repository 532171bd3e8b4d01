"""Expert-parallel load balancing (DeepSeek's EPLB), vectorised across layers.

``rebalance_experts`` gives the reference placement (or a better one with ``refine`` /
``distinct_per_gpu``, or a migration-aware one with ``previous_phy2log``); ``balance_report``
measures it. ``Balancer`` (balancer.py) runs it in the training loop on ``twinpipe.moe`` blocks.
Imports torch only; the CLI and plotting load rich/matplotlib lazily, the balancer (and with it
the MoE layers) on first use.
"""

from .balance import rebalance_experts
from .checks import EplbArgumentError
from .migrate import replicas_to_move
from .plot import plot_balance
from .report import BalanceReport, Imbalance, balance_report, gpu_loads, naive_gpu_loads

_LAZY = frozenset({"Balancer", "RebalanceReport", "LayerRebalance"})


def __getattr__(name):
    if name in _LAZY:
        from . import balancer

        return getattr(balancer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Balancer",
    "BalanceReport",
    "EplbArgumentError",
    "Imbalance",
    "LayerRebalance",
    "RebalanceReport",
    "balance_report",
    "gpu_loads",
    "naive_gpu_loads",
    "plot_balance",
    "rebalance_experts",
    "replicas_to_move",
]
