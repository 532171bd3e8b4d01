"""One stage module of a ``transformers`` causal LM (``HFStage``, and ``HFPartedStage`` for the
overlap engine) and its criterion (``CausalLMLoss``).

``HFStage`` runs a contiguous run of the model's items (``E`` embedding, ``t`` decoder layers, ``L``
final norm + LM head) exactly as the unsplit model's forward does; the tuples that flow between
stages are described in ``twinpipe.hf.layer``. Below ``twinpipe.hf.self_check``, which compares
such stages with the model's own forward, and ``twinpipe.hf.stages``, which builds a rank's stages.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import nn

from twinpipe.checks import bad
from twinpipe.hf.layer import Context, DecoderLayer
from twinpipe.hf.layout import format_layout
from twinpipe.hf.mtp import copy_name as mtp_copy_name, mtp_parts
from twinpipe.hf.support import ModelParts
from twinpipe.overlap import stage as overlap_stage
from twinpipe.overlap.parts import Compute

__all__ = ["HFStage", "HFPartedStage", "LastItems", "CausalLMLoss", "count_items", "ROTARY", "IGNORE_INDEX"]


ROTARY = ("recompute", "pass")
IGNORE_INDEX = -100


class LastItems(NamedTuple):
    """What a last stage may hold of its own: a ``head`` (a tied head's copy, when the two ends are on
    different stages), DeepSeek-V3's ``mtp`` layers and their embedding copy ``mtp_embed``. None:
    the model's head, no MTP layers."""

    head: nn.Module | None = None
    mtp: nn.ModuleList | None = None
    mtp_embed: nn.Parameter | None = None


