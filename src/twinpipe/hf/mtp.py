"""Multi-token prediction (DeepSeek-V3) on the last stage of a Hugging Face DeepSeek-V3 pipeline.

``build(model, ..., mtp_depth=D)`` gives the stage holding the final norm and head (``L``) D MTP
layers (``MTPLayer``): depth k (1..D) is DeepSeek-V3's decoder layer number ``num_hidden_layers + k - 1``
with, around it, the checkpoint's ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``:

    h^k_i = Layer_k( eh_proj [ enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i) ] )
    logits^k_i = lm_head( shared_head.norm(h^k_i) )      (predicts t_{i+k+1})

h^0 is the main model's last hidden state before ``model.norm`` (twinpipe.train.mtp's definition);
the embedding comes first in the concatenation, as ``transformers``' own ``MtpLayer`` reads
DeepSeek-V3's checkpoints (tests/test_hf_mtp.py compares the two). Emb and lm_head are the model's: the stage
holds lm_head, and the embedding itself where one rank holds both ends (a V schedule), else a copy
(``mtp_embed``) whose gradient is summed with the embedding's by the tied-pair rule
(``HFRankStages.sync_tied_grads``; under ``twinpipe.train.Trainer``, its ``tied_copies``).

The MTP layers read the tokens, which only the criterion gets (its labels): the criterion adds
them to the last stage as parts after the stage's own (``mtp_parts``, declared by ``HFMTPLoss.stage_parts``
and run by ``twinpipe.overlap.tail``), from its outputs ``(logits, h^0)`` to ``(logits, h^0, h^1,
..., h^D)``, then computes the losses. With expert parallelism (the model sharded by
``twinpipe.hf.experts.shard_experts_`` before ``build``) the MTP layers' MoE blocks are sharded over
the same EP group (``mtp_layers(..., ep_group=)``) and declare the main layers' parts: in the F&B
ops of a stage in parts (``HFPartedStage``) their dispatch and combine run interleaved with the
other micro-batch's compute as the main layers' do, and their weight gradients wait for W alike.

Parameter names are DeepSeek-V3's checkpoint names, ``model.layers.{N+k-1}.enorm.weight``,
``...eh_proj.weight``, ``...self_attn.kv_a_proj_with_mqa.weight``...; the embedding copy is named
``model.layers.{N}.embed_tokens.weight``. Checkpoints also store, per depth, ``embed_tokens`` and
``shared_head.head`` (equal to the model's embedding and head): ``checkpoint_names`` lists them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from twinpipe.checks import bad, check_int
from twinpipe.hf.experts import EPMoE
from twinpipe.hf.layer import Context, DecoderLayer
from twinpipe.hf.moe_parts import moe_parts
from twinpipe.overlap.parts import Compute
from twinpipe.overlap.tail import with_tail
from twinpipe.hf.mtp_layer import (EMBED, HEAD, MTPLayer, checkpoint_names, copy_name,
                                   copy_sources, mtp_names)

__all__ = ["MTPLayer", "mtp_layers", "mtp_depth_of", "mtp_parts", "HFMTPLoss", "checkpoint_names", "copy_sources",
           "mtp_names", "load_places", "save_tensors", "EMBED", "HEAD"]

def mtp_depth_of(model, mtp_depth) -> int:
    """``mtp_depth`` checked against ``model``: an int >= 0, or ``"config"`` for the config's
    ``num_nextn_predict_layers``; above 0 only for a DeepSeek-V3 model with untied embeddings."""
    config = model.config
    if mtp_depth == "config":
        mtp_depth = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    check_int(mtp_depth, "mtp_depth", low=0, why="MTP modules on the last stage; or 'config'")
    if mtp_depth:
        kind = getattr(config, "model_type", None)
        if kind != "deepseek_v3":
            raise bad("mtp_depth", mtp_depth, f"must be 0 for model_type={kind!r}: multi-token prediction is built "
                                              "for DeepSeek-V3 (model_type 'deepseek_v3') only")
        if getattr(config, "tie_word_embeddings", False):
            raise bad("mtp_depth", mtp_depth, "must be 0 with tied input/output embeddings (tie_word_embeddings)")
    return mtp_depth


def mtp_layers(model, depth: int, *, seed: int = 0, ep_group=None) -> nn.ModuleList:
    """The ``depth`` MTP layers of a DeepSeek-V3 ``model``, initialised by the model's own
    ``_init_weights`` from ``seed`` (the caller's random state is left as it was: every rank that
    builds them gets the same weights), in the model's dtype and on its device. ``ep_group``: their
    MoE blocks' experts spread over it after the initialisation (``twinpipe.hf.experts.shard_experts_``,
    slot s running expert s): each rank keeps its rows of the same initial experts."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    config = model.config
    n = config.num_hidden_layers
    first = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = nn.ModuleList(MTPLayer(DeepseekV3DecoderLayer(config, n + j), n + j, DeepseekV3RMSNorm,
                                        config.hidden_size, config.rms_norm_eps) for j in range(depth))
        with torch.no_grad():
            layers.apply(model._init_weights)
    layers = layers.to(device=first.device, dtype=first.dtype)
    if ep_group is not None:
        from twinpipe.hf.experts import shard_experts_

        for layer in layers:
            shard_experts_(layer, ep_group)
    return layers


