"""The stages one rank holds of a ``transformers`` causal LM cut into pipeline stages.

``build`` gives one rank its stage modules (``HFStage``, in ``twinpipe.hf.stage``) for any
schedule, with the criterion, the batch split and the gradient sums that go with them
(``HFRankStages``); the tuples that flow between stages are described in ``twinpipe.hf.layer``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.checks import bad, check_bool, check_choice, check_float, check_int
from twinpipe.hf.experts import ep_group_of
from twinpipe.hf.layer import drops_router_logits
from twinpipe.hf.layout import BALANCE, balanced_layout, format_layout, parse_layout
from twinpipe.hf.mtp import HFMTPLoss, depth_counts, mtp_depth_of, mtp_layers
from twinpipe.hf.self_check import model_parts
from twinpipe.hf.stage import IGNORE_INDEX, ROTARY, CausalLMLoss, HFPartedStage, HFStage, LastItems, count_items, decoder_layers
from twinpipe.hf.support import ModelParts
from twinpipe.runtime.batches import batch_layout
from twinpipe.runtime import waits
from twinpipe.runtime.collectives import collective
from twinpipe.runtime.weight_grad import defer_weight_grads
from twinpipe.schedule.spec import ScheduleSpec, resolve
from twinpipe.train.balance import measured_once, time_weights

__all__ = ["HFStage", "HFPartedStage", "CausalLMLoss", "HFRankStages", "build", "ROTARY", "IGNORE_INDEX"]

@dataclass(kw_only=True)
class HFRankStages:
    """One rank's share of a causal LM under a schedule: pass ``modules`` and ``spec`` to
    ``Pipeline`` (or call ``pipeline()``), ``batch()`` to ``step()`` with ``criterion``, and call
    ``sync_grads(pipe)`` after each training step (before clipping and the optimizer)."""

    modules: list  # this rank's stage modules, in Pipeline order
    spec: ScheduleSpec
    rank: int
    layout: str  # the layout string, resolved
    criterion: CausalLMLoss  # HFMTPLoss with mtp_depth
    tie: str  # "none" (untied), "shared" (this placement holds both ends on one rank, one parameter), "split"
    rotary: str
    _ends: dict = field(default_factory=dict)  # "embed"/"head"/"mtp_embed" -> [(stage, chain, parameter)] on this rank
    _tied_like: tuple = ()  # (shape, dtype, device) of the tied weight
    facts: dict = field(default_factory=dict)  # what every rank must have alike (pipeline() checks)
    mtp_depth: int = 0  # MTP layers on the last stage (twinpipe.hf.mtp)
    _tied_keys: tuple = ()  # the ends whose gradients sync_tied_grads sums: ("embed", "head" or "mtp_embed")

    @property
    def stages(self) -> tuple:
        """The stage numbers of ``modules``."""
        return tuple(self.spec.stages_of(self.rank))

    def pipeline(self, process_group=None, *, dynamic_shapes: bool = True, **options):
        """``twinpipe.Pipeline`` on these modules; ``dynamic_shapes`` lets the sequence length change
        from one step to the next (headers on every message; pass False for a fixed length)."""
        from twinpipe.runtime.pipeline import Pipeline

        pipe = Pipeline(self.modules, self.spec, process_group=process_group, dynamic_shapes=dynamic_shapes, **options)
        try:
            self._agree(pipe)
        except BaseException:
            pipe.close()  # every rank raises here, so every rank closes
            raise
        return pipe

    def _agree(self, pipe) -> None:
        """Every rank of ``pipe`` built its stages from the same model, layout and options: a rank
        with another layout would run other layers than its neighbours expect, and no message
        shape would tell (the hidden states have one shape)."""
        from twinpipe.runtime.collectives import gather_objects
        from twinpipe.runtime.errors import PipelineMismatchError

        everyone = gather_objects(pipe._agree_group, self.facts, pipe.timeout, f"rank {self.rank}: twinpipe.hf stages agreeing")
        differ = [r for r, facts in enumerate(everyone) if facts != everyone[0]]
        if differ:
            raise PipelineMismatchError(f"ranks built different twinpipe.hf stages: rank 0 {everyone[0]}, "
                                        + ", ".join(f"rank {r} {everyone[r]}" for r in differ))

    def batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
              *, num_chunks: int, num_items: int | None = None) -> tuple[tuple, tuple]:
        """This rank's ``(inputs, labels)`` for ``step(*inputs, num_chunks=..., criterion=..., labels=labels)``
        from the WHOLE batch (every rank passes the same full tensors). ``attention_mask`` defaults
        to all ones. ``labels`` (``[B, S]``, -100 where nothing is predicted, as for ``transformers``)
        are not made from ``input_ids``: pass them, or None for a forward-only step without a loss.
        The loss is divided by ``num_items`` (default: the tokens ``labels`` counts over the whole batch)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise bad("input_ids", _shape(input_ids), "must be a [batch, sequence] tensor of token ids")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        elif not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise bad("attention_mask", _shape(attention_mask), f"must be a tensor of input_ids' shape {tuple(input_ids.shape)}")
        layout = batch_layout(self.spec, self.spec.num_ranks, self.rank, num_chunks)
        inputs = layout.inputs(input_ids, attention_mask.to(torch.long))
        if labels is None:
            return inputs, ()
        if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
            raise bad("labels", _shape(labels), f"must be a tensor of input_ids' shape {tuple(input_ids.shape)}")
        n = count_items(labels) if num_items is None else check_int(num_items, "num_items", low=1)
        if n == 0:
            raise bad("labels", "...", "must count at least one token (all are -100 after the shift)")
        if self.mtp_depth:  # each depth's count, and the tokens and mask its layers read, to the last stage
            if self.mtp_depth >= input_ids.shape[1] - 1:
                raise bad("input_ids", _shape(input_ids), f"must have more than mtp_depth + 1 = {self.mtp_depth + 1} "
                                                          "tokens per row (the last MTP depth predicts that far ahead)")
            counts = torch.tensor([n] + depth_counts(labels, self.mtp_depth)[1:], dtype=torch.long, device=labels.device)
            counts = counts.expand(labels.shape[0], -1).contiguous()
            return inputs, layout.labels(labels, counts, input_ids, attention_mask.to(torch.long))
        counts = torch.full((labels.shape[0],), n, dtype=torch.long, device=labels.device)
        return inputs, layout.labels(labels, counts)

    def sync_grads(self, pipe, timeout: float | None = None) -> None:
        """After a training step: the mirrored copies' sums (``pipe.sync_mirrored_grads()``, DualPipe),
        then the tied embedding's (``sync_tied_grads``). Every rank calls it."""
        pipe.sync_mirrored_grads()
        self.sync_tied_grads(pipe, timeout)

    def sync_tied_grads(self, pipe, timeout: float | None = None) -> None:
        """With tied input/output embeddings held by different stages (``tie == "split"``), or the
        MTP layers' embedding copy on another rank than the embedding: give the embedding and every
        copy of the head (of the MTP embedding) the sum of the embedding's and the head's (copy's)
        gradients, bitwise equal everywhere (one all-reduce over the pipeline's group, to which
        only the first copy of each end adds). A no-op otherwise, on every rank. Call it after
        ``sync_mirrored_grads`` (``sync_grads`` does both)."""
        if not self._tied_keys:
            return
        mine = [(p, chain) for key in self._tied_keys for _, chain, p in self._ends.get(key, [])]
        shape, dtype, device = self._tied_like
        total = torch.zeros(shape, dtype=dtype, device=device)
        for p, chain in mine:
            if chain == 0 and p.grad is not None:
                total += p.grad
        collective(dist.all_reduce, total, group=pipe.group, timeout=pipe.timeout if timeout is None else timeout,
                   what=f"rank {self.rank}: all-reduce of the tied embedding's gradients")
        for p, _ in mine:
            p.grad = total.clone()


