"""Expert parallelism for the MoE blocks of Hugging Face models (DeepSeek-V3, Qwen3-MoE, Mixtral).

``EPMoE(block, ep_group, phy2log)`` replaces a ``transformers`` MoE block (``DeepseekV3MoE``,
``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``): it keeps the block's own router module
(``block.gate``, called as is: the model's scores, correction bias, group limit, top-k,
normalisation and scaling) and its shared experts (computed on the rank's own tokens), and holds
only this rank's slots of the fused routed experts (a copy of ``block.experts`` whose
``gate_up_proj``/``down_proj`` keep the rows of this rank's slots, run by the model's own experts
code). The token copies go to their experts' ranks and back by the all-to-alls of
``twinpipe.moe.exchange.ExpertExchange`` (the placement ``phy2log`` with redundant experts, and
the spreading rule over replicas, as ``twinpipe.moe``), declared as parts so that DualPipe's F&B
overlap hides them:

    route (compute)    router on the tokens; sort token copies by slot
    counts (comm)      copies per slot, to every rank (nothing in backward)
    dispatch (comm)    all-to-all the token copies to their slots' ranks
    experts (compute)  the local slots on what arrived; the shared experts on the local tokens
    combine (comm)     all-to-all the expert outputs back
    mix (compute)      out = sum_j weight_j * y_j (as the model's experts code sums) + shared

``shard_experts_(module, ep_group, phy2log)`` replaces every such block of a model or stage in
place; ``expert_places(module)`` says which rows of the checkpoint's fused tensors each local
tensor holds (``Place``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from twinpipe.checks import bad
from twinpipe.hf._safetensors_place import Place
from twinpipe.moe.exchange import ExpertExchange, _permute, optimizer_state
from twinpipe.moe.placement import check_placement
from twinpipe.overlap.graph import run_parts
from twinpipe.overlap.parts import Compute
from twinpipe.runtime.main_grad import zeros_if_missing

__all__ = ["EPMoE", "Place", "shard_experts_", "expert_places", "expert_rows", "ep_group_of", "is_moe_block", "FUSED"]

FUSED = ("gate_up_proj", "down_proj")  # the fused expert parameters, [E, ...] each


def is_moe_block(module: nn.Module) -> bool:
    """A ``transformers`` MoE block this module can shard: a router ``gate`` and fused ``experts``."""
    experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
    return (isinstance(gate, nn.Module) and isinstance(experts, nn.Module) and not isinstance(module, EPMoE)
            and all(isinstance(getattr(experts, n, None), torch.Tensor) and getattr(experts, n).dim() == 3 for n in FUSED))


def unsupported(block: nn.Module) -> str | None:
    """Why ``block`` cannot be sharded exactly, or None."""
    extra = sorted(set(dict(block.named_children())) - {"gate", "experts", "shared_experts"})
    if extra:
        return f"it has {', '.join(extra)} besides gate, experts and shared_experts"
    e = block.experts
    if getattr(e, "has_bias", False) or not getattr(e, "has_gate", True) or getattr(e, "has_post_expert_norm", False):
        return "its experts have biases, no gate or a post-expert norm"
    if getattr(e, "is_transposed", False):
        return "its fused expert weights are transposed"
    return None


class EPMoE(ExpertExchange):
    """A ``transformers`` MoE block with its routed experts sharded over ``ep_group`` (see the module doc).

    ``ep_group``: a process group, a ``twinpipe.moe.local.LocalEPRank`` or None (all slots local).
    ``phy2log`` [R]: slot s runs logical expert ``phy2log[s]`` (default: R = E, slot s runs expert
    s); R must be a multiple of the group size, rank r holds slots ``r*R/ep .. (r+1)*R/ep - 1``.
    The block's router and shared experts are taken over as they are (the same modules); the local
    fused expert tensors are new ones, copies of this rank's slots' rows (on the meta device too:
    build the model there, shard, then load the rows ``expert_places`` names).
    """

    def __init__(self, block: nn.Module, ep_group=None, phy2log=None):
        super().__init__()
        if not is_moe_block(block):
            raise bad("block", type(block).__name__, f"must be a transformers MoE block (a router `gate` and `experts` "
                      f"with 3-D {' and '.join(FUSED)}), as in DeepSeek-V3, Qwen3-MoE and Mixtral")
        why = unsupported(block)
        if why:
            raise bad("block", type(block).__name__, f"{why}; supported are the MoE blocks of DeepSeek-V3, Qwen3-MoE and Mixtral")
        full = block.experts
        num_experts, _, hidden = full.gate_up_proj.shape
        self.num_experts, self.hidden = int(num_experts), int(hidden)
        self.top_k = int(block.gate.top_k)
        self.kind = type(block).__name__
        ep = self._group_size(ep_group)
        placement = torch.arange(num_experts) if phy2log is None else check_placement(phy2log, num_experts, ep=ep)
        ep, rank = self._check_group(ep_group, len(placement))
        self.ep_group, self.ep, self.ep_rank = ep_group, ep, rank
        self.local = len(placement) // ep
        self.first_slot = rank * self.local
        self.gate = block.gate
        # The router gets what the HF block gives it (hooks on it see the same): DeepSeek-V3's the
        # [B, S, H] hidden states (its sequence-wise balance loss needs the sequences), the others
        # the [T, H] tokens.
        self.gate_takes_sequences = self.kind == "DeepseekV3MoE"
        self.shared_experts = getattr(block, "shared_experts", None)
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)  # Mixtral's router jitter
        self.rows = tuple(placement[rank * self.local : (rank + 1) * self.local].tolist())  # logical expert of each local slot
        self.experts = _local_experts(full, self.rows)
        device = full.gate_up_proj.device
        self.register_buffer("routed_tokens", torch.zeros(num_experts, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("expert_rows", torch.zeros(self.local, dtype=torch.long, device=device), persistent=False)
        self._set_placement(placement)

    # ------------------------------------------------------------ what the exchange needs
    def _layout(self) -> dict:
        w = self.experts.gate_up_proj
        return {"num_experts": self.num_experts, "num_slots": self.num_slots, "hidden": self.hidden,
                "dtype": str(w.dtype).removeprefix("torch."), "phy2log": self._phy2log.tolist(),
                "expert parameters": sum(getattr(self.experts, n)[0].numel() for n in FUSED)}

    def _zeros(self, rows: int) -> torch.Tensor:
        w = self.experts.gate_up_proj
        return torch.zeros(rows, self.hidden, dtype=w.dtype, device=w.device)

    def places(self, prefix: str = "") -> dict[str, Place]:
        """Each local fused tensor's name -> its ``Place`` in the unsharded block (``prefix`` + name)."""
        return {f"{prefix}experts.{n}": Place(f"{prefix}experts.{n}", self.rows) for n in FUSED}

    def reset_counts(self) -> None:
        self.routed_tokens.zero_()
        self.expert_rows.zero_()

    def _slot_numel(self) -> int:
        return sum(getattr(self.experts, n)[0].numel() for n in FUSED)

    def _slot_grads(self, i: int) -> list:
        """Local slot ``i``'s rows of the fused gradients (``grad_of``: the FP32 ``main_grad`` under mixed
        precision; zeros where missing), views written in place."""
        return [zeros_if_missing(getattr(self.experts, n))[i] for n in FUSED]

    def _slot_tensors(self, i: int, optimizer=None) -> list:
        """Local slot ``i``'s rows of the fused parameters, each followed by the same rows of its
        ``optimizer`` state tensors (per-parameter scalars such as Adam's ``step`` are shared by
        every slot and stay): views, written in place by ``twinpipe.moe.apply_placement_``."""
        out = []
        for n in FUSED:
            p = getattr(self.experts, n)
            out += [p[i], *(t[i] for t in optimizer_state(p, optimizer) if t.shape == p.shape)]
        return out

    def _drop_slot_grads(self, i: int) -> None:
        """Zero local slot ``i``'s rows of the fused gradients (a refilled slot's are another expert's)."""
        for n in FUSED:
            p = getattr(self.experts, n)
            for g in (p.grad, getattr(p, "main_grad", None)):
                if g is not None:
                    g[i].zero_()

    def _set_placement(self, phy2log: torch.Tensor) -> None:
        super()._set_placement(phy2log)
        self.rows = tuple(phy2log[self.first_slot : self.first_slot + self.local].tolist())

    # ------------------------------------------------------------ parts
    def parts(self) -> list:
        return [Compute("route", self._route_part), *self.exchange_parts()]

    def exchange_parts(self) -> list:
        """The parts after routing (a layer puts its own first part before them)."""
        return self.exchange_parts_with(Compute("experts", self._experts_part), Compute("mix", self._mix_part))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The block's output ``[B, S, H]`` (no residual), as the HF block's forward. The router runs
        first, outside the parts (so that what hooks on it keep, such as the logits a
        ``twinpipe.hf.layer.DecoderLayer`` collects for the auxiliary loss, is ordinary autograd),
        then the parts in order."""
        hidden_states = self._jitter(hidden_states)
        _, weights, experts = self._route(hidden_states)
        parts = [Compute("route", self._sort_part), *self.exchange_parts()]
        # Called as a module, outside a stage's parts (unsplit models, stages not in parts): its backward runs through.
        return run_parts(parts, (hidden_states, weights, experts), type(self).__name__, capture=False)

    def route(self, residual, hidden_states: torch.Tensor, ctx=None) -> tuple:
        """The state after routing ``hidden_states`` [B, S, H]: ``(residual, hidden_states, sent,
        weights, route)``, and with a layer's ``ctx`` (``twinpipe.hf.layer.Context``) two more
        entries: ``ctx`` and the router logits when ``ctx.router_logits`` is a list (else None).
        The logits travel in the state, not in ``ctx``, so that each part's autograd graph stays
        its own; ``mix`` appends them to ``ctx.router_logits``."""
        hidden_states = self._jitter(hidden_states)
        # The router, the routed copies and the shared experts each take their own view of the
        # tokens, made in that order: autograd then adds a token's gradient terms as the HF block's
        # graph does, newest first: (shared + routed) + router.
        logits, weights, experts = self._route(hidden_states)
        state = self._sort(residual, hidden_states, weights, experts)
        if ctx is None:
            return state
        return (*state, ctx, logits if isinstance(ctx.router_logits, list) else None)

    def _route(self, hidden_states):
        """The model's router on ``hidden_states`` [B, S, H], called as the HF block calls it."""
        return self.gate(hidden_states if self.gate_takes_sequences else hidden_states.reshape(-1, self.hidden))

    def _jitter(self, hidden_states):
        if self.training and self.jitter_noise > 0:  # as MixtralSparseMoeBlock (out of place)
            return hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        return hidden_states

    def _sort(self, residual, hidden_states, weights, experts) -> tuple:
        """The token copies sorted by slot, given the router's ``weights`` and ``experts`` [T, k]."""
        sent, route = self._route_copies(hidden_states.reshape(-1, self.hidden), experts, hidden_states.shape,
                                         by_choice=self._eager())
        if self._eager():
            route = replace(route, experts=experts)
        return residual, hidden_states.view_as(hidden_states), sent, weights, route

    def _route_part(self, hidden_states):
        return self.route(None, hidden_states)

    def _sort_part(self, hidden_states, weights, experts):
        return self._sort(None, hidden_states, weights, experts)

    def _experts_part(self, residual, hidden_states, rows, weights, route, *extra):
        # Received rows: from each rank in turn, within each by slot (and by choice j). Each slot's
        # rows go to the experts code in the unsplit block's order: by choice j, then by rank
        # (the eager loop, a token's j-th choices in token order), or by rank (grouped_mm: by token).
        counts = route.recv_choice if route.recv_choice is not None else route.recv_counts.unsqueeze(2)
        order, slot_of_row = _regroup(counts)
        order, slot_of_row = order.to(rows.device), slot_of_row.to(rows.device)
        back = torch.argsort(order)
        grouped = _permute(rows, order, back)
        ones = torch.ones(len(rows), 1, dtype=rows.dtype, device=rows.device)
        # The model's own experts code on the local slots, each row's weight 1 (exact: y * 1 = y);
        # the routing weights multiply at the token's rank, in mix.
        outs = _permute(self.experts(grouped, slot_of_row.unsqueeze(1), ones), back, order) if len(rows) else rows.clone()
        self.expert_rows += route.recv_counts.sum(0).to(self.expert_rows.device)
        shared = self.shared_experts(hidden_states) if self.shared_experts is not None else None
        return residual, shared, outs, weights, route, *extra

    def _mix_part(self, residual, shared, rows, weights, route, ctx=None, logits=None):
        out = self.mix(rows, weights, route, shared)
        if ctx is None:
            return (out,)
        if logits is not None:
            ctx.router_logits.append(logits)
        return residual + out, ctx

    def mix(self, rows, weights, route, shared, experts=None):
        """``sum_j w_j * y_j`` per token, summed as the model's experts code sums, plus shared.

        With ``experts_implementation="eager"`` (the HF loop over experts): each contribution cast
        to the rows' dtype, added into zeros in ascending expert order (``index_add_``); with any
        other (``grouped_mm``, the default, ``batched_mm``): the copies in router order,
        ``.sum(1)``, then cast (``grouped_mm_experts_forward``)."""
        t, k = weights.shape
        y = _permute(rows, torch.argsort(route.order), route.order)  # back to copy order (token*k + j)
        c = (y * weights.reshape(-1, 1)).view(t, k, self.hidden)
        if self._eager():
            by_expert = route.experts.argsort(dim=1, stable=True)  # the order index_add_ adds them in
            c = c.to(rows.dtype).gather(1, by_expert.unsqueeze(2).expand(t, k, self.hidden))
            routed = torch.zeros_like(c[:, 0])
            for j in range(k):
                routed = routed + c[:, j]
        else:
            routed = c.sum(dim=1).to(rows.dtype)
        routed = routed.view(route.shape)
        return routed if shared is None else routed + shared

    def _eager(self) -> bool:
        config = getattr(self.experts, "config", None)
        return getattr(config, "_experts_implementation", None) in (None, "eager")


