"""Local search after the greedy packing: swap items between the heaviest pack and the others."""

from __future__ import annotations

import torch

_INF = float("inf")

# A swap must lower the heavier of its two packs by this fraction of the max load. The margin is far
# above float32 rounding of a pack sum, so a recomputed max load can never go up.
_REL_GAIN = 4e-6

# Elements of one [rows, k, n] pair tensor (16 MB of float32).
_MAX_PAIRS = 2**22


def refine_swaps(
    weight: torch.Tensor,
    pack: torch.Tensor,
    num_packs: int,
    labels: torch.Tensor | None = None,
    max_rounds: int | None = None,
) -> torch.Tensor:
    """Lower the max pack load by pairwise swaps; returns a new ``pack`` [rows, n].

    Each round, in every row at once: take the heaviest pack a (load La); over all items x in a and
    y in another pack b (load Lb), swapping moves d = w_x - w_y from a to b, so the pair's new max is
    max(La - d, Lb + d). Apply the swap that minimises it if that is below La. Pack sizes never
    change, and each accepted swap lowers the sorted vector of pack loads, so the search ends; it
    stops after ``max_rounds`` (default 8 x num_packs) in any case. With ``labels`` a swap may not
    put two equal labels in one pack.
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    pack = pack.clone()
    if per_pack == 1 or num_packs == 1:
        return pack
    if max_rounds is None:
        max_rounds = 8 * num_packs  # about 1.5 x num_packs rounds are used on the benchmark loads
    # Rows are independent: search a few at a time so the [rows, k, n] pair tensors stay small.
    chunk = max(1, _MAX_PAIRS // (per_pack * n))
    for start in range(0, rows, chunk):
        part = slice(start, start + chunk)
        pack[part] = _refine_rows(
            weight[part], pack[part], num_packs, None if labels is None else labels[part], max_rounds
        )
    return pack


def _refine_rows(weight, pack, num_packs, labels, max_rounds) -> torch.Tensor:
    rows, n = weight.shape
    per_pack = n // num_packs
    ar = torch.arange(rows)
    slot_in_pack = torch.arange(n)
    num_labels = int(labels.max()) + 1 if labels is not None else 0
    active = torch.ones(rows, dtype=torch.bool)
    for _ in range(max_rounds):
        load = torch.zeros(rows, num_packs).scatter_add_(1, pack, weight)
        heavy = load.argmax(dim=1)
        heavy_load = load[ar, heavy]
        members = (pack * n + slot_in_pack).argsort(dim=1).view(rows, num_packs, per_pack)
        xs = members[ar, heavy]  # [rows, k] items in the heaviest pack
        delta = weight.gather(1, xs)[:, :, None] - weight[:, None, :]  # [rows, k, n]
        other_load = load.gather(1, pack)[:, None, :]
        # Items y in the heavy pack itself give max >= La, so they never win.
        pair_max = torch.maximum(heavy_load[:, None, None] - delta, other_load + delta)
        if labels is not None:
            pair_max = pair_max.masked_fill(
                ~_swap_keeps_distinct(pack, labels, xs, heavy, num_packs, num_labels), _INF
            )
        best = pair_max.view(rows, -1).min(dim=1)
        improve = active & (best.values < heavy_load * (1 - _REL_GAIN))
        if not bool(improve.any()):
            break
        active = improve  # a row with no improving swap stays put
        rows_i = ar[improve]
        idx = best.indices[improve]
        x = xs[rows_i, idx // n]
        y = idx % n
        target = pack[rows_i, y]
        pack[rows_i, x] = target
        pack[rows_i, y] = heavy[improve]
    return pack


def _swap_keeps_distinct(pack, labels, xs, heavy, num_packs, num_labels) -> torch.Tensor:
    """[rows, k, n] mask: swapping x (in the heavy pack) with y keeps every pack's labels distinct."""
    rows = pack.size(0)
    holds = torch.zeros(rows, num_packs * num_labels, dtype=torch.bool)
    holds.scatter_(1, pack * num_labels + labels, True)
    lab_x = labels.gather(1, xs)  # [rows, k]
    x_in_target = holds.gather(
        1, (pack[:, None, :] * num_labels + lab_x[:, :, None]).view(rows, -1)
    ).view(lab_x.shape + (pack.size(1),))
    y_in_heavy = holds.gather(1, heavy[:, None] * num_labels + labels)  # [rows, n]
    same = lab_x[:, :, None] == labels[:, None, :]
    return same | (~x_in_target & ~y_in_heavy[:, None, :])
