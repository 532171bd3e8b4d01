"""A MoE transformer block with expert parallelism, declared as six parts for the overlap engine:

    attn (compute)   x -> h = x + attention(norm(x)); route norm(h); sort token copies by expert
    counts (comm)    exchange how many copies each rank sends to each expert (nothing in backward)
    dispatch (comm)  all-to-all the token copies to the experts' ranks
    mlp (compute)    local experts on what arrived (grouped by expert); shared expert on local tokens
    combine (comm)   all-to-all the expert outputs back
    mix (compute)    out = h + shared + sum_j weight_j * expert_output_j

Experts are sharded over ``ep_group`` (rank r holds experts ``r*E/ep .. (r+1)*E/ep - 1``); with no
group (or one rank) nothing is communicated. Dropless: every token copy reaches its expert.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twinpipe.moe.router import TopKRouter
from twinpipe.overlap.comm import Then, all_to_all
from twinpipe.overlap.graph import run_parts
from twinpipe.overlap.parts import Comm, Compute
from twinpipe.runtime.weight_grad import DeferredLinear

__all__ = ["MoEBlock", "FeedForward"]


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


@dataclass(frozen=True)
class _Route:
    """Where one micro-batch's token copies go (set by attn) and what came back (set by dispatch)."""

    shape: tuple  # (batch, seq, hidden) of the block input
    order: torch.Tensor  # token copies (token*k + slot) sorted by expert, stable
    counts: torch.Tensor  # [E] copies this rank sends to each expert
    send: list | None = None  # rows to each rank
    recv: list | None = None  # rows from each rank
    recv_counts: torch.Tensor | None = None  # [ep, local experts] rows from each rank for each local expert


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
    experts sharded over ``ep_group`` (None: all local, no communication).
    """

    def __init__(self, hidden: int, heads: int, num_experts: int, top_k: int, expert_hidden: int, *,
                 shared_hidden: int = 0, score: str = "softmax", groups: int = 1, top_groups: int | None = None,
                 normalize: bool | None = None, route_scale: float = 1.0, swiglu: bool = False, ep_group=None):
        super().__init__()
        if not isinstance(heads, int) or heads < 1 or hidden % heads:
            raise ValueError(f"heads={heads!r}: must be a positive int dividing hidden ({hidden})")
        self.router = TopKRouter(hidden, num_experts, top_k, score, groups, top_groups, normalize, route_scale)
        ep, rank = self._check_group(ep_group, num_experts)
        self.hidden, self.heads, self.num_experts, self.top_k = hidden, heads, num_experts, top_k
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = DeferredLinear(hidden, 3 * hidden, bias=False)
        self.proj = DeferredLinear(hidden, hidden, bias=False)
        self.shared = FeedForward(hidden, shared_hidden, swiglu) if shared_hidden else None
        self.ep_group, self.ep = ep_group, ep
        self.local = num_experts // ep
        self.experts = nn.ModuleList(FeedForward(hidden, expert_hidden, swiglu) for _ in range(self.local))
        self.first_expert = rank * self.local
        # Token copies this rank routed to each (global) expert, and rows each local expert ran on,
        # summed over forwards until reset_counts().
        self.register_buffer("routed_tokens", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("expert_rows", torch.zeros(self.local, dtype=torch.long), persistent=False)

    @staticmethod
    def _check_group(ep_group, num_experts: int) -> tuple[int, int]:
        if ep_group is None:
            return 1, 0
        ep = dist.get_world_size(ep_group)
        if num_experts % ep:
            raise ValueError(f"ep_group has {ep} ranks, which does not divide num_experts={num_experts}")
        return ep, dist.get_rank(ep_group)

    def shard_experts_(self, ep_group) -> "MoEBlock":
        """Keep only this rank's experts of a block built with all of them (e.g. to match a reference)."""
        if len(self.experts) != self.num_experts:
            raise ValueError(f"shard_experts_: the block holds {len(self.experts)} of {self.num_experts} experts; it needs all of them")
        ep, rank = self._check_group(ep_group, self.num_experts)
        self.ep_group, self.ep, self.local, self.first_expert = ep_group, ep, self.num_experts // ep, rank * (self.num_experts // ep)
        self.experts = nn.ModuleList(list(self.experts)[self.first_expert : self.first_expert + self.local])
        self.expert_rows = self.expert_rows.new_zeros(self.local)
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
        order = torch.argsort(flat, stable=True)
        sent = tokens.index_select(0, order // self.top_k)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.routed_tokens += counts
        return h, tokens, sent, weights, _Route(tuple(x.shape), order, counts)

    def _counts(self, h, tokens, sent, weights, route):
        def arrived(received):
            received = received.view(self.ep, self.local)
            full = replace(route, send=route.counts.view(self.ep, self.local).sum(1).tolist(),
                           recv=received.sum(1).tolist(), recv_counts=received)
            return (h, tokens, sent, weights, full), None

        each = [self.local] * self.ep
        return Then(all_to_all(route.counts, each, each, self.ep_group), arrived)

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

        return Then(all_to_all(rows.detach() if self.ep > 1 else rows, out_splits, in_splits, self.ep_group), arrived)

    def _move_back(self, grads: tuple, out_splits: list, in_splits: list):
        """The backward of ``_move(state, out_splits, in_splits)``: the row gradients go back."""
        g_rows = grads[2] if grads[2] is not None else self._zeros(sum(out_splits))
        return Then(all_to_all(g_rows, in_splits, out_splits, self.ep_group), lambda g: (*grads[:2], g, grads[3], None))

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
        # One gather for all experts (its backward is one gather too); each expert then gets its
        # rows as a fresh tensor, as a single process holding every expert would (BLAS results
        # may depend on the alignment of a slice).
        chunks = _permute(rows, order, back).split(sizes)
        outs = [expert(chunk.clone()) for expert, chunk in zip(self.experts, chunks)]
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
