"""A MoE transformer block with expert parallelism, declared as six parts for the overlap engine:

    attn (compute)   x -> h = x + attention(norm(x)); route norm(h); sort token copies by expert
    counts (comm)    exchange how many copies each rank sends to each expert (nothing in backward)
    dispatch (comm)  all-to-all the token copies to the experts' ranks
    mlp (compute)    local experts on what arrived (grouped by expert); shared expert on local tokens
    combine (comm)   all-to-all the expert outputs back
    mix (compute)    out = h + shared + sum_j weight_j * expert_output_j

The routed experts run as R physical slots sharded over ``ep_group`` (rank r holds slots
``r*R/ep .. (r+1)*R/ep - 1``), slot s running logical expert ``phy2log[s]`` (placement.py: the
placement and the rule that spreads an expert's token copies over its replicas). By default
R = E and slot s runs expert s. With no group (or one rank) nothing is communicated. Dropless:
every token copy reaches a replica of its expert.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twinpipe.checks import bad, check_int
from twinpipe.moe.agree import agree, ep_timeout, frame_device
from twinpipe.moe.local import LocalEPRank
from twinpipe.moe.placement import check_placement, replica_table, slots_of_copies
from twinpipe.moe.router import TopKRouter
from twinpipe.overlap.comm import Then, all_to_all
from twinpipe.overlap.graph import run_parts
from twinpipe.overlap.parts import Comm, Compute
from twinpipe.runtime.weight_grad import DeferredLinear

__all__ = ["MoEBlock", "FeedForward", "run_expert", "MIN_EXPERT_ROWS"]


class FeedForward(nn.Module):
    """``down(gelu(up(x)))``, or with ``swiglu`` ``down(silu(gate(x)) * up(x))`` (DeepSeek's
    experts); no biases; weight gradients deferrable to W."""

    def __init__(self, hidden: int, inner: int, swiglu: bool = False):
        super().__init__()
        self.up = DeferredLinear(hidden, inner, bias=False)
        self.gate = DeferredLinear(hidden, inner, bias=False) if swiglu else None
        self.down = DeferredLinear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.down(F.gelu(self.up(x)))
        return self.down(F.silu(self.gate(x)) * self.up(x))


# An expert runs on at least this many rows (zero rows appended): on CPU, MKL computes products of
# fewer than 4 rows with other kernels. It does not make a token's result independent of the rows
# that share its slot: a BLAS product's row can depend on how many rows the product has and where
# the row sits (on the AVX-512 CI machine MKL computes the last rows % 4 rows of a float64 product
# with another kernel). So exact references run each slot on the same rows in the same order
# (docs/moe-overlap.md, "The order of every sum").
MIN_EXPERT_ROWS = 8


def run_expert(expert: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """``expert(rows)`` computed as a single process holding every expert computes it."""
    n = len(rows)
    if 0 < n < MIN_EXPERT_ROWS:
        return expert(torch.cat([rows, rows.new_zeros(MIN_EXPERT_ROWS - n, *rows.shape[1:])]))[:n]
    return expert(rows.clone())  # a fresh tensor: BLAS results may depend on a slice's alignment


@dataclass(frozen=True)
class _Route:
    """Where one micro-batch's token copies go (set by attn) and what came back (set by dispatch)."""

    shape: tuple  # (batch, seq, hidden) of the block input
    order: torch.Tensor  # token copies (token*k + j) sorted by physical slot, stable
    counts: torch.Tensor  # [R] copies this rank sends to each slot
    send: list | None = None  # rows to each rank
    recv: list | None = None  # rows from each rank
    recv_counts: torch.Tensor | None = None  # [ep, local slots] rows from each rank for each local slot


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


