"""Migration-aware placement: keep replicas where the previous placement had them, at no balance cost.

1. Relabel. GPUs are interchangeable (all hold the same number of slots), so relabelling them
   changes no GPU load. In hierarchical mode whole nodes are relabelled and GPUs only within a
   node, so node loads and group-to-node locality are kept too. The relabelling maximises the
   replicas already on their GPU: an assignment problem per layer (per node pair for GPUs), solved
   by greedy matching plus pairwise exchanges (a local optimum, never worse than no relabelling).
2. Swap. A replica x on GPU a whose expert GPU b held before (and holds fewer copies of now) swaps
   with a replica y on b when that keeps more replicas in place and both GPUs stay at or below the
   layer's max GPU load (within a node in hierarchical mode): the max, hence max/mean, is unchanged.
3. Slots. Inside a GPU each replica takes the slot its expert had there before, where it can.
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
    weight: torch.Tensor | None = None,
    distinct: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Relabel nodes, GPUs and slots of (phy2log, phyrank) to overlap ``previous`` the most.

    With ``weight`` ([layers, experts] float32 loads) also swap replicas between GPUs (step 2 above);
    ``distinct`` keeps those swaps from putting two replicas of an expert on one GPU.
    """
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
    # Node-level matching is a proxy: never keep fewer replicas than no relabelling at all.
    relabelled = gpu_overlap.gather(2, gpu_target[:, :, None]).sum((1, 2))
    unchanged = gpu_overlap.diagonal(dim1=1, dim2=2).sum(1)
    gpu_target = torch.where((relabelled >= unchanged)[:, None], gpu_target, torch.arange(num_gpus))

    # GPU gpu_target[i] receives what new GPU i holds.
    source = inverse_permutation(gpu_target)[:, :, None].expand(-1, -1, slots_per_gpu)
    experts = phy2log.view(num_layers, num_gpus, slots_per_gpu).gather(1, source)
    ranks = phyrank.view(num_layers, num_gpus, slots_per_gpu).gather(1, source)
    if weight is not None:
        experts, ranks = _swap_towards_previous(weight, experts, ranks, previous, num_nodes, distinct)
    slot_source = _align_slots(experts, previous.view(num_layers, num_gpus, slots_per_gpu))
    phy2log = experts.gather(2, slot_source).view(num_layers, num_replicas)
    phyrank = ranks.gather(2, slot_source).view(num_layers, num_replicas)
    return phy2log, phyrank


# Swaps keep every receiving GPU this fraction below the max load, far above float32 rounding of a
# GPU sum, so recomputed loads cannot exceed the max.
_REL_MARGIN = 4e-6


