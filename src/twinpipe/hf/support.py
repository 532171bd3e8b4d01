"""Which ``transformers`` models ``twinpipe.hf`` runs, and what it reads from them.

A supported model is a decoder-only causal LM of the usual shape (``model.embed_tokens``,
``model.layers`` of pre-norm decoder layers, ``model.norm``, ``model.rotary_emb``, ``lm_head``) of
one of the tested architectures (``TESTED``). Anything else gets an ``UnsupportedModelError``
naming what is missing. A model of that shape whose ``model_type`` is not in ``TESTED`` is run
through a numerical self-check first (``twinpipe.hf.self_check``: a small copy of it, the stages
against its own forward) and accepted, with an ``UntestedModelWarning``, only when they agree;
``model_parts`` (in ``self_check``, above the stage module it runs) does both.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from torch import nn

from twinpipe.hf.layer import HALVES
from twinpipe.runtime.errors import PipelineError

__all__ = ["TESTED", "UnsupportedModelError", "UntestedModelWarning", "ModelParts", "MASK_KINDS"]

# model_type -> what it is; each is tested exact against the unsplit model (tests/test_hf_stages.py,
# tests/test_hf_archs.py).
TESTED = MappingProxyType({
    "llama": "Llama (GQA; tied or untied embeddings)",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE (router auxiliary loss carried)",
    "mixtral": "Mixtral (router auxiliary loss carried)",
    "deepseek_v3": "DeepSeek-V3 (MLA, first dense layers, group-limited routing, shared experts)",
    "mistral": "Mistral (sliding-window attention)",
    "qwen2": "Qwen2 (q, k, v biases; sliding-window layers by layer_types)",
    "qwen2_moe": "Qwen2-MoE (shared expert with its sigmoid gate, dense layers; router auxiliary loss carried)",
    "phi3": "Phi-3 (fused qkv and gate_up projections; resid_pdrop=0 only)",
    "olmo": "OLMo (LayerNorm without parameters, clip_qkv)",
    "starcoder2": "Starcoder2 (biases, LayerNorm, plain MLP, tied embeddings; embedding_dropout=0 only)",
    "glm": "GLM (partial, interleaved rotary)",
    "gemma": "Gemma (embeddings scaled inside their module, (1 + w) norms, tied embeddings)",
    "olmoe": "OLMoE (MoE in every layer, q and k norms; router auxiliary loss carried)",
    "smollm3": "SmolLM3 (layers without rotary, sliding-window layers by layer_types, tied embeddings)",
})

MASK_KINDS = ("full_attention", "sliding_attention")  # the masks a stage makes (twinpipe.hf.stages)


class UnsupportedModelError(PipelineError, ValueError):
    """The model is not a causal LM that ``twinpipe.hf`` can cut into stages."""


class UntestedModelWarning(UserWarning):
    """The model's architecture is not one ``twinpipe.hf`` is tested on; its stages passed the self-check."""


@dataclass(kw_only=True)
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


def _structure(model) -> ModelParts:
    """``model``'s pieces when it has the shape stages are made of (no numerical check)."""
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
    layers = list(inner.layers)[: getattr(config, "num_hidden_layers", None)]
    for i, layer in enumerate(layers):
        absent = [h for h in HALVES if not isinstance(getattr(layer, h, None), nn.Module)]
        if absent:
            raise UnsupportedModelError(f"model={name}: model.layers[{i}] ({type(layer).__name__}) has no "
                                        f"{', '.join(absent)}; a decoder layer must have {', '.join(HALVES)}"
                                        + _layer_hint(layer))
    kinds = _mask_kinds(config, len(layers))
    other = sorted(set(kinds) - set(MASK_KINDS))
    if other:
        raise UnsupportedModelError(f"model={name}: config.layer_types has {', '.join(map(repr, other))}; twinpipe.hf "
                                    f"makes the masks of {' and '.join(MASK_KINDS)} layers only")
    return ModelParts(
        model=model, config=config, embed_tokens=inner.embed_tokens, layers=layers, norm=inner.norm,
        lm_head=model.lm_head, rotary_emb=inner.rotary_emb, mask_kinds=kinds,
        routers=_routers(model, layers), tied=model.lm_head.weight is inner.embed_tokens.weight,
        aux=_aux(model, config),
    )


