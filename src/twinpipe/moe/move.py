"""Apply a new placement to a live MoE block (any ``ExpertExchange``: ``MoEBlock``, or a
``transformers`` block sharded by ``twinpipe.hf.experts.EPMoE``): move only the expert weights (and
optimizer state) whose slot changes, with one all-to-all over the block's EP group. A block says
which tensors hold one slot's state (``_slot_tensors``) and drops a refilled slot's gradient
(``_drop_slot_grads``); the plan and the transfer are the same for every kind of block.

The plan is a pure function of (old placement, new placement, EP size), so every rank computes
the same one without talking. A rank fetches each expert it lacks once, even when it needs
several replicas of it; a slot whose expert the rank already holds is filled by a local copy;
the senders of each fetched expert are spread over the ranks that hold it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from twinpipe.moe.agree import agree, ep_timeout, frame_device
from twinpipe.moe.exchange import ExpertExchange
from twinpipe.moe.placement import check_placement
from twinpipe.runtime.collectives import collective

__all__ = ["MovePlan", "MoveReport", "plan_moves", "apply_placement_", "check_optimizer_holds_experts", "regroup_rows"]


@dataclass(frozen=True)
class MovePlan:
    """``transfers``: (source rank, destination rank, expert, source slot), one per expert a rank
    must fetch; ``fills``: (slot, expert, source) for every slot whose expert changes, source
    ``("recv", rank)`` or ``("copy", old slot on the same rank)``."""

    transfers: tuple
    fills: tuple


@dataclass(frozen=True)
class MoveReport:
    """What one block's move did: slots refilled, experts sent between ranks, bytes (all ranks)
    actually sent and what sending every slot's expert would have cost; ``sent`` lists each
    transfer as (expert, source rank, destination rank)."""

    slots_changed: int
    transfers: int
    local_copies: int
    bytes_sent: int
    bytes_all: int
    sent: tuple = ()


def plan_moves(old: torch.Tensor, new: torch.Tensor, ep: int) -> MovePlan:
    """The moves that turn placement ``old`` [R] into ``new`` [R] on ``ep`` ranks (R / ep slots each)."""
    old, new = old.tolist(), new.tolist()
    local = len(old) // ep
    held = [{} for _ in range(ep)]  # rank -> expert -> first old slot holding it
    for s, e in enumerate(old):
        held[s // local].setdefault(e, s)
    need = sorted({(e, s // local) for s, e in enumerate(new) if old[s] != e and e not in held[s // local]})
    sends = [0] * ep
    source = {}
    transfers = []
    for e, dst in need:  # spread the sending over the holders: fewest sends so far, then lowest rank
        src = min((r for r in range(ep) if e in held[r]), key=lambda r: (sends[r], r))
        sends[src] += 1
        source[(dst, e)] = src
        transfers.append((src, dst, e, held[src][e]))
    fills = []
    for s, e in enumerate(new):
        if old[s] == e:
            continue
        r = s // local
        fills.append((s, e, ("copy", held[r][e]) if e in held[r] else ("recv", source[(r, e)])))
    return MovePlan(tuple(transfers), tuple(fills))


def _as_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).contiguous().view(torch.uint8) for t in tensors])


def _write(tensors: list[torch.Tensor], data: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel() * t.element_size()
            t.copy_(data[offset : offset + n].clone().view(t.dtype).view(t.shape))
            offset += n


def _slot_state(slots: list[list[torch.Tensor]]) -> tuple[int, str]:
    """Bytes of one slot's state and a description of its tensors (shapes, dtypes), or ValueError
    if this rank's slots differ (an optimizer stepped for some experts only)."""
    layouts = {tuple((tuple(t.shape), t.dtype) for t in ts) for ts in slots}
    sizes = {sum(t.numel() * t.element_size() for t in ts) for ts in slots}
    if len(layouts) != 1:
        raise ValueError(f"the slots of this MoE block hold different state ({sorted(sizes)} bytes): "
                         "step the optimizer for all experts, or for none, before moving them")
    size, layout = sizes.pop(), layouts.pop()
    return size, f"{size} bytes: " + ", ".join(f"{str(d).removeprefix('torch.')}{list(shape)}" for shape, d in layout)


def check_optimizer_holds_experts(optimizer, block: ExpertExchange) -> None:
    """ValueError unless ``optimizer`` (or None) updates ``block``'s expert parameters themselves: an
    optimizer over other tensors (FP32 masters under mixed precision) or over some parameters only
    (ZeRO-1's owned share) keeps state a move cannot find: it would stay with the old slots while
    the weights moved."""
    if optimizer is None:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, p in block.experts.named_parameters() if id(p) not in held]
    if missing:
        raise ValueError(f"optimizer={type(optimizer).__name__}: must update the MoE block's expert parameters themselves "
                         f"(it does not hold experts.{missing[0]}: an optimizer over FP32 masters, or ZeRO-1's share?), "
                         "so that their state can move with the weights")


