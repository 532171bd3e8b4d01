"""A MoE transformer block with expert parallelism, declared as six parts for the overlap engine:

    attn (compute)   x -> h = x + attention(norm(x)); route norm(h); sort token copies by expert
    counts (comm)    exchange how many copies each rank sends to each expert (nothing in backward)
    dispatch (comm)  all-to-all the token copies to the experts' ranks
    mlp (compute)    local experts on what arrived (grouped by expert); shared expert on local tokens
    combine (comm)   all-to-all the expert outputs back
    mix (compute)    out = h + shared + sum_j weight_j * expert_output_j

The routed experts run as R physical slots sharded over ``ep_group`` (rank r holds slots
``r*R/ep .. (r+1)*R/ep - 1``), slot s running logical expert ``phy2log[s]`` (placement.py: the
placement and the rule that spreads an expert's token copies over its replicas; exchange.py: the
placement tables and the comm parts, shared with other MoE blocks). By default
R = E and slot s runs expert s. With no group (or one rank) nothing is communicated. Dropless:
every token copy reaches a replica of its expert.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from twinpipe.checks import bad, check_int
from twinpipe.moe.exchange import ExpertExchange, _permute, _Route, optimizer_state  # noqa: F401  (_Route: its old home)
from twinpipe.moe.placement import check_placement
from twinpipe.moe.router import TopKRouter
from twinpipe.overlap.graph import run_parts
from twinpipe.overlap.parts import Compute
from twinpipe.runtime.main_grad import zeros_if_missing
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


class MoEBlock(ExpertExchange):
    """Pre-norm transformer block: causal self-attention, then a routed mixture of experts.

    ``num_experts`` routed experts of width ``expert_hidden`` (``swiglu`` for DeepSeek's gated
    experts), ``top_k`` per token, chosen by ``TopKRouter`` (``score``, ``groups``/``top_groups``,
    ``normalize``, ``route_scale``, ``balance_alpha``); a shared expert of width ``shared_hidden`` if > 0; the routed
    experts sharded over ``ep_group`` (None: all local, no communication), one slot per expert;
    ``shard_experts_(group, phy2log)`` or ``twinpipe.moe.apply_placement_`` place replicas.
    ``ep_group`` may also be a rank of a ``twinpipe.moe.local.LocalEPGroup`` (EP ranks simulated in
    one process, run in lock-step: a reference's).
    """

    def __init__(self, hidden: int, heads: int, num_experts: int, top_k: int, expert_hidden: int, *,
                 shared_hidden: int = 0, score: str = "softmax", groups: int = 1, top_groups: int | None = None,
                 normalize: bool | None = None, route_scale: float = 1.0, swiglu: bool = False, ep_group=None,
                 balance_alpha: float = 0.0):
        super().__init__()
        check_int(hidden, "hidden", low=1)
        check_int(expert_hidden, "expert_hidden", low=1)
        check_int(shared_hidden, "shared_hidden", low=0, why="0: no shared expert")
        check_int(heads, "heads", low=1, why=f"dividing hidden ({hidden})")
        if hidden % heads:
            raise bad("heads", heads, f"must divide hidden ({hidden})")
        self.router = TopKRouter(hidden, num_experts, top_k, score, groups, top_groups, normalize, route_scale, balance_alpha)
        ep, rank = self._check_group(ep_group, num_experts)
        self.hidden, self.heads, self.num_experts, self.top_k = hidden, heads, num_experts, top_k
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = DeferredLinear(hidden, 3 * hidden, bias=False)
        self.proj = DeferredLinear(hidden, hidden, bias=False)
        self.shared = FeedForward(hidden, shared_hidden, swiglu) if shared_hidden else None
        self.ep_group, self.ep, self.ep_rank = ep_group, ep, rank
        self.local = num_experts // ep  # slots per rank
        self.experts = nn.ModuleList(FeedForward(hidden, expert_hidden, swiglu) for _ in range(self.local))
        self.first_slot = rank * self.local
        # Token copies this rank routed to each logical expert, and rows each local slot ran on,
        # summed over forwards until reset_counts().
        self.register_buffer("routed_tokens", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("expert_rows", torch.zeros(self.local, dtype=torch.long), persistent=False)
        self._set_placement(torch.arange(num_experts))

    def _layout(self) -> dict:
        """What this block's EP collectives follow from (their sizes, and which expert each slot
        runs): every EP rank must hold the same."""
        w = self.proj.weight
        return {"num_experts": self.num_experts, "num_slots": self.num_slots, "hidden": self.hidden,
                "dtype": str(w.dtype).removeprefix("torch."), "phy2log": self._phy2log.tolist(),
                "expert parameters": sum(p.numel() for p in self.experts[0].parameters())}

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
        self.first_slot = rank * local
        full = list(self.experts)
        mine = placement[rank * local : (rank + 1) * local].tolist()
        self.experts = nn.ModuleList(copy.deepcopy(full[e]) if phy2log is not None else full[e] for e in mine)
        self.expert_rows = self.expert_rows.new_zeros(local)
        self._set_placement(placement)
        return self

    def _slot_numel(self) -> int:
        return sum(p.numel() for p in self.experts[0].parameters())

    def _slot_grads(self, i: int) -> list:
        """Local slot ``i``'s parameter gradients (``grad_of``: the FP32 ``main_grad`` under mixed
        precision; zeros where missing), to be written in place."""
        return [zeros_if_missing(p) for p in self.experts[i].parameters()]

    def _slot_tensors(self, i: int, optimizer=None) -> list:
        """Local slot ``i``'s parameters, each followed by its ``optimizer`` state tensors."""
        return [t for p in self.experts[i].parameters() for t in (p, *optimizer_state(p, optimizer))]

    def _drop_slot_grads(self, i: int) -> None:
        for p in self.experts[i].parameters():
            p.grad = None

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
        return [Compute("attn", self._attn), *self.exchange_parts_with(Compute("mlp", self._mlp), Compute("mix", self._mix))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block alone, its parts in order (communication waited for at once)."""
        return run_parts(self.parts(), (x,), type(self).__name__)

    def _attn(self, x):
        h = self.attention(x)
        tokens = self.norm2(h).reshape(-1, self.hidden)
        experts, weights = self.router(tokens, seq_len=x.shape[1])
        sent, route = self._route_copies(tokens, experts, x.shape)
        return h, tokens, sent, weights, route

    def _zeros(self, rows: int) -> torch.Tensor:
        w = self.proj.weight
        return torch.zeros(rows, self.hidden, dtype=w.dtype, device=w.device)

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