def _shape(value):
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def build(model, schedule: str | ScheduleSpec = "dualpipev", num_ranks: int | None = None, rank: int | None = None, *,
          layout: str | None = None, balance: str = "params", sample: torch.Tensor | None = None,
          rotary: str = "recompute", defer: bool = True, untested: bool = False, process_group=None,
          wrap_layer=None, mtp_depth: int | str = 0, mtp_weight: float = 0.3, mtp_seed: int = 0,
          timeout: float | None = None, **schedule_options) -> HFRankStages:
    """Rank ``rank``'s stages of ``model`` (a ``transformers`` causal LM) under ``schedule`` on
    ``num_ranks`` ranks (both default to the process group's, when torch.distributed is up).

    ``layout``: a layout string (``twinpipe.hf.layout``); without one the stages are balanced by
    ``balance``: ``"params"`` (parameter counts, the embedding and the head included) or ``"time"``
    (forward+backward time of each item measured on ``sample``, a ``[batch, sequence]`` tensor of
    token ids; the ranks' measurements are summed over ``process_group`` so that all cut alike, waiting at
    most ``timeout`` seconds: default the limit in force, ``twinpipe.runtime.waits``, else ``DEFAULT_TIMEOUT``).
    ``rotary``: ``"recompute"`` (each stage computes the rotary tables from the position ids: a
    little compute per stage, nothing sent) or ``"pass"`` (the first stage computes them once and
    they travel with the hidden states: two ``[1, S, rotary dim]`` tensors per message, and their
    zero gradients back). ``defer``: weight gradients of linear layers deferred to W ops (zero
    bubble schedules). The stages share the model's modules (build on a model of your own; the
    head gets its own copy of a tied weight where the two ends are on different stages' copies).
    ``wrap_layer``: called with each ``DecoderLayer`` this rank builds, returns the layer to use (a
    ``DecoderLayer`` subclass, e.g. a MoE layer declaring ``parts()`` for the F&B overlap; when one
    of this rank's layers declares parts, all its stages are ``HFPartedStage``).
    ``mtp_depth`` (DeepSeek-V3): D multi-token prediction layers on the last stage (``twinpipe.hf.mtp``;
    ``"config"``: the config's ``num_nextn_predict_layers``), initialised from ``mtp_seed`` alike on
    every rank; the criterion is then ``HFMTPLoss``: main loss + ``mtp_weight`` / D x the depths' losses.
    On a model whose MoE blocks ``shard_experts_`` spread over an EP group, the MTP layers' experts are
    spread over that group too (slot s runs expert s); the criterion adds the MTP layers to the last
    stage as parts after its own (``HFMTPLoss.stage_parts``): in a stage in parts, overlapped in F&B ops as
    the main layers are.
    """
    parts = model_parts(model, untested=untested)
    num_ranks, rank = _ranks(num_ranks, rank, process_group)
    check_choice(rotary, "rotary", ROTARY)
    check_bool(defer, "defer")
    depth = _mtp_depth(model, parts, mtp_depth, mtp_weight, mtp_seed)
    timeout = waits.timeout_for(timeout)
    spec = resolve(schedule, num_ranks, **schedule_options)
    n_stages = spec.placement.num_model_stages
    if layout is not None:
        items = parse_layout(layout, n_stages, len(parts.layers))
    else:
        check_choice(balance, "balance", BALANCE)
        weights = _param_weights(parts) if balance == "params" else _time_weights(parts, sample, process_group, timeout)
        items = balanced_layout(weights, n_stages)
    cut = _Cut(parts, spec, rank, items, depth)
    layers, kind = _stage_layers(cut, wrap_layer)
    modules, ends = _stage_modules(model, cut, layers, kind, rotary=rotary, defer=defer, mtp_seed=mtp_seed)
    criterion = CausalLMLoss(model.loss_function, parts.config.vocab_size, parts.aux)
    if depth:
        last = [m for m in modules if m.last]
        criterion = HFMTPLoss(criterion, last[0] if last else None, float(mtp_weight), depth)
    tied_keys = ("embed", "head") if cut.tie == "split" else ("embed", "mtp_embed") if depth and not cut.both_ends else ()
    weight = parts.embed_tokens.weight
    facts = {"model": type(model).__name__, "layers": len(parts.layers), "vocab": int(parts.config.vocab_size),
             "hidden": int(parts.config.hidden_size), "aux": list(parts.aux or ()), "layout": format_layout(items),
             "rotary": rotary, "tie": cut.tie, "mtp_depth": depth, "mtp_weight": float(mtp_weight) if depth else 0.0,
             "mtp_seed": mtp_seed if depth else 0}
    return HFRankStages(modules=modules, spec=spec, rank=rank, layout=format_layout(items), criterion=criterion,
                        tie=cut.tie, rotary=rotary, _ends=ends, _tied_like=(tuple(weight.shape), weight.dtype, weight.device),
                        facts=facts, mtp_depth=depth, _tied_keys=tied_keys)


