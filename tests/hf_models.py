"""Tiny ``transformers`` causal LMs with random float64 weights, for the ``twinpipe.hf`` tests.

Attention is ``sdpa``: HF's ``eager`` attention gives NaN on left-padded rows in float64 (a fully
masked query row: its additive mask plus a score overflows to -inf, and the NaN spreads through the
padded values), while ``sdpa`` gives finite results, equal bit for bit from run to run on CPU.
"""

from __future__ import annotations

import torch

VOCAB, HIDDEN, LAYERS = 64, 16, 6
# Expert parallelism reorders sums (the all-to-all): a reordered sum of n float64 terms differs by at
# most about n * 2**-53 of the sum of their magnitudes; the sums here have at most a few hundred terms
# of like size: 1e-12 (relative to the largest reference value, ``rel``) leaves a margin.
EP_BOUND = 1e-12

COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
              max_position_embeddings=64, attn_implementation="sdpa", experts_implementation="eager",
              pad_token_id=0)


def config(arch: str, *, tied: bool = False, aux: bool = False, layers: int = LAYERS):
    """The config of a tiny ``arch`` model (llama, qwen3, qwen3_moe, mixtral, deepseek_v3, and those of
    ``MORE``)."""
    import transformers as tf

    common = dict(COMMON, num_hidden_layers=layers, tie_word_embeddings=tied)
    if arch == "llama":
        return tf.LlamaConfig(**common, intermediate_size=32, num_key_value_heads=2)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, intermediate_size=32, num_key_value_heads=2, head_dim=8)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=32, moe_intermediate_size=8, num_key_value_heads=2, head_dim=8,
                                 num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[],
                                 output_router_logits=aux, router_aux_loss_coef=0.01)
    if arch == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=16, num_key_value_heads=2, num_local_experts=4,
                                num_experts_per_tok=2, output_router_logits=aux, router_aux_loss_coef=0.02)
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(**common, intermediate_size=32, moe_intermediate_size=8, num_key_value_heads=4,
                                   n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                                   first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
                                   qk_nope_head_dim=4, v_head_dim=4, routed_scaling_factor=1.5, norm_topk_prob=True)
    if arch in MORE:
        return MORE[arch](tf, common, aux)
    raise ValueError(f"arch={arch!r}")


def _qwen2_moe(tf, common, aux):
    # Layer 1 dense (mlp_only_layers), the others MoE with the shared expert and its gate; layers 1.. slide.
    return tf.Qwen2MoeConfig(**common, intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=16,
                             num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                             use_sliding_window=True, sliding_window=3, max_window_layers=1,
                             output_router_logits=aux, router_aux_loss_coef=0.01)


# More architectures (tests/test_hf_archs.py): each a small config exercising what is its own.
MORE = {
    # every layer sliding (window 3, shorter than the test sequences)
    "mistral": lambda tf, c, aux: tf.MistralConfig(**c, intermediate_size=32, num_key_value_heads=2, sliding_window=3),
    # biases on q, k, v; layers 1.. sliding by config.layer_types
    "qwen2": lambda tf, c, aux: tf.Qwen2Config(**c, intermediate_size=32, num_key_value_heads=2, use_sliding_window=True,
                                               sliding_window=3, max_window_layers=1),
    "qwen2_moe": _qwen2_moe,
    # fused qkv and gate_up projections
    "phi3": lambda tf, c, aux: tf.Phi3Config(**c, intermediate_size=32, num_key_value_heads=2),
    # LayerNorm without parameters, clipped q, k, v
    "olmo": lambda tf, c, aux: tf.OlmoConfig(**c, intermediate_size=32, num_key_value_heads=2, clip_qkv=0.5),
    # biases everywhere, LayerNorm, a plain (not gated) MLP, tied embeddings by default
    "starcoder2": lambda tf, c, aux: tf.Starcoder2Config(**c, intermediate_size=32, num_key_value_heads=2),
    # partial rotary (half of each head), interleaved rotary pairs
    "glm": lambda tf, c, aux: tf.GlmConfig(**c, intermediate_size=32, num_key_value_heads=2, head_dim=8,
                                           partial_rotary_factor=0.5),
    # the embedding scaled by sqrt(hidden) inside its module, (1 + w) norms
    "gemma": lambda tf, c, aux: tf.GemmaConfig(**c, intermediate_size=32, num_key_value_heads=2, head_dim=8),
    # every layer MoE, q and k norms; the router auxiliary loss
    "olmoe": lambda tf, c, aux: tf.OlmoeConfig(**c, intermediate_size=8, num_key_value_heads=2, num_experts=4,
                                               num_experts_per_tok=2, output_router_logits=aux, router_aux_loss_coef=0.01),
    # layer 1 without rotary (NoPE) and sliding, by config.layer_types
    "smollm3": lambda tf, c, aux: tf.SmolLM3Config(**c, intermediate_size=32, num_key_value_heads=2, no_rope_layer_interval=2,
                                                   use_sliding_window=True, sliding_window=3),
}


def model(arch: str, *, seed: int = 0, **options):
    """A float64 model of ``config(arch, **options)`` with weights from ``seed`` (the same on every rank).

    The router biases of DeepSeek-V3 (zeros at init) are drawn too, so that group-limited routing
    depends on them."""
    import transformers as tf

    torch.manual_seed(seed)
    m = tf.AutoModelForCausalLM.from_config(config(arch, **options), dtype=torch.float64)
    with torch.no_grad():
        for name, buf in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    return m.train()


def batch(rows: int, seq: int, *, seed: int = 1, padded: bool = True):
    """``(input_ids, attention_mask, labels)``: rows of ``seq`` tokens, some left- and some
    right-padded (labels -100 there, and on a few more tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, seq), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        for r in range(rows):
            pad = r % 3
            if pad and r % 2:
                mask[r, :pad] = 0  # left padding
            elif pad:
                mask[r, seq - pad:] = 0  # right padding
        ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, seq // 2] = -100
    return ids, mask, labels


def parted(layer):
    """``layer`` (a ``twinpipe.hf.DecoderLayer``) declaring parts, as a MoE layer with expert
    parallelism does: the attention half, a communication (none here), the feed-forward half."""
    from twinpipe.hf import DecoderLayer
    from twinpipe.overlap.parts import Comm, Compute, Done

    class PartedLayer(DecoderLayer):
        def parts(self):
            return [Compute("attention", lambda h, ctx: (self.attention(h, ctx), ctx)),
                    Comm("exchange", lambda h, ctx: Done(((h, ctx), None))),
                    Compute("feed_forward", lambda h, ctx: (self.feed_forward(h, ctx), ctx))]

    return PartedLayer(layer, layer.index, layer.mask_kind, layer.router)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference, relative to the largest magnitude of ``want``."""
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale else 1.0)


def full_expert_grads(block, name: str, reduce) -> torch.Tensor:
    """The [E, ...] gradient of a fused expert tensor of ``block`` (a ``twinpipe.hf.experts.EPMoE``)
    from every EP rank's slots, ``reduce`` summing over them (each expert's first slot: replicas hold
    the same sum after reduce_replica_grads)."""
    local = getattr(block.experts, name)
    full = torch.zeros((block.num_experts, *local.shape[1:]), dtype=local.dtype)
    if local.grad is None:  # a rank whose experts ran on no rows
        local.grad = torch.zeros_like(local)
    phy2log = block.phy2log.tolist()
    for i, e in enumerate(block.rows):
        if phy2log.index(e) == block.first_slot + i:
            full[e] += local.grad[i]
    reduce(full)
    return full
