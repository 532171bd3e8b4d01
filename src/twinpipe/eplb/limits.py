"""Size limits for one ``rebalance_experts`` call: absurd sizes fail at once, with the estimate and the limit.

Each limit bounds one cost that grows with the inputs; on the 2-core development machine (one torch
thread) a call at a limit takes a few seconds and a few hundred MB. DeepSeek-V3 (58 layers x 256
experts, 288 replicas, 32 GPUs) uses less than 1/30 of each. Layers are independent, so a larger
problem can be split into calls of fewer layers.
"""

from __future__ import annotations

from .checks import EplbArgumentError

# Physical experts per layer: the greedy runs one step per replica and per copy.
MAX_REPLICAS = 2**16
# Greedy work: layers x (replicas x GPUs per node + copies x experts per node).
MAX_GREEDY_WORK = 2**28
# refine: layers x replicas x replicas per node (the swap search compares pairs of replicas).
MAX_REFINE_WORK = 2**28
# previous_phy2log: layers x GPUs x max(experts, replicas) (per-GPU replica counts and swap masks).
MAX_MIGRATION_WORK = 2**24
# log2phy entries: layers x experts x the largest replica count (known only after replication).
MAX_LOG2PHY_ENTRIES = 2**26


def check_size(
    num_layers: int,
    num_experts: int,
    num_replicas: int,
    num_nodes: int,
    num_gpus: int,
    *,
    refine: bool,
    previous: bool,
) -> None:
    """Refuse a call whose estimated cost is beyond the limits above (num_nodes = 1 in global mode)."""
    if num_replicas > MAX_REPLICAS:
        raise EplbArgumentError(
            "num_replicas",
            f"num_replicas={num_replicas} is not allowed: at most {MAX_REPLICAS} physical experts per layer",
        )
    shape = f"weight of {num_layers} layers x {num_experts} experts with num_replicas={num_replicas}"
    gpus_per_node, replicas_per_node = num_gpus // num_nodes, num_replicas // num_nodes
    copies, experts_per_node = num_replicas - num_experts, num_experts // num_nodes
    greedy = num_layers * (num_replicas * gpus_per_node + copies * experts_per_node)
    _check_work(
        "weight", greedy, MAX_GREEDY_WORK,
        f"{shape}, {gpus_per_node} GPUs per node needs {greedy:.3g} units of greedy work "
        "(layers x (replicas x GPUs per node + copies x experts per node))",
    )
    if refine:
        work = num_layers * num_replicas * replicas_per_node
        _check_work(
            "refine", work, MAX_REFINE_WORK,
            f"refine=True on {shape}, {replicas_per_node} replicas per node needs {work:.3g} units of "
            "swap search (layers x replicas x replicas per node)",
        )
    if previous:
        work = num_layers * num_gpus * max(num_experts, num_replicas)
        _check_work(
            "previous_phy2log", work, MAX_MIGRATION_WORK,
            f"previous_phy2log on {shape}, num_gpus={num_gpus} needs {work:.3g} units of "
            "migration work (layers x GPUs x max(experts, replicas))",
        )


def check_log2phy_size(num_layers: int, num_experts: int, max_count: int) -> None:
    """log2phy is dense [layers, experts, max_count]: refuse it when it would be too large."""
    entries = num_layers * num_experts * max_count
    if entries > MAX_LOG2PHY_ENTRIES:
        raise EplbArgumentError(
            "num_replicas",
            f"log2phy would have {num_layers} x {num_experts} x {max_count} = {entries:.3g} entries "
            f"(one expert gets {max_count} replicas); allowed: at most {MAX_LOG2PHY_ENTRIES:.3g}. "
            "Use fewer replicas, distinct_per_gpu=True (caps replicas per expert), or fewer layers per call",
        )


def _check_work(argument: str, work: int, limit: int, what: str) -> None:
    if work > limit:
        raise EplbArgumentError(
            argument, f"{what}; allowed: at most {limit:.3g} per call (split the layers into several calls)"
        )
