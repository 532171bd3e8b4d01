"""A small GPT-style byte-level language model, laid out as a sequence of layers.

``GPT`` is written for ``split``: its children run in registration order (``embed``, then every
block of ``blocks``, then ``head``), each taking and returning one tensor, so any contiguous run
of them is a pipeline stage. Linear layers defer their weight gradients to W (zero bubble).

With ``experts > 0`` every block is a ``twinpipe.moe.MoEBlock`` (pre-norm attention, then a routed
mixture of ``experts`` experts, ``top_k`` per token, each as wide as the dense MLP), built with all
experts local; ``Trainer`` keeps each data-parallel rank's share (expert parallelism over the
stage's data-parallel group).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from twinpipe.checks import bad, check_choice, check_float, check_int
from twinpipe.moe.block import MoEBlock
from twinpipe.moe.router import SCORES
from twinpipe.runtime.weight_grad import DeferredLinear
from twinpipe.train.mtp import MTPModule

__all__ = ["GPTConfig", "GPT", "block", "lm_loss"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Sizes of the model: ``vocab`` 256 for bytes; ``experts`` 0 for a dense MLP in every block,
    else that many routed experts per block, ``top_k`` of them per token.

    The one description of twinpipe's transformer: ``GPT`` builds from it, ``twinpipe demo`` builds its
    stages' blocks from it (``block``), ``twinpipe.plan.Model.from_config`` reads it, and the
    command-line options that set it are named after its fields (``--dim``, ``--seq-len``...)."""

    vocab: int = 256
    seq_len: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 4
    experts: int = 0
    top_k: int = 2
    score: str = "softmax"  # the routers' affinities: "softmax" or "sigmoid" (DeepSeek-V3)
    balance_alpha: float = 0.0  # DeepSeek-V3's sequence-wise balance loss factor (0: none)
    mtp_depth: int = 0  # multi-token prediction modules on the head (0: none; twinpipe.train.mtp)

    def record(self) -> dict:
        """The fields as checkpoints record them: DeepSeek-V3's (``score``, ``balance_alpha``,
        ``mtp_depth``) only when set, so checkpoints written before they existed still match."""
        fields = asdict(self)
        for name, off in _LATER_FIELDS.items():
            if fields[name] == off:
                del fields[name]
        return fields

    def __post_init__(self):
        for name in ("vocab", "seq_len", "dim", "heads", "layers", "top_k"):
            check_int(getattr(self, name), name, low=1)
        if self.dim % self.heads:
            raise bad("dim", self.dim, f"must be a multiple of heads={self.heads}")
        check_int(self.experts, "experts", low=0, why="0: dense MLPs")
        if self.experts and self.top_k > self.experts:
            raise bad("top_k", self.top_k, f"must be at most experts={self.experts}")
        check_choice(self.score, "score", SCORES)
        check_float(self.balance_alpha, "balance_alpha", low=0.0)
        check_int(self.mtp_depth, "mtp_depth", low=0, high=self.seq_len - 1)
        if self.balance_alpha and not self.experts:
            raise bad("balance_alpha", self.balance_alpha, "must be 0 for a dense model (experts=0): no router to balance")


_LATER_FIELDS = MappingProxyType({"score": "softmax", "balance_alpha": 0.0, "mtp_depth": 0})  # added after checkpoints were written


class Embed(nn.Module):
    """Token ids (batch, seq) -> hidden states (batch, seq, dim): token plus position embeddings."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.positions = nn.Embedding(cfg.seq_len, cfg.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions.weight[: ids.shape[1]]


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = DeferredLinear(cfg.dim, 3 * cfg.dim)
        self.proj = DeferredLinear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4x MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = DeferredLinear(cfg.dim, 4 * cfg.dim)
        self.down = DeferredLinear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Head(nn.Module):
    """Hidden states -> next-byte logits (batch, seq, vocab)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim)
        self.out = DeferredLinear(cfg.dim, cfg.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class MTPHead(Head):
    """The head with ``cfg.mtp_depth`` multi-token-prediction modules (``twinpipe.train.mtp``): returns
    ``(logits, hidden)``, the hidden states it got, for ``MTPLoss``. Each module's block is the
    model's dense ``Block`` (DeepSeek-V3's is a MoE block); ``mtp_embed`` is the last stage's copy
    of the token embedding (``GPT.tied_copies``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        self.mtp = nn.ModuleList(MTPModule(cfg.dim, Block(cfg)) for _ in range(cfg.mtp_depth))
        self.mtp_embed = nn.Parameter(torch.empty(cfg.vocab, cfg.dim))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logits(x), x


class GPT(nn.Module):
    """The model ``cfg`` describes. With ``cfg.mtp_depth`` its head is an ``MTPHead``: ``forward``
    returns ``(logits, hidden)`` and the loss is ``MTPLoss``'s; ``tied_copies`` names the parameters
    kept equal to another (the head's copy of the token embedding)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.embed = Embed(cfg)
        self.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.layers))
        self.head = MTPHead(cfg) if cfg.mtp_depth else Head(cfg)
        self.apply(_init)
        self.tied_copies: tuple[tuple[str, str], ...] = ()
        if cfg.mtp_depth:
            with torch.no_grad():
                self.head.mtp_embed.copy_(self.embed.tokens.weight)
            self.tied_copies = (("embed.tokens.weight", "head.mtp_embed"),)

    def forward(self, ids: torch.Tensor):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def block(cfg: GPTConfig, *, expert_ffn: int = 0, ep_group=None) -> nn.Module:
    """One transformer block of the model ``cfg`` describes: ``Block`` (dense), or with ``cfg.experts`` a
    ``MoEBlock`` whose experts are ``expert_ffn`` wide (0: 4 x dim, as the dense MLP) and sharded over
    ``ep_group`` (None: all local)."""
    if not cfg.experts:
        return Block(cfg)
    return MoEBlock(cfg.dim, cfg.heads, cfg.experts, cfg.top_k, expert_ffn or 4 * cfg.dim, ep_group=ep_group,
                    score=cfg.score, balance_alpha=cfg.balance_alpha)


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy (nats) of one micro-batch; from bf16 (or fp16) logits computed
    in FP32, as mixed-precision training does (a bf16 loss has 3 significant digits)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
