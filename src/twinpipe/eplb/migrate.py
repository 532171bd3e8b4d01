"""Migration-aware relabelling: keep replicas where the previous placement had them, at equal loads.

GPUs are interchangeable (all hold the same number of slots), so relabelling them changes no GPU
load. In hierarchical mode whole nodes are relabelled and GPUs only within a node, so node loads and
the group-to-node locality are kept too. We pick the relabelling that maximises the number of
replicas already on their GPU: an assignment problem per layer (per node pair for GPUs), solved
by greedy matching plus pairwise exchanges (a local optimum, never worse than no relabelling).
Inside a GPU each replica then takes the slot its expert had there before, where it can.
"""

from __future__ import annotations

import torch

from .packing import inverse_permutation


def replicas_to_move(previous_phy2log: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> int:
    """How many replicas some GPU must fetch: held there now but not before (counted with multiplicity)."""
    num_layers, num_replicas = phy2log.shape
    num_experts = int(max(phy2log.max(), previous_phy2log.max())) + 1
    new = _counts_per_gpu(phy2log, num_gpus, num_experts)
    old = _counts_per_gpu(previous_phy2log, num_gpus, num_experts)
    kept = torch.minimum(new, old).sum()
    return int(num_layers * num_replicas - kept)


def align_to_previous(
    phy2log: torch.Tensor,
    phyrank: torch.Tensor,
    previous: torch.Tensor,
    num_gpus: int,
    num_nodes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Relabel nodes, GPUs and slots of (phy2log, phyrank) to overlap ``previous`` the most."""
    num_layers, num_replicas = phy2log.shape
    slots_per_gpu = num_replicas // num_gpus
    gpus_per_node = num_gpus // num_nodes
    num_experts = int(max(phy2log.max(), previous.max())) + 1
    new = _counts_per_gpu(phy2log, num_gpus, num_experts)
    old = _counts_per_gpu(previous, num_gpus, num_experts)
    gpu_overlap = _multiset_overlap(new, old)  # [L, P, P]
    if num_nodes > 1:
        node_new = new.view(num_layers, num_nodes, gpus_per_node, num_experts).sum(2)
        node_old = old.view(num_layers, num_nodes, gpus_per_node, num_experts).sum(2)
        node_target = _max_weight_matching(_multiset_overlap(node_new, node_old))  # [L, N]
        blocks = gpu_overlap.view(num_layers, num_nodes, gpus_per_node, num_nodes, gpus_per_node)
        blocks = blocks.permute(0, 1, 3, 2, 4)  # [L, new node, old node, new gpu, old gpu]
        index = node_target.view(num_layers, num_nodes, 1, 1, 1).expand(-1, -1, 1, gpus_per_node, gpus_per_node)
        paired = blocks.gather(2, index).reshape(num_layers * num_nodes, gpus_per_node, gpus_per_node)
        local = _max_weight_matching(paired).view(num_layers, num_nodes, gpus_per_node)
        gpu_target = (node_target[:, :, None] * gpus_per_node + local).view(num_layers, num_gpus)
    else:
        gpu_target = _max_weight_matching(gpu_overlap)

    # GPU gpu_target[i] receives what new GPU i holds.
    source = inverse_permutation(gpu_target)[:, :, None].expand(-1, -1, slots_per_gpu)
    experts = phy2log.view(num_layers, num_gpus, slots_per_gpu).gather(1, source)
    ranks = phyrank.view(num_layers, num_gpus, slots_per_gpu).gather(1, source)
    slot_source = _align_slots(experts, previous.view(num_layers, num_gpus, slots_per_gpu))
    phy2log = experts.gather(2, slot_source).view(num_layers, num_replicas)
    phyrank = ranks.gather(2, slot_source).view(num_layers, num_replicas)
    return phy2log, phyrank


def _counts_per_gpu(phy2log: torch.Tensor, num_gpus: int, num_experts: int) -> torch.Tensor:
    """[L, P, E] replicas of each expert on each GPU."""
    num_layers, num_replicas = phy2log.shape
    counts = torch.zeros(num_layers, num_gpus, num_experts, dtype=torch.int64)
    per_gpu = phy2log.view(num_layers, num_gpus, num_replicas // num_gpus)
    return counts.scatter_add_(2, per_gpu, torch.ones_like(per_gpu))


def _multiset_overlap(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """[B, n, n]: sum_e min(new[b, i, e], old[b, j, e]), as sum over t >= 1 of [new >= t] . [old >= t]."""
    overlap = torch.zeros(new.size(0), new.size(1), old.size(1))
    for t in range(1, int(min(new.max(), old.max())) + 1):
        overlap += torch.bmm((new >= t).float(), (old >= t).float().transpose(1, 2))
    return overlap


def _max_weight_matching(score: torch.Tensor, max_rounds: int = 256) -> torch.Tensor:
    """perm [B, n] with perm[b, i] = the column matched to row i, for a large sum of score[b, i, perm[b, i]].

    Greedy (largest entry first, lowest indices on ties) then pairwise exchanges while one helps;
    rows keep the identity when that scores at least as well.
    """
    batch, n, _ = score.shape
    ar = torch.arange(batch)
    free = score.clone()
    perm = torch.empty(batch, n, dtype=torch.int64)
    for _ in range(n):
        flat = free.view(batch, -1).argmax(dim=1)
        row, col = flat // n, flat % n
        perm[ar, row] = col
        free[ar, row, :] = -1.0
        free[ar, :, col] = -1.0
    for _ in range(max_rounds):
        current = score.gather(2, perm[:, :, None]).squeeze(2)  # [B, n]
        crossed = score.gather(2, perm[:, None, :].expand(batch, n, n))  # [b, i, j] = score[i, perm[j]]
        gain = crossed + crossed.transpose(1, 2) - current[:, :, None] - current[:, None, :]
        best = gain.view(batch, -1).max(dim=1)
        better = best.values > 0.5  # scores are integers
        if not bool(better.any()):
            break
        rows = ar[better]
        i, j = best.indices[better] // n, best.indices[better] % n
        pi, pj = perm[rows, i].clone(), perm[rows, j].clone()
        perm[rows, i], perm[rows, j] = pj, pi
    identity = torch.arange(n).expand(batch, n)
    found = score.gather(2, perm[:, :, None]).sum((1, 2))
    kept = score.diagonal(dim1=1, dim2=2).sum(1)
    return torch.where((kept >= found)[:, None], identity, perm)


def _align_slots(experts: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """[L, P, k] index of the item each slot takes: an item with the slot's previous expert if free."""
    slots = experts.size(-1)
    used = torch.zeros_like(experts, dtype=torch.bool)
    source = torch.full_like(experts, -1)
    for s in range(slots):
        match = (experts == previous[:, :, s : s + 1]) & ~used
        found = match.any(dim=-1)
        first = match.to(torch.int8).argmax(dim=-1)
        source[:, :, s] = torch.where(found, first, -1)
        used.scatter_(2, first[:, :, None], found[:, :, None] | used.gather(2, first[:, :, None]))
    # The rest, in order: i-th free slot takes the i-th unused item.
    free_slots = (source >= 0).to(torch.int8).sort(dim=-1, stable=True).indices
    unused_items = used.to(torch.int8).sort(dim=-1, stable=True).indices
    num_free = (source < 0).sum(-1, keepdim=True)
    fill = torch.where(torch.arange(slots) < num_free, unused_items, source.gather(2, free_slots))
    return source.scatter(2, free_slots, fill)
