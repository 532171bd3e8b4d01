"""One Hugging Face decoder layer in a pipeline stage, and the convention every layer follows.

The convention (stable: ``twinpipe.hf`` stages and MoE layers with parts are built on it):

- **Between stages** flows a tuple of tensors (``Pipeline`` messages): a first stage takes
  ``(input_ids, attention_mask)``, both ``[B, S]`` int64 (``attention_mask`` is the 2D padding mask,
  1 = token, all ones when the user gave none); every other stage takes and returns
  ``(hidden, attention_mask)`` with ``hidden`` ``[B, S, H]``, followed by ``(cos, sin)`` (each
  ``[1, S, rotary dim]``) when rotary tables are passed rather than recomputed, followed by
  ``(tokens_per_expert, router_prob, rows)`` (float32 ``[E]``, ``[E]``, ``[1]``: the
  load-balancing loss's running sums) when the router auxiliary loss is on; the last stage returns
  the logits ``[B, S, V]`` (followed by those sums, which the criterion reads, when it is on).
- **Inside a stage** each layer takes and returns ``hidden`` with a ``Context`` beside it:
  ``layer(hidden, ctx) -> hidden``. The stage builds the context once per micro-batch (position ids
  ``[1, S]``, each mask kind's mask made by the model's own ``transformers.masking_utils`` functions,
  the rotary ``(cos, sin)``), so a layer sees exactly what the unsplit model's forward gives it.
- **A layer in halves**: ``attention(hidden, ctx)`` is ``hidden + self_attn(input_layernorm(hidden))``
  and ``feed_forward(hidden, ctx)`` is ``hidden + mlp(post_attention_layernorm(hidden))``;
  ``forward`` runs one then the other, as every supported model's decoder layer does. A MoE layer
  that declares ``parts()`` (``twinpipe.overlap``) works on the state ``(hidden, ctx)``: its first
  part takes it, its last part returns it; the stage adds an entry part (flow -> ``(hidden, ctx)``)
  and an exit part (``(hidden, ctx)`` -> flow or logits) around its layers' parts.
- **Router logits** (for the auxiliary loss): when ``ctx.router_logits`` is a list, a MoE layer
  appends its router's logits ``[B*S, E]`` to it (``feed_forward`` does so through a hook on the
  router); the stage folds them into the running sums in layer order. A layer in parts must append
  only a tensor its part *received* in the state (the overlap engine makes each received tensor a
  leaf of that part's graph; the exit part's backward adds the logits' gradient to that leaf's
  ``.grad``, which the part's own backward then hands on), never one the part computed (the exit
  part's backward would run through that part's graph, and the part's backward a second time).
  ``twinpipe.hf.moe_layer.MoEDecoderLayer`` does so (``parts_carry_router_logits``); ``build``
  refuses any other layer with a router in a stage in parts (``drops_router_logits``).

The wrapper registers the HF layer's own children under their own names (``self_attn``, ``mlp``,
``input_layernorm``, ``post_attention_layernorm``), so its parameter names are the HF layer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Context", "DecoderLayer", "HALVES", "drops_router_logits"]

HALVES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")  # what a layer must have


@dataclass(kw_only=True)
class Context:
    """What every layer of a stage needs besides ``hidden``, built once per micro-batch by the stage."""

    attention_mask: torch.Tensor  # [B, S] padding mask, 1 = token
    position_ids: torch.Tensor  # [1, S]: 0..S-1, as the unsplit model's default
    position_embeddings: tuple  # (cos, sin) from the model's rotary embedding
    masks: dict = field(default_factory=dict)  # mask kind ("full_attention", "sliding_attention") -> mask or None
    router_logits: list | None = None  # a list when the router auxiliary loss is on (see the module doc)
    aux_sums: tuple | None = None  # the auxiliary loss's running sums received by the stage (when on)
    carry: tuple = ()  # tensors a later part returns (the MTP layers' parts: the stage's outputs, each h^k)


class DecoderLayer(nn.Module):
    """A ``transformers`` decoder layer, number ``index`` of the model, whose masks are of ``mask_kind``."""

    # True in a subclass whose parts hand the router logits to ``ctx`` as the module doc says.
    parts_carry_router_logits = False

    def __init__(self, layer: nn.Module, index: int, mask_kind: str = "full_attention", router: nn.Module | None = None):
        super().__init__()
        missing = [name for name in HALVES if not isinstance(getattr(layer, name, None), nn.Module)]
        if missing:
            raise ValueError(f"model.layers[{index}]={type(layer).__name__}: has no {', '.join(missing)}; "
                             f"a decoder layer must have {', '.join(HALVES)}")
        for name, child in layer.named_children():
            self.add_module(name, child)
        for name, param in layer.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.index = index
        self.mask_kind = mask_kind
        self.kind = type(layer).__name__
        self.__dict__["router"] = router  # not registered again: it is a module inside mlp

    def attention(self, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The first half: ``hidden + self_attn(input_layernorm(hidden))``."""
        residual = hidden
        hidden = self.input_layernorm(hidden)
        hidden, _ = self.self_attn(
            hidden_states=hidden,
            attention_mask=ctx.masks[self.mask_kind],
            position_ids=ctx.position_ids,
            position_embeddings=ctx.position_embeddings,
        )
        return residual + hidden

    def feed_forward(self, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The second half: ``hidden + mlp(post_attention_layernorm(hidden))``; router logits go to
        ``ctx.router_logits`` when it is a list."""
        residual = hidden
        hidden = self.post_attention_layernorm(hidden)
        collect = ctx.router_logits if self.router is not None else None
        if collect is None:
            return residual + self.mlp(hidden)
        # A hook for this call only, so that copies of the model (deepcopy) carry none.
        handle = self.router.register_forward_hook(
            lambda module, args, out: collect.append(out[0] if isinstance(out, tuple) else out))
        try:
            hidden = self.mlp(hidden)
        finally:
            handle.remove()
        return residual + hidden

    def forward(self, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.feed_forward(self.attention(hidden, ctx), ctx)

    def extra_repr(self) -> str:
        return f"{self.kind} {self.index} ({self.mask_kind})"


def drops_router_logits(layer: nn.Module) -> bool:
    """A layer that, run as a part of a stage in parts, would leave router logits it computed in the
    ``Context`` (see the module doc): it has a router and its parts do not carry the logits."""
    return getattr(layer, "router", None) is not None and not getattr(layer, "parts_carry_router_logits", False)
