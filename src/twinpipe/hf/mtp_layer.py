"""One multi-token prediction layer of DeepSeek-V3 (``MTPLayer``) and the checkpoint names MTP layers have.

Below both the checkpoint readers (``_safetensors_names`` lists these names among a model's) and
``twinpipe.hf.mtp``, which builds the layers on a stage (see its docstring for the equations).
"""

from __future__ import annotations

import torch
from torch import nn

from twinpipe.hf.layer import Context, DecoderLayer

__all__ = ["MTPLayer", "mtp_names", "copy_name", "copy_sources", "checkpoint_names", "checkpoint_meta", "EMBED", "HEAD"]

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


class MTPLayer(DecoderLayer):
    """One MTP depth: DeepSeek-V3's decoder layer ``index`` (a ``DecoderLayer``: its own parameter
    names) with ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``. ``forward(h, e, ctx)``
    gives h^k from h^{k-1} and the embeddings e (``project``, then the decoder layer); ``out_norm`` is
    the norm before the shared head."""

    def __init__(self, layer: nn.Module, index: int, norm_cls, hidden: int, eps: float):
        super().__init__(layer, index, "full_attention", None)
        self.enorm = norm_cls(hidden, eps=eps)
        self.hnorm = norm_cls(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = norm_cls(hidden, eps=eps)

    @property
    def out_norm(self) -> nn.Module:
        return self.shared_head.norm

    def project(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input: ``eh_proj [enorm(e) ; hnorm(h)]``."""
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))

    def forward(self, h: torch.Tensor, e: torch.Tensor, ctx: Context) -> torch.Tensor:
        return super().forward(self.project(h, e), ctx)


def _meta_layers(config, depth: int) -> list[MTPLayer]:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    n = config.num_hidden_layers
    with torch.device("meta"):
        return [MTPLayer(DeepseekV3DecoderLayer(config, n + j), n + j, DeepseekV3RMSNorm, config.hidden_size,
                         config.rms_norm_eps) for j in range(depth)]


def mtp_names(config, depth: int) -> list[tuple[str, tuple]]:
    """``(name, shape)`` of the parameters the last stage adds for ``depth`` MTP layers, in stage
    order: each layer's, then the embedding copy (``model.layers.{N}.embed_tokens.weight``)."""
    out = [(f"model.layers.{layer.index}.{sub}", tuple(p.shape)) for layer in _meta_layers(config, depth)
           for sub, p in layer.named_parameters()]
    if depth:
        out.append((copy_name(config), (config.vocab_size, config.hidden_size)))
    return out


def copy_name(config) -> str:
    """The name of the last stage's embedding copy."""
    return f"model.layers.{config.num_hidden_layers}.embed_tokens.weight"


def copy_sources(config, depth: int) -> dict[str, str]:
    """Checkpoint name -> the model tensor it equals, for the copies DeepSeek-V3's checkpoints store
    with each MTP layer (``embed_tokens``, ``shared_head.head``) and the stage's embedding copy."""
    n = config.num_hidden_layers
    out = {}
    for j in range(depth):
        out[f"model.layers.{n + j}.embed_tokens.weight"] = EMBED
        out[f"model.layers.{n + j}.shared_head.head.weight"] = HEAD
    return out


def checkpoint_names(config, depth: int) -> list[tuple[str, tuple]]:
    """Every tensor a DeepSeek-V3 checkpoint stores for ``depth`` MTP layers (parameters and persistent
    buffers: the routing bias), with its shape."""
    table = (config.vocab_size, config.hidden_size)
    own = [(f"model.layers.{layer.index}.{key}", tuple(t.shape)) for layer in _meta_layers(config, depth)
           for key, t in layer.state_dict().items()]
    return own + [(name, table) for name in copy_sources(config, depth)]


def checkpoint_meta(config) -> list[tuple[str, torch.Tensor]]:
    """The MTP tensors a checkpoint of ``config`` may hold (``num_nextn_predict_layers`` of them for a
    DeepSeek-V3 config, else none), as meta tensors of the model's dtype."""
    if getattr(config, "model_type", None) != "deepseek_v3":
        return []
    depth = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    return [(name, torch.empty(shape, device="meta")) for name, shape in checkpoint_names(config, depth)]