def _layer_hint(layer) -> str:
    """What a layer without the pre-norm halves looks like it does instead."""
    def has(name):
        return isinstance(getattr(layer, name, None), nn.Module)

    if has("post_feedforward_layernorm") and not has("input_layernorm"):
        return " (its norms come after attention and MLP: post-norm layers, as OLMo2's, which the stages do not compute)"
    if has("input_layernorm") and not has("post_attention_layernorm"):
        return (" (one norm before attention and MLP: parallel attention and MLP, as Cohere's, which the stages do not "
                "compute)")
    return ""


# config attribute -> what it is; a value other than ``neutral`` makes the model's forward differ
# from the stages' (each is applied in the model's or the decoder layer's forward, not in a module).
CONFIG_EXTRAS = (
    ("embedding_multiplier", 1.0, "an embedding multiplier (Granite)"),
    ("residual_multiplier", 1.0, "a residual multiplier in every layer (Granite)"),
    ("logits_scaling", 1.0, "logits divided by logits_scaling (Granite)"),
    ("logit_scale", 1.0, "logits multiplied by logit_scale (Cohere)"),
    ("final_logit_softcapping", None, "final logit soft-capping (Gemma2)"),
    ("scale_emb", 1.0, "an embedding scale (MiniCPM)"),
    ("scale_depth", 1.0, "a residual scale (MiniCPM)"),
    ("use_parallel_residual", False, "parallel attention and MLP (use_parallel_residual)"),
    ("embedding_dropout", 0.0, "dropout on the embeddings (Starcoder2)"),
)


def known_extras(parts: ModelParts) -> list[str]:
    """What the model's forward is known to do besides the stages' ``embed -> layers -> norm -> head``:
    config values that change it, modules of a decoder layer the stages do not run, dropouts outside
    the attention and MLP modules. Empty when none is found (the self-check looks for the rest)."""
    found = []
    for key, neutral, what in CONFIG_EXTRAS:
        value = getattr(parts.config, key, neutral)
        if value is not None and value != neutral and not (neutral is None and value is False):
            found.append(f"{what}: config.{key}={value!r}")
    extra = sorted({n for layer in parts.layers for n, m in layer.named_children()
                    if n not in HALVES and any(True for _ in m.parameters())})
    extra += sorted({n for layer in parts.layers for n, _ in layer.named_parameters(recurse=False)})
    if extra:
        kind = type(parts.layers[0]).__name__
        found.append(f"its decoder layers ({kind}) have {', '.join(extra)} besides {', '.join(HALVES)}, which the "
                     "stages do not run (extra norms, as Gemma2's pre/post feed-forward norms? a scale?)")
    inner = parts.model.model
    outside = [(f"model.layers[{i}].{n}", m) for i, l in enumerate(parts.layers) for n, m in l.named_children()
               if n not in HALVES]
    outside += [(f"model.{n}", m) for n, m in inner.named_children() if n not in ("embed_tokens", "layers", "norm", "rotary_emb")]
    dropouts = [f"{where} (p={m.p})" for where, m in outside if isinstance(m, nn.Dropout) and m.p > 0]
    if dropouts:
        found.append(f"dropout the stages do not apply: {', '.join(dropouts[:3])}{' ...' if len(dropouts) > 3 else ''}; "
                     "set it to 0")
    return found


# How each tested model's forward (its transformers source) picks its layers' masks: "full" (the causal
# mask for every layer, whatever the config says), "window" (every layer sliding when
# config.sliding_window is set), "types" (by config.layer_types). Other models: "types" when the
# config has layer_types, else "window" when it has a sliding window, else "full" (the self-check,
# with a window shorter than its batch, finds out when that is not what the model does).
MASK_RULES = MappingProxyType({
    "llama": "full", "deepseek_v3": "full", "olmo": "full", "glm": "full", "gemma": "full", "olmoe": "full",
    "mistral": "window", "mixtral": "window", "qwen3_moe": "window", "phi3": "window", "starcoder2": "window",
    "qwen3": "types", "qwen2": "types", "qwen2_moe": "types", "smollm3": "types",
})


def _mask_kinds(config, n: int) -> list[str]:
    """Each layer's mask kind, as the model's forward picks it (``MASK_RULES``)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None) is not None
    rule = MASK_RULES.get(getattr(config, "model_type", None))
    if rule is None:
        rule = "types" if types is not None else "window" if window else "full"
    if rule == "types" and types is not None:
        return [str(t) for t in types[:n]]
    return ["sliding_attention" if rule == "window" and window else "full_attention"] * n


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