def _regroup(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows received as segments ``counts [ep, local, sub]`` (rank-major, then slot, then sub):
    the order that puts them slot-major, then sub, then rank; and the local slot of each row in it."""
    ep, local, sub = counts.shape
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(ep, local, sub)
    seg_start, seg_len = starts.permute(1, 2, 0).reshape(-1), counts.permute(1, 2, 0).reshape(-1)
    ends = torch.cumsum(seg_len, 0)
    within = torch.arange(int(ends[-1]), device=counts.device) - torch.repeat_interleave(ends - seg_len, seg_len)
    slots = torch.arange(local, device=counts.device).repeat_interleave(sub * ep)
    return torch.repeat_interleave(seg_start, seg_len) + within, torch.repeat_interleave(slots, seg_len)


def _local_experts(full: nn.Module, rows: tuple) -> nn.Module:
    """A copy of the fused experts module ``full`` holding only ``rows`` (slot i: expert rows[i])."""
    local = copy.copy(full)
    local._parameters, local._buffers, local._modules = dict(full._parameters), dict(full._buffers), dict(full._modules)
    index = torch.tensor(rows, dtype=torch.long, device=full.gate_up_proj.device)
    for name in FUSED:
        p = getattr(full, name)
        setattr(local, name, nn.Parameter(p.detach().index_select(0, index), requires_grad=p.requires_grad))
    local.num_experts = len(rows)
    return local


def _placements(phy2log, names: list[str]) -> dict:
    """One placement per MoE block: None, one for all, a dict name -> placement, or one row per block."""
    if phy2log is None or isinstance(phy2log, dict):
        table = phy2log or {}
        unknown = sorted(set(table) - set(names))
        if unknown:
            raise bad("phy2log", f"{{{', '.join(map(repr, unknown))}: ...}}", f"must name MoE blocks of the module: {names}")
        return {n: table.get(n) for n in names}
    p = torch.as_tensor(phy2log)
    if p.dim() == 2:
        if len(p) != len(names):
            raise bad("phy2log", f"<{len(p)} rows>", f"must have one row per MoE block of the module ({len(names)}: {names})")
        return dict(zip(names, p))
    return {n: p for n in names}


def shard_experts_(module: nn.Module, ep_group, phy2log=None) -> nn.Module:
    """Replace every ``transformers`` MoE block of ``module`` (a model, a stage, a layer or the
    block itself) by an ``EPMoE`` over ``ep_group``; returns ``module`` (or the ``EPMoE`` when
    ``module`` is a block). ``phy2log``: None (slot s runs expert s), one placement for every
    block, a ``[blocks, R]`` table (blocks in ``named_modules`` order: EPLB's per-layer output) or
    a dict block name -> placement. Every EP rank must call it alike."""
    if is_moe_block(module):
        return EPMoE(module, ep_group, _placements(phy2log, [""])[""])
    names = [name for name, m in module.named_modules() if is_moe_block(m)]
    if not names:
        raise bad("module", type(module).__name__, "must hold a transformers MoE block (a `gate` and fused `experts`)")
    placements = _placements(phy2log, names)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, child, EPMoE(getattr(parent, child), ep_group, placements[name]))
    return module


def ep_blocks(module: nn.Module) -> Iterable[tuple[str, EPMoE]]:
    return ((name, m) for name, m in module.named_modules() if isinstance(m, EPMoE))


def expert_rows(module: nn.Module) -> dict[int, tuple]:
    """``id()`` of every local fused-expert parameter of ``module`` -> the rows of the unsplit tensor it holds."""
    return {id(module.get_parameter(local)): place.rows for local, place in expert_places(module).items()}


def ep_group_of(module: nn.Module):
    """The EP group ``module``'s sharded MoE blocks spread their experts over (None: none sharded, or
    over one rank); ValueError when blocks are sharded over different groups."""
    groups = {id(block.ep_group): block.ep_group for _, block in ep_blocks(module) if block.ep > 1}
    if len(groups) > 1:
        raise bad("module", type(module).__name__, f"must have its MoE blocks sharded over one EP group, not {len(groups)}")
    return next(iter(groups.values()), None)


def expert_places(module: nn.Module, name_of=None) -> dict[str, Place]:
    """Every local fused-expert parameter of ``module`` (by its name in ``module``) -> ``Place``:
    its name in the unsplit model (``name_of(local name)``, default the same name) and the rows of
    the unsplit tensor it holds (``twinpipe.hf.weights`` reads and writes those rows)."""
    out = {}
    for name, block in ep_blocks(module):
        for local, place in block.places(f"{name}." if name else "").items():
            out[local] = Place(name_of(local), place.rows) if name_of is not None else place
    return out
