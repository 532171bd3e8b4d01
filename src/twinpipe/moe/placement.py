"""Physical expert slots: which logical expert each slot runs, and which slot a token copy goes to.

A placement is ``phy2log`` [R]: slot s runs logical expert ``phy2log[s]`` and lives on EP rank
``s // (R / ep)``. Every logical expert has at least one slot; the slots of one expert
(its replicas) hold identical weights.

The spreading rule (one place, used by every block): the n-th copy (n = 0, 1, ..., in token
order) that an EP rank routes to expert e goes to replica ``(n + rank) % logcnt[e]``, replicas
ordered by slot index. It is deterministic and splits each rank's copies of e evenly (within
one) over e's replicas; the offset by rank spreads the remainders of different ranks.
"""

from __future__ import annotations

import torch

__all__ = ["check_placement", "replica_table", "slots_of_copies"]


def check_placement(phy2log, num_experts: int, num_slots: int | None = None, ep: int = 1) -> torch.Tensor:
    """``phy2log`` as a 1-D int64 CPU tensor, or ValueError naming what is wrong."""
    try:
        p = torch.as_tensor(phy2log)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"phy2log={phy2log!r}: must be a 1-D sequence of expert ids ({exc})") from None
    if p.dim() != 1 or p.numel() == 0 or p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
        raise ValueError(f"phy2log has shape {tuple(p.shape)} and dtype {p.dtype}: must be a non-empty 1-D integer tensor")
    p = p.to(torch.int64).cpu()
    if num_slots is not None and p.numel() != num_slots:
        raise ValueError(f"phy2log has {p.numel()} slots; this layer runs num_slots={num_slots} "
                         "(a placement for a different slot count)")
    if p.numel() % ep:
        raise ValueError(f"phy2log has {p.numel()} slots, not a multiple of the {ep} EP ranks")
    if int(p.min()) < 0 or int(p.max()) >= num_experts:
        raise ValueError(f"phy2log holds expert ids {int(p.min())}..{int(p.max())}; allowed: 0..{num_experts - 1} "
                         f"(num_experts={num_experts}: a placement for a different expert count?)")
    missing = torch.nonzero(torch.bincount(p, minlength=num_experts) == 0).reshape(-1)
    if len(missing):
        raise ValueError(f"phy2log gives no slot to experts {missing.tolist()[:8]}: every one of the "
                         f"num_experts={num_experts} experts needs at least one")
    return p


def replica_table(phy2log: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log2phy [E, max count], logcnt [E])``: the slots of each expert in ascending order, padded with -1."""
    logcnt = torch.bincount(phy2log, minlength=num_experts)
    order = torch.argsort(phy2log, stable=True)  # slots grouped by expert, ascending within
    rank = torch.arange(len(phy2log)) - (torch.cumsum(logcnt, 0) - logcnt)[phy2log[order]]
    log2phy = torch.full((num_experts, int(logcnt.max())), -1, dtype=torch.int64)
    log2phy[phy2log[order], rank] = order
    return log2phy, logcnt


def slots_of_copies(experts: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, rank: int) -> torch.Tensor:
    """The slot of each token copy (``experts`` [n] logical ids in token order), by the module's rule."""
    if log2phy.size(1) == 1:  # no replicas: slot = the expert's only slot
        return log2phy[experts, 0]
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=len(logcnt))
    sorted_e = experts[order]
    nth_sorted = torch.arange(len(experts), device=experts.device) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    nth = torch.empty_like(nth_sorted).scatter_(0, order, nth_sorted)
    return log2phy[experts, (nth + rank) % logcnt[experts]]
