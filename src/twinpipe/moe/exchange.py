"""The expert-parallel exchange of a MoE layer, shared by every MoE block that shards its routed
experts over an EP group (``twinpipe.moe.MoEBlock``, ``twinpipe.hf.experts.EPMoE``).

``ExpertExchange`` holds the placement (``phy2log``: R physical slots sharded over the group, rank
r holding slots ``r*R/ep .. (r+1)*R/ep - 1``; placement.py) and declares the communication parts
of a block: ``counts`` (how many copies each rank sends to each slot), ``dispatch`` and
``combine`` (the all-to-alls of the token rows, there and back). Their state is
``(a, b, rows, weights, route, *extra)``: ``rows`` move, the rest passes through. A host class sets
``ep_group``, ``ep``, ``ep_rank``, ``local``, ``num_experts``, ``top_k``, ``hidden``, a
``routed_tokens`` buffer [E], ``experts`` (a module holding the local slots' parameters), and
defines ``_layout()`` (what every EP rank must agree on), ``_zeros(rows)`` (a zero row block in the
rows' dtype and device), ``_slot_numel()`` and ``_slot_grads(i)`` (one slot's parameter count and
gradient tensors, for ``twinpipe.moe.reduce_replica_grads``), ``_slot_tensors(i, optimizer)`` and
``_drop_slot_grads(i)`` (one slot's weights and optimizer state, written in place, and dropping its
gradient: for ``twinpipe.moe.apply_placement_``) and ``reset_counts()``.
"""

from __future__ import annotations

import copy
from dataclasses import KW_ONLY, dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.moe.agree import agree, ep_timeout, frame_device
from twinpipe.moe.local import LocalEPRank
from twinpipe.moe.placement import replica_table, slots_of_copies
from twinpipe.overlap.comm import Then, all_to_all
from twinpipe.overlap.parts import Comm, Compute

__all__ = ["ExpertExchange", "optimizer_state"]


def optimizer_state(p: torch.Tensor, optimizer) -> list[torch.Tensor]:
    """The tensors of ``optimizer``'s state for parameter ``p`` (keys sorted; none without an
    optimizer or before its first step): what moves with an expert's weights."""
    state = optimizer.state.get(p, {}) if optimizer is not None else {}
    return [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]


@dataclass(frozen=True)
class _Route:
    """Where one micro-batch's token copies go (set by attn) and what came back (set by dispatch)."""

    shape: tuple  # (batch, seq, hidden) of the block input
    order: torch.Tensor  # token copies (token*k + j) sorted by physical slot, stable
    counts: torch.Tensor  # [R] copies this rank sends to each slot ([R, k]: per slot and choice)
    _: KW_ONLY
    send: list | None = None  # rows to each rank
    recv: list | None = None  # rows from each rank
    recv_counts: torch.Tensor | None = None  # [ep, local slots] rows from each rank for each local slot
    experts: torch.Tensor | None = None  # [T, k] the router's choices, where a block's mix needs them
    recv_choice: torch.Tensor | None = None  # [ep, local slots, k] with counts per (slot, choice)