def _ranks(num_ranks: int | None, rank: int | None, process_group) -> tuple[int, int]:
    """``build``'s ranks, checked: as given, else the process group's."""
    if dist.is_initialized():
        num_ranks = dist.get_world_size(process_group) if num_ranks is None else num_ranks
        rank = dist.get_rank(process_group) if rank is None else rank
    if num_ranks is None or rank is None:
        raise ValueError("num_ranks and rank: give both, or initialise torch.distributed first")
    check_int(num_ranks, "num_ranks", low=1)
    check_int(rank, "rank", low=0, high=num_ranks - 1)
    return num_ranks, rank


def _mtp_depth(model, parts: ModelParts, mtp_depth: int | str, mtp_weight: float, mtp_seed: int) -> int:
    """``build``'s MTP depth and options, checked."""
    depth = mtp_depth_of(model, mtp_depth)
    check_float(mtp_weight, "mtp_weight", low=0.0)
    check_int(mtp_seed, "mtp_seed", low=0)
    if depth and parts.aux:
        raise bad("mtp_depth", depth, "must be 0 with the router auxiliary loss on (output_router_logits)")
    return depth


class _Cut:
    """Where ``build`` cuts: this rank's stages and their model stages, the items of each model stage
    and its first decoder layer, how a tied embedding is held, the MTP depth."""

    def __init__(self, parts: ModelParts, spec: ScheduleSpec, rank: int, items: list, depth: int):
        placement = spec.placement
        n_stages = placement.num_model_stages
        self.parts, self.spec, self.rank, self.items, self.depth = parts, spec, rank, items, depth
        self.placement = placement
        self.mine = list(spec.stages_of(rank))
        self.model_stages = [placement.model_stage(s) for s in self.mine]
        # One rank holds both ends, one copy of each (a V schedule): decided from the placement alone, so
        # that every rank decides alike. Then a tied head and the MTP layers' embedding are the embedding itself.
        self.both_ends = placement.num_stages == n_stages and placement.rank_of(0) == placement.rank_of(n_stages - 1)
        self.tie = ("shared" if self.both_ends else "split") if parts.tied else "none"
        self.starts = [sum(stage.count("t") for stage in items[:k]) for k in range(n_stages)]


