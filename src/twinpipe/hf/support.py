"""Which ``transformers`` models ``twinpipe.hf`` runs, and what it reads from them.

A supported model is a decoder-only causal LM of the usual shape (``model.embed_tokens``,
``model.layers`` of pre-norm decoder layers, ``model.norm``, ``model.rotary_emb``, ``lm_head``) of
one of the tested architectures (``TESTED``). Anything else gets an ``UnsupportedModelError``
naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from twinpipe.hf.layer import HALVES
from twinpipe.runtime.errors import PipelineError

__all__ = ["TESTED", "UnsupportedModelError", "ModelParts", "model_parts"]

# model_type -> what it is; each is tested exact against the unsplit model (tests/test_hf_stages.py).
TESTED = {
    "llama": "Llama (GQA; tied or untied embeddings)",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE (router auxiliary loss carried)",
    "mixtral": "Mixtral (router auxiliary loss carried)",
    "deepseek_v3": "DeepSeek-V3 (MLA, first dense layers, group-limited routing, shared experts)",
}


class UnsupportedModelError(PipelineError, ValueError):
    """The model is not a causal LM that ``twinpipe.hf`` can cut into stages."""


@dataclass
class ModelParts:
    """The pieces of a causal LM that stages are made of (shared with the model, not copies)."""

    model: nn.Module  # the ...ForCausalLM
    config: object
    embed_tokens: nn.Module
    layers: list
    norm: nn.Module
    lm_head: nn.Module
    rotary_emb: nn.Module
    mask_kinds: list  # per layer: "full_attention" or "sliding_attention"
    routers: list  # per layer: the router module whose logits the auxiliary loss reads, or None
    tied: bool  # lm_head.weight is embed_tokens.weight
    aux: tuple | None  # (num_experts, top_k, coef) when the router auxiliary loss is on


def model_parts(model, *, untested: bool = False) -> ModelParts:
    """``model``'s pieces, or an ``UnsupportedModelError`` naming what is missing.

    ``untested=True`` accepts a model of the right shape whose ``model_type`` is not in ``TESTED``
    (at the user's risk: its decoder layers must compute ``h + attn(norm1(h))`` then
    ``h + mlp(norm2(h))``, as every tested model's do).
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or config is None:
        raise UnsupportedModelError(f"model={name}: must be a transformers causal LM (an nn.Module with .config)")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model={name}: is an encoder-decoder; twinpipe.hf runs decoder-only causal LMs "
                                    "(model.embed_tokens, model.layers, model.norm, lm_head)")
    inner = getattr(model, "model", None)
    missing = [] if isinstance(inner, nn.Module) else ["model"]
    if inner is not None:
        missing += [f"model.{a}" for a in ("embed_tokens", "norm", "rotary_emb") if not isinstance(getattr(inner, a, None), nn.Module)]
        if not isinstance(getattr(inner, "layers", None), nn.ModuleList):
            missing.append("model.layers (an nn.ModuleList)")
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        missing.append("lm_head")
    if missing:
        raise UnsupportedModelError(f"model={name}: has no {', '.join(missing)}; twinpipe.hf runs decoder-only causal LMs "
                                    "made of model.embed_tokens, model.layers, model.norm, model.rotary_emb and lm_head")
    kind = getattr(config, "model_type", None)
    if kind not in TESTED and not untested:
        raise UnsupportedModelError(f"model={name}: model_type={kind!r} is not one twinpipe.hf is tested on "
                                    f"({', '.join(TESTED)}); pass untested=True to try a model of the same shape")
    layers = list(inner.layers)[: config.num_hidden_layers]
    for i, layer in enumerate(layers):
        absent = [h for h in HALVES if not isinstance(getattr(layer, h, None), nn.Module)]
        if absent:
            raise UnsupportedModelError(f"model={name}: model.layers[{i}] ({type(layer).__name__}) has no "
                                        f"{', '.join(absent)}; a decoder layer must have {', '.join(HALVES)}")
    return ModelParts(
        model=model, config=config, embed_tokens=inner.embed_tokens, layers=layers, norm=inner.norm,
        lm_head=model.lm_head, rotary_emb=inner.rotary_emb, mask_kinds=_mask_kinds(inner, config, len(layers)),
        routers=_routers(model, layers), tied=model.lm_head.weight is inner.embed_tokens.weight,
        aux=_aux(model, config),
    )


def _mask_kinds(inner, config, n: int) -> list[str]:
    """Each layer's mask, as the model's forward picks it: by ``config.layer_types`` (Qwen3),
    else sliding for every layer when ``config.sliding_window`` is set (Mixtral, Qwen3-MoE), else full."""
    types = getattr(config, "layer_types", None)
    if types is not None and hasattr(inner, "has_sliding_layers"):
        return [str(t) for t in types[:n]]
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _routers(model, layers) -> list:
    """Per layer, the module whose output ``[0]`` the model records as ``router_logits`` (None if none)."""
    recorder = getattr(type(model), "_can_record_outputs", None) or {}  # declared by the model's base class
    target = recorder.get("router_logits")
    kind = getattr(target, "target_class", None)
    routers = []
    for layer in layers:
        found = None
        if kind is not None:
            found = next((m for m in layer.mlp.modules() if isinstance(m, kind)), None)
        routers.append(found)
    return routers


def _aux(model, config) -> tuple | None:
    """``(num_experts, top_k, coef)`` when the model adds the router auxiliary loss to its loss."""
    coef = getattr(model, "router_aux_loss_coef", None)
    if coef is None or not getattr(config, "output_router_logits", False):
        return None
    return int(model.num_experts), int(model.num_experts_per_tok), float(coef)