class _Permute(torch.autograd.Function):
    """Rows reordered by a permutation; the backward gathers with the inverse (no zero fill, no
    scatter-add as ``index_select``'s backward would do)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.inverse = inverse
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.inverse), None, None


def _permute(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return _Permute.apply(x, perm, inverse)


# The state the exchange parts pass on: (hidden, tokens, rows, weights, route, *extra): the rows
# sent and received sit at ROWS, the ``_Route`` (split sizes) at ROUTE.
ROWS, ROUTE = 2, 4


class ExpertExchange(nn.Module):
    """Placement and communication parts of an expert-parallel MoE block (see the module doc)."""

    def exchange_parts_with(self, experts: Compute, mix: Compute) -> list:
        """The parts after routing, the same for every block: counts, dispatch, the block's
        ``experts`` compute, combine, then its ``mix`` (a block puts its routing part before them)."""
        return [
            Comm("counts", self._counts),
            Comm("dispatch", self._dispatch, self._dispatch_backward),
            experts,
            Comm("combine", self._combine, self._combine_backward),
            mix,
        ]

    @staticmethod
    def _check_group(ep_group, num_slots: int) -> tuple[int, int]:
        if ep_group is None:
            return 1, 0
        if isinstance(ep_group, LocalEPRank):
            ep, rank = ep_group.size, ep_group.rank
        else:
            ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if num_slots % ep:
            raise ValueError(f"ep_group has {ep} ranks, which does not divide the {num_slots} expert slots")
        return ep, rank

    @staticmethod
    def _group_size(ep_group) -> int:
        if ep_group is None:
            return 1
        return ep_group.size if isinstance(ep_group, LocalEPRank) else dist.get_world_size(ep_group)

    def _all_to_all(self, rows: torch.Tensor, out_splits: list, in_splits: list):
        """``twinpipe.overlap.comm.all_to_all`` over ``ep_group`` (in-process for a local EP rank)."""
        if isinstance(self.ep_group, LocalEPRank):
            return self.ep_group.all_to_all(rows, out_splits, in_splits)
        return all_to_all(rows, out_splits, in_splits, self.ep_group)

    @property
    def phy2log(self) -> torch.Tensor:
        """[R] the logical expert of each physical slot (a copy)."""
        return self._phy2log.clone()

    @property
    def num_slots(self) -> int:
        return len(self._phy2log)

    def _set_placement(self, phy2log: torch.Tensor) -> None:
        """Adopt ``phy2log`` (checked by the caller); the slot modules must already match it."""
        device = self.routed_tokens.device
        self._phy2log = phy2log.clone()
        log2phy, logcnt = replica_table(phy2log, self.num_experts)
        self._log2phy, self._logcnt = log2phy.to(device), logcnt.to(device)
        self._layout_agreed = False  # the next forward compares the layout over the EP group

    def _agree_layout(self) -> None:
        """Compare ``_layout()`` over the EP group before the first all-to-all with a placement.

        Every EP rank comes here at the same point (the first forward after the block was built
        or re-placed: placements change only through calls every rank makes), so this fixed-size
        check pairs with itself; once agreed, the all-to-alls' sizes follow from agreed facts."""
        if self.ep > 1 and not self._layout_agreed and not isinstance(self.ep_group, LocalEPRank):
            agree(self.ep_group, self._layout(), type(self).__name__, ep_timeout(None), frame_device(self.routed_tokens))
            self._layout_agreed = True

    def __deepcopy__(self, memo):
        """A copy that shares the EP process group (a handle, which cannot be copied); a local EP
        rank (``twinpipe.moe.local``) is copied as before."""
        if self.ep_group is not None and not isinstance(self.ep_group, LocalEPRank):
            memo.setdefault(id(self.ep_group), self.ep_group)
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def _apply(self, fn, *args, **kwargs):
        """Keep the replica tables on the module's device (made again from ``phy2log``, which stays
        on the CPU: a block built on the meta device has no table values to move); counters that
        come off the meta device (``to_empty``) start at zero."""
        was_meta = self.routed_tokens.is_meta
        out = super()._apply(fn, *args, **kwargs)
        device = self.routed_tokens.device
        log2phy, logcnt = replica_table(self._phy2log, self.num_experts)
        self._log2phy, self._logcnt = log2phy.to(device), logcnt.to(device)
        if was_meta and not self.routed_tokens.is_meta:
            self.reset_counts()
        return out

    def _route_copies(self, tokens: torch.Tensor, experts: torch.Tensor, shape: tuple, by_choice: bool = False):
        """``experts [T, k]`` (logical ids, the router's order) -> ``(sent, route)``: the token
        rows of the copies sorted by physical slot (stable; slot of each copy by
        ``slots_of_copies``), and the route with this rank's counts per slot. ``by_choice``: sorted
        by (slot, choice j) instead, counts per (slot, j) ``[R, k]`` (the receiver can then order
        a slot's rows choice by choice, as ``transformers``' eager experts loop does)."""
        flat = experts.reshape(-1)
        slots = slots_of_copies(flat, self._log2phy, self._logcnt, self.ep_rank)
        if by_choice:
            key = slots * self.top_k + torch.arange(len(flat), device=flat.device) % self.top_k
            order = torch.argsort(key, stable=True)
            counts = torch.bincount(key, minlength=self.num_slots * self.top_k).view(self.num_slots, self.top_k)
        else:
            order = torch.argsort(slots, stable=True)
            counts = torch.bincount(slots, minlength=self.num_slots)
        sent = tokens.index_select(0, order // self.top_k)
        self.routed_tokens += torch.bincount(flat, minlength=self.num_experts)
        return sent, _Route(tuple(shape), order, counts)

    def _counts(self, h, tokens, sent, weights, route, *extra):
        sub = route.counts[0].numel()  # 1, or k with counts per (slot, choice)

        def arrived(received):
            received = received.view(self.ep, self.local, sub)
            full = replace(route, send=route.counts.reshape(self.ep, -1).sum(1).tolist(),
                           recv=received.sum((1, 2)).tolist(), recv_counts=received.sum(2),
                           recv_choice=received if route.counts.dim() > 1 else None)
            return (h, tokens, sent, weights, full, *extra), None

        self._agree_layout()
        each = [self.local * sub] * self.ep
        return Then(self._all_to_all(route.counts.reshape(-1), each, each), arrived)

    def _dispatch(self, *state):
        return self._move(state, state[ROUTE].recv, state[ROUTE].send)

    def _dispatch_backward(self, route, grads):
        return self._move_back(grads, route.recv, route.send)

    def _combine(self, *state):
        return self._move(state, state[ROUTE].send, state[ROUTE].recv)

    def _combine_backward(self, route, grads):
        return self._move_back(grads, route.send, route.recv)

    def _move(self, state: tuple, out_splits: list, in_splits: list):
        """Start sending the rows in ``state[ROWS]`` (``in_splits`` to each rank, ``out_splits`` from
        each); ``wait()`` gives the state with the rows that arrived, and the route as ctx."""
        rows, route = state[ROWS], state[ROUTE]

        def arrived(got):
            if got is not rows:  # with one rank the rows stay where they are
                got.requires_grad_(rows.requires_grad)
            return (*state[:ROWS], got, *state[ROWS + 1:]), route

        return Then(self._all_to_all(rows.detach() if self.ep > 1 else rows, out_splits, in_splits), arrived)

    def _move_back(self, grads: tuple, out_splits: list, in_splits: list):
        """The backward of ``_move(state, out_splits, in_splits)``: the row gradients go back."""
        g_rows = grads[ROWS] if grads[ROWS] is not None else self._zeros(sum(out_splits))
        return Then(self._all_to_all(g_rows, in_splits, out_splits), lambda g: (*grads[:ROWS], g, *grads[ROWS + 1:]))

    def _grouping(self, route) -> tuple[torch.Tensor, list[int]]:
        """The received rows (source-major) in expert-major order, and each local expert's count."""
        counts = route.recv_counts  # [ep, local]: rows from each rank for each local expert
        flat = counts.reshape(-1)
        starts = (torch.cumsum(flat, 0) - flat).view(self.ep, self.local)
        seg_start, seg_len = starts.t().reshape(-1), counts.t().reshape(-1)  # segments, expert-major
        ends = torch.cumsum(seg_len, 0)
        within = torch.arange(int(ends[-1]), device=counts.device) - torch.repeat_interleave(ends - seg_len, seg_len)
        return torch.repeat_interleave(seg_start, seg_len) + within, counts.sum(0).tolist()