def _stage_layers(cut: _Cut, wrap_layer) -> tuple[dict, type]:
    """Each of this rank's model stages' decoder layers (``wrap_layer`` applied), and the one stage
    class for all of them (the pipeline overlaps F&B ops only when they agree)."""
    parts, items, starts = cut.parts, cut.items, cut.starts
    layers = {k: decoder_layers(parts, range(starts[k], starts[k] + items[k].count("t")), wrap_layer)
              for k in sorted(set(cut.model_stages))}
    kind = HFPartedStage if any(hasattr(layer, "parts") for ls in layers.values() for layer in ls.values()) else HFStage
    drops = [layer.index for ls in layers.values() for layer in ls.values() if drops_router_logits(layer)]
    if kind is HFPartedStage and parts.aux and drops:
        # Their router logits would be left in the Context past the parts' boundaries (layer.py).
        raise bad("wrap_layer", wrap_layer, f"gives layers that declare parts, and the router auxiliary loss is on: layers "
                  f"{drops} have a router whose logits their parts do not carry (twinpipe.hf.moe_layer.MoEDecoderLayer "
                  "does, on a model sharded by shard_experts_); or set config.output_router_logits=False")
    if cut.depth and sum(items[k][-1] == "L" for k in cut.model_stages) > 1:
        raise bad("mtp_depth", cut.depth, f"must be 0 for {cut.spec.name} on {cut.spec.num_ranks} ranks: rank {cut.rank} holds "
                                          "two copies of the last stage, and the MTP layers run in the one criterion of a rank")
    return layers, kind