class HFStage(nn.Module):
    """Items ``items`` (``"E"``, ``"t"``, ``"L"``) of ``parts``' model, its decoder layers numbered
    from ``first_layer``. Parameter names are the stage's; ``named_model_parameters()`` gives the
    names they have in the unsplit model (``model.layers.3.mlp...``, ``lm_head.weight``)."""

    def __init__(self, parts: ModelParts, items: Sequence[str], first_layer: int, *, rotary: str = "recompute",
                 layers: dict | None = None, last: LastItems | None = None):
        super().__init__()
        head, mtp, mtp_embed = last if last is not None else LastItems()
        self.items = tuple(items)
        self.first, self.last = self.items[0] == "E", self.items[-1] == "L"
        self.rotary = rotary
        self.__dict__["config"] = parts.config  # shared with the model, not a submodule
        self.aux = parts.aux
        if self.first:
            self.embed_tokens = parts.embed_tokens
        count = self.items.count("t")
        self.layer_ids = list(range(first_layer, first_layer + count))
        if layers is None:
            layers = decoder_layers(parts, self.layer_ids)
        self.layers = nn.ModuleDict({str(i): layers[i] for i in self.layer_ids})
        self.mask_kinds = sorted({parts.mask_kinds[i] for i in self.layer_ids})
        if self.first or (count and rotary == "recompute"):
            self.rotary_emb = parts.rotary_emb
        if self.last:
            self.norm = parts.norm
            self.lm_head = head if head is not None else parts.lm_head
        if self.last and mtp is not None and len(mtp):  # multi-token prediction (twinpipe.hf.mtp)
            self.mtp, self.mtp_embed = mtp, mtp_embed
            self.rotary_emb = parts.rotary_emb
            self._mtp_padding = parts.embed_tokens.padding_idx

    # ------------------------------------------------------------------ names in the unsplit model
    def named_model_parameters(self):
        """``(name in the unsplit model, parameter)`` pairs, in model order."""
        if self.first:
            for sub, p in self.embed_tokens.named_parameters():
                yield f"model.embed_tokens.{sub}", p
        for i, layer in self.layers.items():
            for sub, p in layer.named_parameters():
                yield f"model.layers.{i}.{sub}", p
        if self.last:
            for sub, p in self.norm.named_parameters():
                yield f"model.norm.{sub}", p
            for sub, p in self.lm_head.named_parameters():
                yield f"lm_head.{sub}", p
            if hasattr(self, "mtp"):
                for layer in self.mtp:
                    for sub, p in layer.named_parameters():
                        yield f"model.layers.{layer.index}.{sub}", p
                yield mtp_copy_name(self.config), self.mtp_embed

    def named_model_buffers(self):
        """``(name in the unsplit model, buffer)`` of the persistent buffers (those a checkpoint stores:
        DeepSeek-V3's routing biases ``mlp.gate.e_score_correction_bias``), in model order."""
        held = [("model.embed_tokens.", self.embed_tokens)] if self.first else []
        held += [(f"model.layers.{i}.", layer) for i, layer in self.layers.items()]
        if self.last:
            held += [("model.norm.", self.norm), ("lm_head.", self.lm_head)]
        held += [(f"model.layers.{layer.index}.", layer) for layer in getattr(self, "mtp", ())]
        for prefix, sub in held:
            params = {key for key, _ in sub.named_parameters()}
            for key, t in sub.state_dict(keep_vars=True).items():
                if key not in params:
                    yield prefix + key, t

    # ------------------------------------------------------------------ MTP (twinpipe.hf.mtp, train.mtp.MTPLoss)
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The shared output head without the final norm (each MTP layer applies its own first)."""
        return self.lm_head(hidden)

    def mtp_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embedding, through the last stage's copy (or the embedding itself)."""
        return torch.nn.functional.embedding(ids, self.mtp_embed, self._mtp_padding)

    def mtp_parts(self, next_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list:
        """The MTP layers as parts after the stage's own, for a criterion's ``stage_parts``
        (``twinpipe.hf.mtp.mtp_parts``: from ``(logits, h^0)`` to ``(logits, h^0, h^1, ..., h^D)``)."""
        return mtp_parts(self, next_ids, attention_mask)

    # ------------------------------------------------------------------ the flow (see layer.py)
    def enter(self, *flow) -> tuple:
        """The stage's inputs -> ``(hidden, ctx)``."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        aux_sums = None
        if self.first:
            input_ids, attention_mask = flow[:2]
            hidden = self.embed_tokens(input_ids)
            cos_sin = None
            if self.aux:
                zeros = torch.zeros(self.aux[0], dtype=torch.float32, device=hidden.device)
                aux_sums = (zeros, zeros.clone(), torch.zeros(1, dtype=torch.float32, device=hidden.device))
        else:
            hidden, attention_mask = flow[:2]
            rest = flow[2:]
            cos_sin = tuple(rest[:2]) if self.rotary == "pass" else None
            if self.aux:
                aux_sums = tuple(rest[-3:])
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        if cos_sin is None and hasattr(self, "rotary_emb"):
            cos_sin = self.rotary_emb(hidden, position_ids)
        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks = {kind: makers[kind](config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
                                    position_ids=position_ids) for kind in self.mask_kinds}
        ctx = Context(attention_mask=attention_mask, position_ids=position_ids, position_embeddings=cos_sin, masks=masks,
                      router_logits=[] if self.aux else None, aux_sums=aux_sums)
        return hidden, ctx

    def exit(self, hidden, ctx) -> tuple:
        """``(hidden, ctx)`` -> the stage's outputs: the next stage's flow, or the logits."""
        aux = ()
        if self.aux:
            aux = _fold_router_logits(ctx.aux_sums, ctx.router_logits, ctx.attention_mask, self.aux[0], self.aux[1])
        if self.last:
            logits = self.lm_head(self.norm(hidden))
            if hasattr(self, "mtp"):  # h^0 for the MTP layers, which the criterion adds after these parts
                return (logits, hidden, *aux)
            return (logits, *aux)
        passed = tuple(ctx.position_embeddings) if self.rotary == "pass" else ()
        return (hidden, ctx.attention_mask, *passed, *aux)

    def forward(self, *flow):
        hidden, ctx = self.enter(*flow)
        for layer in self.layers.values():
            hidden = layer(hidden, ctx)
        out = self.exit(hidden, ctx)
        return out[0] if len(out) == 1 else out

    def extra_repr(self) -> str:
        return format_layout([self.items]) + (f" (layers {self.layer_ids[0]}..{self.layer_ids[-1]})" if self.layer_ids else "")


class HFPartedStage(HFStage, overlap_stage.PartedStage):
    """An ``HFStage`` whose layers declare parts (MoE layers with expert parallelism): in F&B ops
    (DualPipe, DualPipeV) one micro-batch's forward parts run interleaved with another's backward
    parts. Results are those of ``HFStage``."""

    overlap = True

    def parts(self) -> list:
        out = [Compute("enter", self.enter)]
        for i, layer in self.layers.items():
            if hasattr(layer, "parts"):
                out += [Compute(f"{i}.{p.name}", p.fn) if isinstance(p, Compute) else _renamed(p, f"{i}.{p.name}")
                        for p in layer.parts()]
            else:
                out.append(Compute(f"{i}.layer", _layer_part(layer)))
        out.append(Compute("exit", self.exit))
        return out

    forward = overlap_stage.PartedStage.forward


def decoder_layers(parts: ModelParts, ids, wrap_layer=None) -> dict:
    """Layer number -> its ``DecoderLayer`` (or what ``wrap_layer`` makes of it)."""
    layers = {i: DecoderLayer(parts.layers[i], i, parts.mask_kinds[i], parts.routers[i] if parts.aux else None) for i in ids}
    return layers if wrap_layer is None else {i: _wrapped(wrap_layer, layer) for i, layer in layers.items()}


def _wrapped(wrap_layer, layer: DecoderLayer) -> nn.Module:
    new = wrap_layer(layer)
    if not isinstance(new, DecoderLayer):
        raise bad("wrap_layer", wrap_layer, f"must return a twinpipe.hf.DecoderLayer (or subclass); it returned a "
                                            f"{type(new).__name__} for layer {layer.index}")
    return new


def _renamed(part, name):
    import dataclasses

    return dataclasses.replace(part, name=name)


def _layer_part(layer):
    def run(hidden, ctx):
        return layer(hidden, ctx), ctx

    return run


def _fold_router_logits(sums, logits: list, attention_mask, num_experts: int, top_k: int) -> tuple:
    """Add each layer's router logits to the load-balancing loss's running sums, in layer order,
    with the arithmetic of ``transformers``' ``load_balancing_loss_func`` (masked branch)."""
    tokens_per_expert, router_prob, rows = sums
    if logits:
        flat_mask = attention_mask.reshape(-1).to(dtype=torch.float32)
        for layer_gate in logits:
            routing_weights = torch.nn.functional.softmax(layer_gate, dim=-1)
            _, selected = torch.topk(routing_weights, top_k, dim=-1)
            tokens_per_expert = tokens_per_expert + torch.zeros(num_experts, dtype=torch.float32, device=layer_gate.device
                                                                ).scatter_add_(0, selected.reshape(-1), flat_mask.repeat_interleave(top_k))
            router_prob = router_prob + (routing_weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + flat_mask.sum()
    return tokens_per_expert, router_prob, rows


class CausalLMLoss:
    """The criterion for ``Pipeline.step``: the model's own causal LM loss of one micro-batch
    (``model.loss_function``: labels shifted, -100 ignored), summed over its tokens and divided by
    the number of counted tokens of the WHOLE batch (``num_items_in_batch``, what ``transformers``
    does under gradient accumulation), so the micro-batches' losses add up to the whole batch's
    mean. With the router auxiliary loss on, ``coef * aux`` of the micro-batch is added, as the
    model's forward adds it: step() losses are then those of the model called on each micro-batch
    with ``num_items_in_batch``.

    Called as ``criterion(logits, [tokens_per_expert, router_prob, rows,] labels, num_items)``:
    ``num_items`` holds the batch's count in every row (``HFRankStages.batch`` makes it)."""

    def __init__(self, loss_function, vocab_size: int, aux: tuple | None = None):
        self.loss_function, self.vocab_size, self.aux = loss_function, vocab_size, aux

    def __call__(self, logits, *rest):
        if self.aux:
            (tokens_per_expert, router_prob, rows), (labels, num_items) = rest[:3], rest[3:]
        else:
            labels, num_items = rest
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size,
                                  num_items_in_batch=num_items[0])
        if self.aux:
            num_experts, _, coef = self.aux
            overall = torch.sum((tokens_per_expert / rows) * (router_prob / rows).unsqueeze(0))
            loss = loss + coef * (overall * num_experts)
        return loss


def count_items(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """The tokens the causal LM loss counts in ``labels`` ``[B, S]``: after the shift, those != -100."""
    return int((labels[..., 1:] != ignore_index).sum())