def apply_placement_(block: ExpertExchange, phy2log, optimizer=None, timeout: float | None = None) -> MoveReport:
    """Make ``block`` run placement ``phy2log`` [R] (same R, same experts), moving weights and, with
    ``optimizer``, its state tensors for them; the gradients of refilled slots are dropped. Call on
    every rank of the block's EP group with the same ``phy2log``, between training steps. First the
    ranks compare their blocks and arguments: if any differ (or a rank rejects its ``phy2log``),
    every rank raises ValueError naming the ranks and what differs, and nothing moves. Each
    collective waits at most ``timeout`` seconds (PipelineTimeoutError naming the rank; default: the
    limit in force, see ``twinpipe.runtime.waits``, else ``twinpipe.checks.DEFAULT_TIMEOUT``)."""
    if not isinstance(block, ExpertExchange):
        raise ValueError(f"block={type(block).__name__}: must be a MoE block with expert slots (a MoEBlock, "
                         "or a transformers block sharded by twinpipe.hf.experts.shard_experts_)")
    timeout = ep_timeout(timeout)
    slots = [block._slot_tensors(i, optimizer) for i in range(block.local)]
    new, state, rejected = None, None, None
    try:
        check_optimizer_holds_experts(optimizer, block)
        new = check_placement(phy2log, block.num_experts, block.num_slots, block.ep)
        size, state = _slot_state(slots)
    except ValueError as exc:
        rejected = exc
    if block.ep > 1:  # the plan and the all-to-all's sizes follow from these: every rank must hold the same
        facts = {"num_experts": block.num_experts, "num_slots": block.num_slots, "current phy2log": block.phy2log.tolist(),
                 "phy2log": None if new is None else new.tolist(), "expert state": state}
        agree(block.ep_group, facts, "apply_placement_", timeout, frame_device(slots[0][0]), rejected)
    elif rejected is not None:
        raise rejected
    old = block.phy2log
    plan = plan_moves(old, new, block.ep)
    rank, first = block.ep_rank, block.first_slot
    received: dict[tuple[int, int], torch.Tensor] = {}
    if plan.transfers:
        out = [t for t in plan.transfers if t[0] == rank]
        into = [t for t in plan.transfers if t[1] == rank]
        send_splits = [size * sum(1 for t in out if t[1] == r) for r in range(block.ep)]
        recv_splits = [size * sum(1 for t in into if t[0] == r) for r in range(block.ep)]
        device = slots[0][0].device
        outgoing = sorted(out, key=lambda t: t[1])  # destination-major, plan order within
        send = torch.cat([_as_bytes(slots[t[3] - first]) for t in outgoing]) if outgoing else torch.empty(0, dtype=torch.uint8, device=device)
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
        collective(dist.all_to_all_single, recv, send, recv_splits, send_splits, group=block.ep_group, timeout=timeout,
                   what=f"apply_placement_: EP rank {rank} waiting for its peers in the expert all-to-all")
        for i, t in enumerate(sorted(into, key=lambda t: t[0])):
            received[(t[0], t[2])] = recv[i * size : (i + 1) * size]
    mine = [f for f in plan.fills if f[0] // block.local == rank]
    snapshot = {src: _as_bytes(slots[src - first]).clone() for _, _, (kind, src) in mine if kind == "copy"}
    for slot, expert, (kind, src) in mine:
        data = snapshot[src] if kind == "copy" else received[(src, expert)]
        _write(slots[slot - first], data)
        block._drop_slot_grads(slot - first)
    block._set_placement(new)
    copies = sum(1 for f in plan.fills if f[2][0] == "copy")
    return MoveReport(len(plan.fills), len(plan.transfers), copies, size * len(plan.transfers), size * len(new),
                      tuple((e, src, dst) for src, dst, e, _ in plan.transfers))


def regroup_rows(local: torch.Tensor, have, want, group, timeout: float | None = None) -> torch.Tensor:
    """Rows of one tensor per slot laid out by placement ``have`` [S] re-laid out by ``want`` [S']:
    ``local`` is this rank's ``S/ep`` rows (slot order), the result its ``S'/ep`` rows, row i holding
    the row of logical expert ``want[rank * S'/ep + i]`` from the lowest slot of ``have`` holding it.
    Checkpoints use it both ways between a placement and the identity (one row per expert, by id).
    Collective over ``group`` (None: one rank): one all-to-all, the plan computed alike by every rank
    from the two placements, which every rank of the group must pass alike."""
    have, want = torch.as_tensor(have).tolist(), torch.as_tensor(want).tolist()
    ep = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    held, got = len(have) // ep, len(want) // ep
    first: dict[int, int] = {}
    for slot, expert in enumerate(have):
        first.setdefault(expert, slot)
    source = [first[e] for e in want]  # for every wanted row, the slot it comes from
    if ep == 1:
        return local.index_select(0, torch.tensor(source, device=local.device))
    # To each rank, in its row order, the rows it wants from this one; from each rank, the rows it sends here.
    send = [s - rank * held for d in range(ep) for s in source[d * got : (d + 1) * got] if s // held == rank]
    send_splits = [sum(1 for s in source[d * got : (d + 1) * got] if s // held == rank) for d in range(ep)]
    mine = source[rank * got : (rank + 1) * got]
    recv_splits = [sum(1 for s in mine if s // held == r) for r in range(ep)]
    out = local.new_empty((sum(recv_splits), *local.shape[1:]))
    collective(dist.all_to_all_single, out, local.index_select(0, torch.tensor(send, dtype=torch.long, device=local.device)),
               recv_splits, send_splits, group=group, timeout=ep_timeout(timeout),
               what=f"regroup_rows: EP rank {rank} waiting for its peers in the expert-rows all-to-all")
    # ``out`` holds the rows by source rank, each source's in this rank's row order: put them in row order.
    order = sorted(range(got), key=lambda i: (mine[i] // held, i))
    back = torch.empty(got, dtype=torch.long)
    back[torch.tensor(order, dtype=torch.long)] = torch.arange(got)
    return out.index_select(0, back.to(out.device))
