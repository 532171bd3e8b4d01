"""Expert-parallel load balancing (DeepSeek's EPLB), vectorised across layers.

``rebalance_experts`` gives the reference placement (or a better one with ``refine`` /
``distinct_per_gpu``, or a migration-aware one with ``previous_phy2log``); ``balance_report``
measures it. Imports torch only; the CLI and plotting load rich/matplotlib lazily.
"""

from .balance import rebalance_experts
from .checks import EplbArgumentError
from .migrate import replicas_to_move
from .plot import plot_balance
from .report import BalanceReport, Imbalance, balance_report, gpu_loads, naive_gpu_loads

__all__ = [
    "BalanceReport",
    "EplbArgumentError",
    "Imbalance",
    "balance_report",
    "gpu_loads",
    "naive_gpu_loads",
    "plot_balance",
    "rebalance_experts",
    "replicas_to_move",
]