def load_places(model_dir, names, depth: int) -> dict:
    """``{name: Place}`` for ``twinpipe.hf.weights.load`` of a stage's parameter ``names``: the
    embedding copy read from ``model.embed_tokens.weight``; the MTP layers' tensors only when the
    checkpoint holds that layer (else they keep their initial values: a checkpoint without MTP)."""
    from twinpipe.hf._safetensors_files import CheckpointFiles
    from twinpipe.hf._safetensors_place import Place

    if not depth:
        return {name: Place(name) for name in names}
    config = _folder_config(model_dir)
    n = config.num_hidden_layers
    layer_of = {name: int(name.split(".")[2]) for name in names if name.startswith("model.layers.")}
    mtp = {i for i in layer_of.values() if i >= n}
    keys = set(CheckpointFiles(model_dir).where) if mtp else set()
    present = {i for i in mtp if any(k.startswith(f"model.layers.{i}.") for k in keys)}
    out = {}
    for name in names:
        if name == copy_name(config):
            out[name] = Place(EMBED)
        elif layer_of.get(name, -1) < n or layer_of[name] in present:
            out[name] = Place(name)
    return out


def _folder_config(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def save_tensors(modules) -> dict:
    """``{name: tensor}`` of stage ``modules`` for ``twinpipe.hf.weights.save``: their parameters and
    persistent buffers (DeepSeek-V3's routing biases) by their names in the unsplit model, and for a
    last stage with MTP layers the copies DeepSeek-V3's checkpoints store with each layer
    (``embed_tokens`` from the embedding copy, ``shared_head.head`` from ``lm_head``). The fused
    experts of MoE blocks sharded over an EP group (``twinpipe.hf.experts``: main and MTP layers
    alike) as ``(Place(name, rows), tensor)``: this rank's rows."""
    from twinpipe.hf.experts import expert_rows
    from twinpipe.hf._safetensors_place import Place

    out = {}
    for module in modules:
        rows = expert_rows(module)
        for name, t in [*module.named_model_parameters(), *module.named_model_buffers()]:
            out.setdefault(name, (Place(name, rows[id(t)]), t.detach()) if id(t) in rows else t.detach())
        mtp = getattr(module, "mtp", None)
        if mtp is not None:
            for name, source in copy_sources(module.config, len(mtp)).items():
                out.setdefault(name, (module.mtp_embed if source == EMBED else module.lm_head.weight).detach())
    return out


class HFMTPLoss:
    """``build``'s criterion with MTP: ``CausalLMLoss`` of the logits plus ``weight / D`` times the
    sum of the D depths' losses, each the model's own causal LM loss of its logits against the token
    k+1 places ahead (-100 ignored), divided by the number of tokens it counts in the whole batch.

    Called as ``criterion(logits, hidden, labels, counts, input_ids, attention_mask)``
    (``HFRankStages.batch`` makes the last four; ``counts[:, k]``: depth k's count, 0 the main loss's);
    ``stage_parts`` (the same labels) gives the MTP layers' parts, which run in the last stage's record."""

    def __init__(self, main, head: nn.Module | None, weight: float, depth: int):
        self.main, self.head, self.weight, self.depth = main, head, weight, depth

    def stage_parts(self, labels, counts, input_ids, attention_mask) -> list:
        if self.head is None:
            raise RuntimeError("HFMTPLoss: called on a rank whose stages hold no MTP layers (not the last stage's)")
        return self.head.mtp_parts(input_ids[:, 1:], attention_mask)

    def __call__(self, logits, hidden, labels, counts, input_ids, attention_mask):
        head = self.head
        parts = self.stage_parts(labels, counts, input_ids, attention_mask)
        logits, _, *depths = with_tail((logits, hidden), parts)  # the logits again: one graph, the tail's
        loss = self.main(logits, labels, counts[:, 0])
        extra = None
        for k, h in enumerate(depths, start=1):
            term = self.main.loss_function(logits=head.logits(head.mtp[k - 1].out_norm(h)), labels=None,
                                           vocab_size=self.main.vocab_size, num_items_in_batch=counts[0, k],
                                           shift_labels=labels[:, k + 1:])
            extra = term if extra is None else extra + term
        return loss + (self.weight / self.depth) * extra


def mtp_parts(stage, next_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list:
    """The MTP layers of last ``stage`` as parts after its own (``twinpipe.overlap.tail``): from its
    outputs ``(logits, h^0)`` to ``(logits, h^0, h^1, ..., h^D)``. ``next_ids [B, t]``: token i+1 at
    position i; depth k runs on the first t-k positions with tokens ``next_ids[:, k-1:t-1]``. Each
    depth: ``mtp{k}.in`` (its embeddings and ``project``), then its decoder layer's parts (a MoE
    layer's, ``moe_parts``, when its ``mlp`` is an ``EPMoE``; else one part), then ``mtp.out``."""
    t = next_ids.shape[1]
    if len(stage.mtp) >= t:
        raise ValueError(f"mtp depth {len(stage.mtp)}: must be below the sequence length ({t})")
    parts = []
    for k, layer in enumerate(stage.mtp, start=1):
        parts.append(Compute(f"mtp{k}.in", functools.partial(_depth_input, stage, k, next_ids, attention_mask)))
        parts += [dataclasses.replace(p, name=f"mtp{k}.{p.name}") for p in _layer_parts(layer)]
    parts.append(Compute("mtp.out", _tail_outputs))
    return parts


def _layer_parts(layer: DecoderLayer) -> list:
    if isinstance(layer.mlp, EPMoE):
        return moe_parts(layer)
    return [Compute("layer", lambda hidden, ctx: (DecoderLayer.forward(layer, hidden, ctx), ctx))]


def _depth_input(stage, k: int, next_ids, attention_mask, *state) -> tuple:
    """Depth k's input ``(project(h^{k-1}, e), ctx)``. What the tail returns at its end travels in
    ``ctx.carry`` (the stage's outputs, then h^1..h^{k-1}): each a tensor this part or an earlier
    one received, whose gradient that part hands on (``twinpipe.hf.layer``'s rule for the router logits)."""
    if k == 1:
        logits, h = state
        carry = (logits, h)
    else:
        h, ctx = state
        carry = (*ctx.carry, h)
    length = next_ids.shape[1] - k
    ctx = depth_context(stage.config, stage.rotary_emb, h, length, attention_mask)
    ctx.carry = carry
    e = stage.mtp_embedding(next_ids[:, k - 1 : k - 1 + length])
    return stage.mtp[k - 1].project(h[:, :length], e), ctx


def _tail_outputs(h, ctx) -> tuple:
    return (*ctx.carry, h)


def depth_counts(labels: torch.Tensor, depth: int, ignore_index: int = -100) -> list[int]:
    """Tokens each loss counts over the whole batch: the main loss's (labels after the shift), then
    depth k's (labels from k+1 on); at least 1 (a depth with none adds 0)."""
    return [max(1, int((labels[..., k + 1:] != ignore_index).sum())) for k in range(depth + 1)]


def depth_context(config, rotary_emb, hidden: torch.Tensor, length: int, attention_mask: torch.Tensor | None) -> Context:
    """The ``Context`` of an MTP layer on the first ``length`` positions: position ids 0..length-1,
    the rotary tables and the causal mask (with the padding mask of those positions) made as the
    stages make them."""
    from transformers.masking_utils import create_causal_mask

    x = hidden[:, :length]
    mask = (torch.ones(x.shape[:2], dtype=torch.long, device=x.device) if attention_mask is None
            else attention_mask[:, :length])
    position_ids = torch.arange(length, device=x.device).unsqueeze(0)
    cos_sin = rotary_emb(x, position_ids)
    causal = create_causal_mask(config=config, inputs_embeds=x, attention_mask=mask, cache=None, position_ids=position_ids)
    return Context(attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin,
                   masks={"full_attention": causal})


def embedding(ids: torch.Tensor, weight: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
    """``embed(ids)`` computed with ``weight`` (the embedding or its copy): same padding row."""
    return F.embedding(ids, weight, embed.padding_idx, embed.max_norm, embed.norm_type, embed.scale_grad_by_freq,
                       embed.sparse)