class MoEBlock(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a routed mixture of experts.

    ``num_experts`` routed experts of width ``expert_hidden`` (``swiglu`` for DeepSeek's gated
    experts), ``top_k`` per token, chosen by ``TopKRouter`` (``score``, ``groups``/``top_groups``,
    ``normalize``, ``route_scale``); a shared expert of width ``shared_hidden`` if > 0; the routed
    experts sharded over ``ep_group`` (None: all local, no communication), one slot per expert;
    ``shard_experts_(group, phy2log)`` or ``twinpipe.moe.apply_placement_`` place replicas.
    ``ep_group`` may also be a rank of a ``twinpipe.moe.local.LocalEPGroup`` (EP ranks simulated in
    one process, run in lock-step: a reference's).
    """

    def __init__(self, hidden: int, heads: int, num_experts: int, top_k: int, expert_hidden: int, *,
                 shared_hidden: int = 0, score: str = "softmax", groups: int = 1, top_groups: int | None = None,
                 normalize: bool | None = None, route_scale: float = 1.0, swiglu: bool = False, ep_group=None):
        super().__init__()
        check_int(hidden, "hidden", low=1)
        check_int(expert_hidden, "expert_hidden", low=1)
        check_int(shared_hidden, "shared_hidden", low=0, why="0: no shared expert")
        check_int(heads, "heads", low=1, why=f"dividing hidden ({hidden})")
        if hidden % heads:
            raise bad("heads", heads, f"must divide hidden ({hidden})")
        self.router = TopKRouter(hidden, num_experts, top_k, score, groups, top_groups, normalize, route_scale)
        ep, rank = self._check_group(ep_group, num_experts)
        self.hidden, self.heads, self.num_experts, self.top_k = hidden, heads, num_experts, top_k
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = DeferredLinear(hidden, 3 * hidden, bias=False)
        self.proj = DeferredLinear(hidden, hidden, bias=False)
        self.shared = FeedForward(hidden, shared_hidden, swiglu) if shared_hidden else None
        self.ep_group, self.ep, self.ep_rank = ep_group, ep, rank
        self.local = num_experts // ep  # slots per rank
        self.experts = nn.ModuleList(FeedForward(hidden, expert_hidden, swiglu) for _ in range(self.local))
        self.first_expert = self.first_slot = rank * self.local
        # Token copies this rank routed to each logical expert, and rows each local slot ran on,
        # summed over forwards until reset_counts().
        self.register_buffer("routed_tokens", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("expert_rows", torch.zeros(self.local, dtype=torch.long), persistent=False)
        self._set_placement(torch.arange(num_experts))

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

    def _layout(self) -> dict:
        """What this block's EP collectives follow from (their sizes, and which expert each slot
        runs): every EP rank must hold the same."""
        w = self.proj.weight
        return {"num_experts": self.num_experts, "num_slots": self.num_slots, "hidden": self.hidden,
                "dtype": str(w.dtype).removeprefix("torch."), "phy2log": self._phy2log.tolist(),
                "expert parameters": sum(p.numel() for p in self.experts[0].parameters())}

    def _agree_layout(self) -> None:
        """Compare ``_layout()`` over the EP group before the first all-to-all with a placement.

        Every EP rank comes here at the same point (the first forward after the block was built
        or re-placed: placements change only through calls every rank makes), so this fixed-size
        check pairs with itself; once agreed, the all-to-alls' sizes follow from agreed facts."""
        if self.ep > 1 and not self._layout_agreed and not isinstance(self.ep_group, LocalEPRank):
            agree(self.ep_group, self._layout(), "MoEBlock", ep_timeout(None), frame_device(self.routed_tokens))
            self._layout_agreed = True

    def _apply(self, fn, *args, **kwargs):  # keep the replica tables on the module's device
        out = super()._apply(fn, *args, **kwargs)
        device = self.routed_tokens.device
        self._log2phy, self._logcnt = self._log2phy.to(device), self._logcnt.to(device)
        return out

    def shard_experts_(self, ep_group, phy2log=None) -> "MoEBlock":
        """Keep only this rank's slots of a block built with all experts, one slot each (e.g. to
        match a reference). ``phy2log`` [R]: the placement (default: slot s runs expert s); a slot
        gets a copy of its expert, so replicas start identical."""
        if len(self.experts) != self.num_experts or not torch.equal(self._phy2log, torch.arange(self.num_experts)):
            raise ValueError(f"shard_experts_: the block holds {len(self.experts)} slots of {self.num_experts} experts; "
                             "it needs all of them, one slot each")
        ep = self._group_size(ep_group)
        placement = torch.arange(self.num_experts) if phy2log is None else check_placement(phy2log, self.num_experts, ep=ep)
        ep, rank = self._check_group(ep_group, len(placement))
        local = len(placement) // ep
        self.ep_group, self.ep, self.ep_rank, self.local = ep_group, ep, rank, local
        self.first_expert = self.first_slot = rank * local
        full = list(self.experts)
        mine = placement[rank * local : (rank + 1) * local].tolist()
        self.experts = nn.ModuleList(copy.deepcopy(full[e]) if phy2log is not None else full[e] for e in mine)
        self.expert_rows = self.expert_rows.new_zeros(local)
        self._set_placement(placement)
        return self

    def reset_counts(self) -> None:
        self.routed_tokens.zero_()
        self.expert_rows.zero_()

    # ------------------------------------------------------------ pieces (shared with references)
    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, hid = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, hid // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, s, hid))

    # ------------------------------------------------------------ parts
    def parts(self) -> list:
        return [
            Compute("attn", self._attn),
            Comm("counts", self._counts),
            Comm("dispatch", self._dispatch, self._dispatch_backward),
            Compute("mlp", self._mlp),
            Comm("combine", self._combine, self._combine_backward),
            Compute("mix", self._mix),
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block alone, its parts in order (communication waited for at once)."""
        return run_parts(self.parts(), (x,), type(self).__name__)

    def _attn(self, x):
        h = self.attention(x)
        tokens = self.norm2(h).reshape(-1, self.hidden)
        experts, weights = self.router(tokens)
        flat = experts.reshape(-1)
        slots = slots_of_copies(flat, self._log2phy, self._logcnt, self.ep_rank)
        order = torch.argsort(slots, stable=True)
        sent = tokens.index_select(0, order // self.top_k)
        counts = torch.bincount(slots, minlength=self.num_slots)
        self.routed_tokens += torch.bincount(flat, minlength=self.num_experts)
        return h, tokens, sent, weights, _Route(tuple(x.shape), order, counts)

    def _counts(self, h, tokens, sent, weights, route):
        def arrived(received):
            received = received.view(self.ep, self.local)
            full = replace(route, send=route.counts.view(self.ep, self.local).sum(1).tolist(),
                           recv=received.sum(1).tolist(), recv_counts=received)
            return (h, tokens, sent, weights, full), None

        self._agree_layout()
        each = [self.local] * self.ep
        return Then(self._all_to_all(route.counts, each, each), arrived)

    def _dispatch(self, h, tokens, sent, weights, route):
        return self._move((h, tokens, sent, weights, route), route.recv, route.send)

    def _dispatch_backward(self, route, grads):
        return self._move_back(grads, route.recv, route.send)

    def _combine(self, h, shared, outs, weights, route):
        return self._move((h, shared, outs, weights, route), route.send, route.recv)

    def _combine_backward(self, route, grads):
        return self._move_back(grads, route.send, route.recv)

    def _move(self, state: tuple, out_splits: list, in_splits: list):
        """Start sending the rows in ``state[2]`` (``in_splits`` to each rank, ``out_splits`` from
        each); ``wait()`` gives the state with the rows that arrived, and the route as ctx."""
        rows, route = state[2], state[4]

        def arrived(got):
            if got is not rows:  # with one rank the rows stay where they are
                got.requires_grad_(rows.requires_grad)
            return (*state[:2], got, *state[3:]), route

        return Then(self._all_to_all(rows.detach() if self.ep > 1 else rows, out_splits, in_splits), arrived)

    def _move_back(self, grads: tuple, out_splits: list, in_splits: list):
        """The backward of ``_move(state, out_splits, in_splits)``: the row gradients go back."""
        g_rows = grads[2] if grads[2] is not None else self._zeros(sum(out_splits))
        return Then(self._all_to_all(g_rows, in_splits, out_splits), lambda g: (*grads[:2], g, grads[3], None))

    def _zeros(self, rows: int) -> torch.Tensor:
        w = self.proj.weight
        return torch.zeros(rows, self.hidden, dtype=w.dtype, device=w.device)

    def _grouping(self, route) -> tuple[torch.Tensor, list[int]]:
        """The received rows (source-major) in expert-major order, and each local expert's count."""
        counts = route.recv_counts  # [ep, local]: rows from each rank for each local expert
        flat = counts.reshape(-1)
        starts = (torch.cumsum(flat, 0) - flat).view(self.ep, self.local)
        seg_start, seg_len = starts.t().reshape(-1), counts.t().reshape(-1)  # segments, expert-major
        ends = torch.cumsum(seg_len, 0)
        within = torch.arange(int(ends[-1]), device=counts.device) - torch.repeat_interleave(ends - seg_len, seg_len)
        return torch.repeat_interleave(seg_start, seg_len) + within, counts.sum(0).tolist()

    def _mlp(self, h, tokens, rows, weights, route):
        order, sizes = self._grouping(route)
        order = order.to(rows.device)
        back = torch.argsort(order)  # grouped by expert -> received order
        # One gather for all experts (its backward is one gather too); each slot then runs on its rows.
        chunks = _permute(rows, order, back).split(sizes)
        outs = [run_expert(expert, chunk) for expert, chunk in zip(self.experts, chunks)]
        self.expert_rows += torch.tensor(sizes, device=self.expert_rows.device)
        shared = self.shared(tokens) if self.shared is not None else None
        return h, shared, _permute(torch.cat(outs), back, order), weights, route

    def _mix(self, h, shared, rows, weights, route):
        t, k = weights.shape
        # unbind, not y[:, j]: the backward of k selections would zero-fill k full-size tensors.
        ys = _permute(rows, torch.argsort(route.order), route.order).view(t, k, self.hidden).unbind(1)
        ws = [w.unsqueeze(1) for w in weights.unbind(1)]
        acc = ys[0] * ws[0]
        for j in range(1, k):
            acc = acc + ys[j] * ws[j]
        if shared is not None:
            acc = acc + shared
        return (h + acc.view(route.shape),)
