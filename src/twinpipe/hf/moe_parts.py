"""The parts of a decoder layer whose ``mlp`` is an ``EPMoE`` (``twinpipe.hf.moe_layer``'s table), on
the state ``(hidden, ctx)``: a ``MoEDecoderLayer``'s, and an MTP layer's after its input projection
(``twinpipe.hf.mtp.mtp_parts``)."""

from __future__ import annotations

import functools

from twinpipe.hf.layer import DecoderLayer
from twinpipe.overlap.parts import Compute

__all__ = ["moe_parts"]


def moe_parts(layer: DecoderLayer) -> list:
    """``attn`` (attention, then the router), then the ``EPMoE``'s exchange parts."""
    return [Compute("attn", functools.partial(_attn, layer)), *layer.mlp.exchange_parts()]


def _attn(layer: DecoderLayer, hidden, ctx):
    h = layer.attention(hidden, ctx)
    return layer.mlp.route(h, layer.post_attention_layernorm(h), ctx)
