"""The two greedy building blocks of EPLB, vectorised over rows (layers, or layers x nodes).

Rows are independent problems. The loops below run over items or replica rounds only; every step
is one tensor op over all rows, so 58 layers cost about as much as one.
"""

from __future__ import annotations

import torch

_INF = float("inf")


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse: ``inv[r, perm[r, i]] = i``."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=perm.dtype).expand_as(perm))
    return inv


def sort_order(weight: torch.Tensor) -> torch.Tensor:
    """Item indices by weight, heaviest first, ties in the order of torch's default sort.

    That is the reference's own sort call, so equal weights (copies of one expert always tie) come
    in the reference's order: index order for rows of up to 16 items on torch 2.13 CPU, a fixed
    permutation of the tied items, which depends on the whole row, for longer rows.
    """
    return weight.sort(dim=1, descending=True).indices


def replicate(
    weight: torch.Tensor, num_replicas: int, max_count: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add copies one at a time to the expert with the largest load per copy.

    weight: [rows, n] float32. Returns ``phy2log`` [rows, num_replicas] (slot i < n holds expert i,
    later slots the copies in creation order), ``rank`` [rows, num_replicas] (0 for the original,
    k for the k-th copy) and ``count`` [rows, n]. Ties go to the lowest expert index. With
    ``max_count`` no expert gets more than that many replicas (needs n * max_count >= num_replicas).
    """
    rows, n = weight.shape
    count = torch.ones(rows, n)  # float32 holds these small integers exactly
    one = torch.ones(rows, 1)
    chosen, ranks = [torch.arange(n).expand(rows, n)], [torch.zeros(rows, n, dtype=torch.int64)]
    for _ in range(n, num_replicas):
        per_copy = weight / count  # float32, as the reference divides
        if max_count is not None:
            per_copy.masked_fill_(count >= max_count, -_INF)
        best = per_copy.argmax(dim=1, keepdim=True)  # first maximum
        ranks.append(count.gather(1, best).long())  # copies so far = this copy's rank
        count.scatter_add_(1, best, one)
        chosen.append(best)
    return torch.cat(chosen, dim=1), torch.cat(ranks, dim=1), count.long()


def greedy_pack(
    weight: torch.Tensor, num_packs: int, labels: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest-first greedy packing with equal pack sizes; returns ``pack`` and ``rank`` [rows, n].

    Items go, heaviest first (``sort_order``), to the lightest pack that still has room, ties to
    the lowest pack index; pack loads accumulate in float32 like the reference. ``rank`` is the
    item's place in its pack (heaviest first). With ``labels`` (non-negative int ids, [rows, n]) an
    item never joins a pack that already holds its label; when every open pack does, a swap with an
    earlier item makes room (see ``_unstick``). With one item per pack the packing is the identity,
    as in the reference.
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return torch.arange(n).repeat(rows, 1), torch.zeros(rows, n, dtype=torch.int64)
    order = sort_order(weight)
    w_sorted = weight.gather(1, order)
    if labels is None:
        pack_sorted, rank_sorted = _pack_sorted(w_sorted, num_packs, per_pack)
        rank = torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)
    else:
        pack_sorted = _pack_sorted_distinct(w_sorted, labels.gather(1, order), num_packs, per_pack)
        rank = None  # swaps in _unstick reorder packs; rank by weight afterwards
    pack = torch.empty_like(pack_sorted).scatter_(1, order, pack_sorted)
    if rank is None:
        rank = ranks_in_pack(weight, pack, num_packs)
    return pack, rank


def ranks_in_pack(weight: torch.Tensor, pack: torch.Tensor, num_packs: int) -> torch.Tensor:
    """Slot of each item inside its pack: in ``sort_order`` (what greedy insertion gives)."""
    rows, n = weight.shape
    per_pack = n // num_packs
    position = inverse_permutation(sort_order(weight))
    by_pack = (pack * n + position).argsort(dim=1)  # items grouped by pack, heaviest first
    rank = torch.empty_like(pack)
    rank.scatter_(1, by_pack, (torch.arange(n) % per_pack).expand(rows, n).contiguous())
    return rank


def _pack_sorted(w_sorted: torch.Tensor, num_packs: int, per_pack: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = w_sorted.shape
    # key = pack load, or +inf once the pack is full, so one argmin picks the target pack.
    key = torch.zeros(rows, num_packs)
    count = torch.zeros(rows, num_packs, dtype=torch.int64)
    one = torch.ones(rows, 1, dtype=torch.int64)
    full = torch.empty(rows, num_packs, dtype=torch.bool)
    chosen, ranks = [], []
    for i in range(n):
        pack = key.argmin(dim=1, keepdim=True)  # first minimum = lowest pack index
        key.scatter_add_(1, pack, w_sorted[:, i : i + 1])
        ranks.append(count.gather(1, pack))
        count.scatter_add_(1, pack, one)
        torch.ge(count, per_pack, out=full)
        key.masked_fill_(full, _INF)
        chosen.append(pack)
    return torch.cat(chosen, dim=1), torch.cat(ranks, dim=1)


def _pack_sorted_distinct(
    w_sorted: torch.Tensor, lab_sorted: torch.Tensor, num_packs: int, per_pack: int
) -> torch.Tensor:
    rows, n = w_sorted.shape
    num_labels = int(lab_sorted.max()) + 1
    ar = torch.arange(rows)
    load = torch.zeros(rows, num_packs)
    count = torch.zeros(rows, num_packs, dtype=torch.int64)
    holds = torch.zeros(rows, num_packs, num_labels, dtype=torch.bool)
    pack_sorted = torch.full((rows, n), -1, dtype=torch.int64)
    for i in range(n):
        lab = lab_sorted[:, i]
        blocked = (count >= per_pack) | holds[ar, :, lab]
        pack = load.masked_fill(blocked, _INF).argmin(dim=1)
        stuck = blocked[ar, pack]
        if bool(stuck.any()):
            _unstick(i, stuck, per_pack, w_sorted, lab_sorted, pack_sorted, load, count, holds)
        free = ~stuck
        rows_f, pack_f = ar[free], pack[free]
        pack_sorted[rows_f, i] = pack_f
        load[rows_f, pack_f] += w_sorted[rows_f, i]
        count[rows_f, pack_f] += 1
        holds[rows_f, pack_f, lab[free]] = True
    return pack_sorted


def _unstick(i, stuck, per_pack, w_sorted, lab_sorted, pack_sorted, load, count, holds) -> None:
    """Place item i in rows where every open pack already holds its label.

    Take the lightest open pack p; move an earlier item y from a pack q that lacks item i's label
    into p (p must lack y's label) and put item i in q. Such a y always exists when no label has
    more items than there are packs: p is open, so it holds fewer labels than q has items, and q
    lacks item i's label because fewer than num_packs packs hold it. Among the valid y, pick the
    one that keeps max(load p, load q) smallest.
    """
    rows_s = stuck.nonzero().squeeze(1)
    lab = lab_sorted[rows_s, i]
    w_i = w_sorted[rows_s, i]
    p = load[rows_s].masked_fill(count[rows_s] >= per_pack, _INF).argmin(dim=1)
    placed = pack_sorted[rows_s, :i]  # [s, i]
    lab_y = lab_sorted[rows_s, :i]
    w_y = w_sorted[rows_s, :i]
    q_holds_lab = holds[rows_s[:, None], placed, lab[:, None]]
    p_holds_y = holds[rows_s[:, None], p[:, None], lab_y]
    valid = (placed != p[:, None]) & ~q_holds_lab & ~p_holds_y
    new_p = load[rows_s, p][:, None] + w_y
    new_q = load[rows_s[:, None], placed] - w_y + w_i[:, None]
    cost = torch.maximum(new_p, new_q).masked_fill(~valid, _INF)
    y = cost.argmin(dim=1)
    sel = torch.arange(len(rows_s))
    if not bool(valid[sel, y].all()):
        raise AssertionError("distinct packing found no swap; a label has more items than packs")
    q, ly, wy = (t[sel, y] for t in (placed, lab_y, w_y))
    # y: q -> p, item i -> q.
    pack_sorted[rows_s, y] = p
    pack_sorted[rows_s, i] = q
    load[rows_s, p] += wy
    load[rows_s, q] += w_i - wy
    count[rows_s, p] += 1
    holds[rows_s, q, ly] = False
    holds[rows_s, p, ly] = True
    holds[rows_s, q, lab] = True