def _swap_towards_previous(weight, experts, ranks, previous, num_nodes, distinct, max_rounds=64):
    """Step 2 of the module docstring on [L, P, k] experts/ranks; rounds of disjoint swaps, all layers at once."""
    num_layers, num_gpus, slots = experts.shape
    num_replicas = num_gpus * slots
    num_experts = weight.size(1)
    ph, rk = experts.reshape(num_layers, num_replicas).clone(), ranks.reshape(num_layers, num_replicas).clone()
    logcnt = torch.zeros(num_layers, num_experts, dtype=torch.int64).scatter_add_(1, ph, torch.ones_like(ph))
    per_copy = weight / logcnt.clamp(min=1)
    gpu = (torch.arange(num_replicas) // slots).expand(num_layers, -1)
    bound = per_copy.gather(1, ph).view(num_layers, num_gpus, slots).sum(-1).max(1).values * (1 - _REL_MARGIN)
    bound = bound[:, None, None]
    old = _counts_per_gpu(previous, num_gpus, num_experts).view(num_layers, -1)
    node = torch.arange(num_gpus) // (num_gpus // num_nodes)
    same_node = node[None, :, None] == node[gpu][:, None, :]  # [L, P, R]: GPU b and replica x's GPU share a node
    for _ in range(max_rounds):
        new = _counts_per_gpu(ph, num_gpus, num_experts).view(num_layers, -1)
        item_w = per_copy.gather(1, ph)
        load = item_w.view(num_layers, num_gpus, slots).sum(-1)

        def count(table, g, e):  # table[l, g, e] for index tensors g, e of one shape [L, ...]
            return table.gather(1, (g * num_experts + e).view(num_layers, -1)).view(g.shape)

        # x must be a surplus copy on its GPU a (moving it loses nothing) and have a target GPU b in
        # its node that held more copies of x's expert before than now; take the first such b.
        surplus = count(new, gpu, ph) > count(old, gpu, ph)
        missing = (old - new).view(num_layers, num_gpus, num_experts)
        missing = missing.gather(2, ph[:, None, :].expand(-1, num_gpus, -1))  # [L, P, R]
        wanted = (missing > 0) & same_node & surplus[:, None, :]
        has_target, target = wanted.to(torch.int8).max(dim=1)  # first wanting GPU, [L, R]
        has_target = has_target.bool()
        ys = target[:, :, None] * slots + torch.arange(slots)  # [L, R, k] replicas on b
        ey = ph.gather(1, ys.view(num_layers, -1)).view(ys.shape)
        ex = ph[:, :, None].expand_as(ey)
        a = gpu[:, :, None].expand_as(ey)
        b = target[:, :, None].expand_as(ey)
        delta = item_w[:, :, None] - item_w.gather(1, ys.view(num_layers, -1)).view(ys.shape)  # load a -> b
        fits = ((delta >= 0) | (load.gather(1, gpu)[:, :, None] - delta <= bound)) & (
            (delta <= 0) | (load.gather(1, target)[:, :, None] + delta <= bound)
        )
        # Kept replicas gained: +1 for x on b; +1 if a wants y's expert; -1 if y was kept on b.
        gain = 1 + (count(new, a, ey) < count(old, a, ey)).long() - (count(new, b, ey) <= count(old, b, ey)).long()
        valid = has_target[:, :, None] & fits & (gain > 0) & (ey != ex)
        if distinct:
            valid &= (count(new, a, ey) == 0) & (count(new, b, ex) == 0)
        # Prefer more kept replicas, then the smallest load change.
        score = torch.where(valid, gain - delta.abs() / (2 * bound + 1), torch.full_like(delta, -1.0))
        best_score, best_y = score.max(dim=2)  # [L, R]
        if not bool((best_score > 0).any()):
            break
        y_of = ys.gather(2, best_y[:, :, None]).squeeze(2)
        _apply_disjoint_swaps(ph, rk, best_score, y_of, gpu, target, num_gpus)
    return ph.view(num_layers, num_gpus, slots), rk.view(num_layers, num_gpus, slots)


def _apply_disjoint_swaps(ph, rk, score, y_of, gpu, target, num_gpus: int) -> None:
    """Swap, in place, replica x (on GPU ``gpu[l, x]``) with ``y_of[l, x]`` (on ``target[l, x]``),
    best ``score`` first; each GPU takes part in at most one swap per round."""
    num_layers = ph.shape[0]
    ar = torch.arange(num_layers)
    used = torch.zeros(num_layers, num_gpus, dtype=torch.bool)
    pending = score
    while True:
        top, x = pending.max(dim=1)
        rows = ar[top > 0]
        if len(rows) == 0:
            return
        x, y = x[rows], y_of[rows, x[rows]]
        ga, gb = gpu[rows, x], target[rows, x]
        ph[rows, x], ph[rows, y] = ph[rows, y].clone(), ph[rows, x].clone()
        rk[rows, x], rk[rows, y] = rk[rows, y].clone(), rk[rows, x].clone()
        used[rows, ga] = True
        used[rows, gb] = True
        blocked = used.gather(1, gpu) | used.gather(1, target)
        pending = pending.masked_fill(blocked, -1.0)


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
