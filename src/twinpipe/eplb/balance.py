"""``rebalance_experts``: DeepSeek's EPLB policy, vectorised across layers, plus opt-in improvements."""

from __future__ import annotations

import torch

from .checks import check_layout, check_previous, check_weight, refused
from .limits import check_log2phy_size, check_size
from .migrate import align_to_previous
from .packing import greedy_pack, inverse_permutation, ranks_in_pack, replicate
from .refine import refine_swaps
from .report import gpu_loads


def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    refine: bool = False,
    distinct_per_gpu: bool = False,
    previous_phy2log: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place ``num_replicas`` physical experts per layer on ``num_gpus`` GPUs.

    weight: [layers, experts] loads (any real dtype, computed in float32).
    Returns int64 ``phy2log`` [layers, num_replicas] (slot s is on GPU s // (num_replicas/num_gpus)),
    ``log2phy`` [layers, experts, max_count] (log2phy[l, e, k] = slot of expert e's replica of
    rank k, the number of replicas e had when it was created; padded with -1) and ``logcnt``
    [layers, experts].

    Hierarchical policy when num_nodes divides num_groups (groups -> nodes, replicate within each
    node, copies -> GPUs of the node), else global (replicate, copies -> any GPU). With all options
    off the three outputs equal the reference's, ties included (docs/eplb.md).

    refine: swap replicas between the max-loaded GPU and the others (within a node in hierarchical
        mode, and groups between nodes) while that lowers the max; per layer the result is never
        worse than without.
    distinct_per_gpu: never two replicas of one expert on one GPU. An expert then gets at most
        GPUs-per-node (hierarchical) or num_gpus (global) replicas; ValueError when the slots cannot
        be filled that way.
    previous_phy2log: [layers, num_replicas] placement now in use. Keep as many replicas where
        they already are as possible at no balance cost: relabel GPUs (whole nodes, in hierarchical
        mode) and slots, then swap replicas between GPUs (of one node) while no GPU exceeds the
        layer's max load. Max GPU load, node loads and replica counts stay as without it.

    Sizes are limited per call (``limits.py``): beyond them EplbArgumentError says which cost is
    too large; layers are independent, so split them into several calls.
    """
    weight = check_weight(weight)
    num_groups, num_nodes = _checked_layout(weight, num_replicas, num_groups, num_nodes, num_gpus, refine=refine,
                                            distinct_per_gpu=distinct_per_gpu, previous=previous_phy2log is not None)
    if previous_phy2log is not None:
        previous_phy2log = check_previous(previous_phy2log, *weight.shape, num_replicas)
    layout = (weight, num_replicas, num_groups, num_nodes, num_gpus)
    options = dict(distinct=distinct_per_gpu, refine_gpus=refine)
    phy2log, phyrank = _hierarchical(*layout, refine_nodes=False, **options)
    if refine and num_groups > num_nodes > 1:
        # Better-balanced nodes usually, not always, give better-balanced GPUs: keep the better per layer.
        alt = _hierarchical(*layout, refine_nodes=True, **options)
        use_alt = _max_gpu_load(weight, alt[0], num_gpus) < _max_gpu_load(weight, phy2log, num_gpus)
        phy2log = torch.where(use_alt[:, None], alt[0], phy2log)
        phyrank = torch.where(use_alt[:, None], alt[1], phyrank)
    if previous_phy2log is not None:
        phy2log, phyrank = align_to_previous(
            phy2log, phyrank, previous_phy2log, num_gpus, num_nodes, weight=weight, distinct=distinct_per_gpu
        )
    logcnt = torch.zeros(*weight.shape, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    check_log2phy_size(*weight.shape, int(logcnt.max()))
    return phy2log, build_log2phy(phy2log, phyrank, logcnt), logcnt


def _checked_layout(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, *,
                    refine: bool, distinct_per_gpu: bool, previous: bool) -> tuple[int, int]:
    """The arguments checked (EplbArgumentError naming the first that is wrong); the groups and nodes
    the placement uses: as given when hierarchical, else 1 and 1 (global policy)."""
    num_layers, num_experts = weight.shape
    hierarchical = check_layout(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    if not hierarchical:
        num_groups = num_nodes = 1
    check_size(num_layers, num_experts, num_replicas, num_nodes, num_gpus, refine=refine, previous=previous)
    gpus_per_node = num_gpus // num_nodes
    if distinct_per_gpu and num_replicas > num_experts * gpus_per_node:
        where = "GPUs per node" if num_nodes > 1 else "num_gpus"
        raise refused("distinct_per_gpu", True, f"must be False with num_replicas={num_replicas}: True needs "
                      f"num_replicas <= experts ({num_experts}) x {where} ({gpus_per_node}), "
                      "else some GPU must hold two replicas of one expert")
    return num_groups, num_nodes


def build_log2phy(phy2log: torch.Tensor, phyrank: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """[layers, experts, max_count]: log2phy[l, e, k] = slot of replica k of expert e, else -1."""
    num_layers, num_replicas = phy2log.shape
    width = int(logcnt.max())
    log2phy = torch.full((num_layers, logcnt.size(1) * width), -1, dtype=torch.int64)
    slots = torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, -1)
    log2phy.scatter_(1, phy2log * width + phyrank, slots)
    return log2phy.view(num_layers, logcnt.size(1), width)


def _hierarchical(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    refine_nodes: bool,
    refine_gpus: bool,
    distinct: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (phy2log, phyrank), both [layers, num_replicas]. Global mode is G = N = 1."""
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    replicas_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_replicas // num_gpus

    # Step 1: groups -> nodes. Experts are renumbered node-major ("mlog" ids): node n owns mlog ids
    # [n * experts_per_node, (n + 1) * experts_per_node), groups in the order of their rank in the node.
    group_load = weight.view(num_layers, num_groups, group_size).sum(-1)
    node_of_group, group_rank = greedy_pack(group_load, num_nodes)
    if refine_nodes:
        node_of_group = refine_swaps(group_load, node_of_group, num_nodes)
        group_rank = ranks_in_pack(group_load, node_of_group, num_nodes)
    new_group = node_of_group * groups_per_node + group_rank
    log2mlog = (new_group[:, :, None] * group_size + torch.arange(group_size)).view(num_layers, num_experts)
    mlog2log = inverse_permutation(log2mlog)

    # Step 2: replicate within each node; every node gets replicas_per_node slots.
    node_weight = weight.gather(1, mlog2log).view(num_layers * num_nodes, experts_per_node)
    max_count = gpus_per_node if distinct else None
    phy2mlog, phyrank, mlogcnt = replicate(node_weight, replicas_per_node, max_count)

    # Step 3: replicas -> GPUs of the node; a replica carries its expert's load / replica count.
    replica_load = (node_weight / mlogcnt).gather(1, phy2mlog)
    labels = phy2mlog if distinct else None
    gpu, rank = greedy_pack(replica_load, gpus_per_node, labels)
    if refine_gpus:
        gpu = refine_swaps(replica_load, gpu, gpus_per_node, labels)
        rank = ranks_in_pack(replica_load, gpu, gpus_per_node)
    slot = gpu * slots_per_gpu + rank
    slot2replica = inverse_permutation(slot)
    node_offset = (torch.arange(num_layers * num_nodes) % num_nodes * experts_per_node)[:, None]
    slot2mlog = (phy2mlog.gather(1, slot2replica) + node_offset).view(num_layers, num_replicas)
    phy2log = mlog2log.gather(1, slot2mlog)
    phyrank = phyrank.gather(1, slot2replica).view(num_layers, num_replicas)
    return phy2log, phyrank


def _max_gpu_load(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    return gpu_loads(weight, phy2log, num_gpus).max(dim=1).values