def _stage_modules(model, cut: _Cut, layers: dict, kind: type, *, rotary: str, defer: bool, mtp_seed: int) -> tuple[list, dict]:
    """This rank's stage modules, in ``cut.mine``'s order, and the ends of its tied tensors: ``"embed"``,
    ``"head"``, ``"mtp_embed"`` -> ``[(stage, chain, parameter)]``."""
    parts, depth = cut.parts, cut.depth
    # The MTP layers' experts spread as the main layers' (the model sharded by shard_experts_).
    mtp_ep = ep_group_of(nn.ModuleList(parts.layers)) if depth else None
    modules, ends, built = [], {}, set()
    for s, k in zip(cut.mine, cut.model_stages):
        head = mtp = mtp_embed = None
        last = cut.items[k][-1] == "L"
        if last and cut.tie == "split":
            head = copy.deepcopy(parts.lm_head)  # its own parameter, equal to the embedding
        if last and depth:
            mtp = mtp_layers(model, depth, seed=mtp_seed, ep_group=mtp_ep)
            weight = parts.embed_tokens.weight
            mtp_embed = weight if cut.both_ends else nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
        module = kind(parts, cut.items[k], cut.starts[k], rotary=rotary, layers=layers[k], last=LastItems(head, mtp, mtp_embed))
        if k in built:  # a second copy of one model stage on this rank
            module = copy.deepcopy(module)
        built.add(k)
        if defer:
            defer_weight_grads(module)
        chain = cut.placement.chain_of_stage(s)
        if module.first:
            ends.setdefault("embed", []).append((s, chain, module.embed_tokens.weight))
        if module.last:
            ends.setdefault("head", []).append((s, chain, module.lm_head.weight))
            if depth:
                ends.setdefault("mtp_embed", []).append((s, chain, module.mtp_embed))
        modules.append(module)
    return modules, ends

def _param_weights(parts: ModelParts) -> list[float]:
    def count(*modules):
        return float(sum(p.numel() for m in modules for p in m.parameters()))

    return [count(parts.embed_tokens)] + [count(layer) for layer in parts.layers] + [count(parts.norm, parts.lm_head)]


def _time_weights(parts: ModelParts, sample, process_group, timeout: float) -> list[float]:
    """Median forward+backward seconds of the embedding, each layer and the head on ``sample``,
    measured on the first rank of ``process_group`` and sent to every rank (``train.balance``'s one rule)."""
    if not isinstance(sample, torch.Tensor) or sample.dim() != 2 or sample.is_floating_point():
        raise bad("sample", _shape(sample), "balance='time' measures each item: pass sample=, a [batch, sequence] tensor of token ids")
    stage = HFStage(parts, ["E"] + ["t"] * len(parts.layers) + ["L"], 0)

    def measure() -> list[float]:
        _, ctx = stage.enter(sample, torch.ones_like(sample))
        items = [stage.embed_tokens, *(lambda h, layer=layer: layer(h, ctx) for layer in stage.layers.values()),
                 lambda h: stage.lm_head(stage.norm(h))]
        return time_weights(items, sample, holder=stage)

    return measured_once(measure, len(parts.layers) + 2, process_group, timeout,
                         "broadcast of the measured layer times (balance='time')", sample.device)
