"""Multi-token prediction (DeepSeek-V3): D sequential modules on the last stage, each predicting one
token further, sharing the model's embedding and output head.

Module k (1..D) at position i takes the previous depth's hidden state h^{k-1}_i (h^0: the main
model's last hidden state, before the final norm) and the embedding of token i+k:
``h^k_i = block_k(M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))])`` (M_k: 2d -> d, no bias), and
predicts token i+k+1 through the shared output head. With T tokens per sequence, depth k has T-k
positions. The step's loss is ``L_main + weight / D * sum_k L_MTP^k`` (``weight``: lambda).

The labels a last stage gets (token i+1 at position i) are all the tokens it needs: token i+k is
label i+k-1, the target of depth k at i is label i+k. So the criterion (``MTPLoss``), which gets
the labels, runs MTP on modules the last stage holds; a ``twinpipe.hf`` last stage's MTP layers it
adds to the stage as parts after the stage's own (``stage_parts``, ``twinpipe.overlap.tail``), so
that F&B ops overlap their all-to-alls as the main layers'.

The embedding: a last stage holds a copy of the embedding table (``tied_copies`` of a model name
(main, copy) pairs); the trainer sums the two gradients before the data-parallel reduction
(``tied.TiedPairs.sum_grads``: each gradient once, on the rank holding its first copy, summed over the
pipeline, then ``main + copy`` on every holder) so both take the same update and stay equal; the
copy does not count in the gradient norm (it is the embedding's). ``MTPModule`` and ``mtp_losses``
take any block, embedding and head (e.g. a Hugging Face decoder layer): see docs/deepseek-v3.md.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from twinpipe.checks import bad, check_float, check_int
from twinpipe.overlap.tail import with_tail
from twinpipe.runtime.weight_grad import DeferredLinear

__all__ = ["MTPModule", "mtp_hidden", "mtp_losses", "MTPLoss", "mtp_heads", "hf_mtp_module"]


class MTPModule(nn.Module):
    """One MTP depth: ``block(proj(cat([norm_h(h), norm_e(e)], -1)))``. ``block`` is any module
    taking and returning the hidden states (a tuple's first element is taken); extra keyword
    arguments of ``forward`` go to it (a Hugging Face layer's ``position_embeddings``, ``attention_mask``)."""

    def __init__(self, hidden: int, block: nn.Module, eps: float | None = None):
        super().__init__()
        check_int(hidden, "hidden", low=1)
        self.norm_h, self.norm_e = nn.RMSNorm(hidden, eps=eps), nn.RMSNorm(hidden, eps=eps)
        self.proj = DeferredLinear(2 * hidden, hidden, bias=False)
        self.block = block

    def forward(self, h: torch.Tensor, e: torch.Tensor, **block_kwargs) -> torch.Tensor:
        out = self.block(self.proj(torch.cat([self.norm_h(h), self.norm_e(e)], -1)), **block_kwargs)
        return out[0] if isinstance(out, tuple) else out


def mtp_hidden(modules: Sequence[nn.Module], hidden: torch.Tensor, next_ids: torch.Tensor, embed: Callable,
               block_kwargs: Callable[[int], dict] | None = None):
    """Yield ``(k, h^k)`` for k = 1..D: ``hidden [B, T', d]`` (h^0), ``next_ids [B, t]`` (token i+1
    at position i), ``embed(ids) -> [B, t-k, d]``; depth k runs on t-k positions, its module called
    as ``module(h^{k-1}, embed(tokens i+k), **block_kwargs(t-k))``."""
    t = next_ids.shape[1]
    if len(modules) >= t:
        raise ValueError(f"mtp depth {len(modules)}: must be below the sequence length ({t})")
    h = hidden
    for k, module in enumerate(modules, start=1):
        length = t - k
        kwargs = block_kwargs(length) if block_kwargs is not None else {}
        h = module(h[:, :length], embed(next_ids[:, k - 1 : t - 1]), **kwargs)
        yield k, h


def mtp_losses(modules: Sequence[MTPModule], hidden: torch.Tensor, labels: torch.Tensor, embed: Callable, head: Callable,
               loss_fn: Callable, block_kwargs: Callable[[int], dict] | None = None) -> list[torch.Tensor]:
    """The D MTP losses of one micro-batch: ``hidden [B, T, d]`` (h^0), ``labels [B, T]`` (the next
    tokens), ``embed(ids) -> [B, T', d]``, ``head(h) -> logits``, ``loss_fn(logits, targets)``;
    ``block_kwargs(length)``: extra arguments of depth k's block for T' = T-k positions. A module with
    an ``out_norm`` (a Hugging Face MTP layer's ``shared_head.norm``) has it applied before ``head``."""
    losses = []
    for k, h in mtp_hidden(modules, hidden, labels, embed, block_kwargs):
        norm = getattr(modules[k - 1], "out_norm", None)
        losses.append(loss_fn(head(norm(h) if norm is not None else h), labels[:, k:]))
    return losses


class MTPLoss:
    """The criterion of a model with MTP: ``loss_fn(logits, labels) + weight / D * sum_k L_MTP^k``.

    ``head`` is the model's last layer as the stage holds it: its output is ``(logits, hidden)``
    and it has ``mtp`` (the D ``MTPModule``s), ``mtp_embed`` (the embedding copy, a [vocab, d]
    parameter) and ``logits(h)`` (the shared output head). A ``twinpipe.hf`` last stage has
    ``mtp_parts(next_ids)`` instead: its MTP layers as parts after its own (``stage_parts``,
    ``twinpipe.overlap.tail``), in its record, whose outputs the losses read."""

    def __init__(self, loss_fn: Callable, head: nn.Module, weight: float):
        self.loss_fn, self.head = loss_fn, head
        self.weight = check_float(weight, "mtp_weight", low=0.0)
        self.depth = len(head.mtp)

    def stage_parts(self, *rest) -> list:
        """The head's MTP layers as parts for the labels ``rest`` (the next tokens last), if it declares them."""
        declare = getattr(self.head, "mtp_parts", None)
        return declare(rest[-1]) if declare is not None else []

    def __call__(self, logits: torch.Tensor, hidden: torch.Tensor, *rest) -> torch.Tensor:
        """``rest``: what ``loss_fn`` takes after the logits, the labels last."""
        head, labels = self.head, rest[-1]
        parts = self.stage_parts(*rest)
        if parts:  # the depths' hidden states from the stage's record; the logits again (one graph)
            logits, _, *depths = with_tail((logits, hidden), parts)
            losses = [self.loss_fn(head.logits(module.out_norm(h)), labels[:, k:])
                      for k, (module, h) in enumerate(zip(head.mtp, depths), start=1)]
        else:
            embed = lambda ids: F.embedding(ids, head.mtp_embed)  # noqa: E731
            losses = mtp_losses(head.mtp, hidden, labels, embed, head.logits, self.loss_fn)
        extra = losses[0]
        for loss in losses[1:]:
            extra = extra + loss
        return self.loss_fn(logits, *rest) + (self.weight / self.depth) * extra


def mtp_heads(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The layers among ``modules`` (and their submodules) that hold MTP modules (``mtp``)."""
    return [m for module in modules for m in module.modules() if isinstance(getattr(m, "mtp", None), nn.ModuleList)]


def rank_criterion(criterion, modules: Sequence[nn.Module], *, held: int, depth: int, weight: float, where: str):
    """The criterion a rank's last stage runs: ``criterion``, or with MTP (``depth``, ``TrainConfig.mtp_depth``,
    which must be the ``held`` modules of the model) ``MTPLoss`` over the head among its ``modules``;
    ``where`` names the schedule and rank in errors."""
    if held != depth:
        raise bad("mtp_depth", depth, f"must be the number of MTP modules the model holds ({held}): "
                  "build the model with as many (GPTConfig.mtp_depth)")
    if not depth:
        return criterion
    heads = mtp_heads(modules)
    if len(heads) > 1:
        raise ValueError(f"{where} holds {len(heads)} copies of the MTP head; multi-token prediction needs at most one per rank")
    return MTPLoss(criterion, heads[0], weight) if heads else criterion


def hf_mtp_module(model, layer_idx: int | None = None) -> MTPModule:
    """An MTP depth for a Hugging Face DeepSeek-V3 ``model`` (a ``DeepseekV3ForCausalLM`` or its base
    model): ``MTPModule(hidden_size, DeepseekV3DecoderLayer(config, layer_idx), rms_norm_eps)``,
    initialised by the model's own ``_init_weights``. The block is DeepSeek-V3's decoder layer (MoE
    when ``layer_idx >= first_k_dense_replace``; default index ``num_hidden_layers``, the first
    after the model's, as in DeepSeek-V3's checkpoints). Call it as ``module(h, e,
    position_embeddings=..., attention_mask=...)`` with the layer's own arguments for the T-k
    positions of its depth (``mtp_losses``' ``block_kwargs``); the embedding and the head are the
    model's (``model.model.embed_tokens``, ``lm_head`` after ``model.model.norm``)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    config = model.config
    index = config.num_hidden_layers if layer_idx is None else layer_idx
    module = MTPModule(config.hidden_size, DeepseekV3DecoderLayer(config, index), eps=config.rms_norm_eps)
    with torch.no_grad():
        module.apply(model._init_weights)
    return module.to(next(model.parameters()).dtype)
