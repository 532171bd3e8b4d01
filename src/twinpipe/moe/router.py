"""Top-k routing: softmax or sigmoid scores, optionally limited to the best expert groups."""

from __future__ import annotations

import torch
from torch import nn

from twinpipe.checks import bad, check_choice, check_float, check_int
from twinpipe.runtime.aux_loss import with_aux_loss
from twinpipe.runtime.weight_grad import DeferredLinear

__all__ = ["TopKRouter", "sequence_balance_loss"]

SCORES = ("softmax", "sigmoid")


class TopKRouter(nn.Module):
    """Picks ``top_k`` experts per token and their weights.

    ``score``: ``"softmax"`` (weights are the chosen probabilities) or ``"sigmoid"`` (DeepSeek-V3:
    the chosen scores normalised to sum 1). With ``groups > 1`` the experts form equal groups and
    each token picks only among the ``top_groups`` groups with the highest sum of their two best
    scores (DeepSeek-V3's node-limited routing). ``bias`` (a buffer, zeros) shifts the scores for
    the choice only, not for the weights (DeepSeek-V3's auxiliary-loss-free balancing).
    ``route_scale`` multiplies the weights (DeepSeek-V3's routed scaling factor).

    ``loads`` (a buffer, not saved) counts the token copies chosen for each expert by every forward
    in training (``self.training`` and grad mode on) until reset: ``twinpipe.moe.bias`` moves
    ``bias`` against them. ``balance_alpha`` > 0 adds DeepSeek-V3's sequence-wise balance loss to
    the micro-batch's loss (``sequence_balance_loss``; attached to the weights' backward by
    ``twinpipe.runtime.aux_loss``); ``forward`` then needs ``seq_len``.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, score: str = "softmax",
                 groups: int = 1, top_groups: int | None = None, normalize: bool | None = None,
                 route_scale: float = 1.0, balance_alpha: float = 0.0):
        super().__init__()
        check_int(num_experts, "num_experts", low=1)
        check_int(top_k, "top_k", low=1, high=num_experts, why="at most num_experts")
        check_choice(score, "score", SCORES)
        check_int(groups, "groups", low=1, why=f"dividing num_experts ({num_experts})")
        if num_experts % groups:
            raise bad("groups", groups, f"must divide num_experts ({num_experts})")
        top_groups = groups if top_groups is None else top_groups
        check_int(top_groups, "top_groups", low=1, high=groups, why="at most groups")
        if top_k > top_groups * (num_experts // groups):
            raise bad("top_k", top_k, f"must be <= {top_groups * (num_experts // groups)}, the experts "
                      f"in top_groups={top_groups} groups of {num_experts // groups}")
        self.num_experts, self.top_k, self.score = num_experts, top_k, score
        self.groups, self.top_groups = groups, top_groups
        check_float(route_scale, "route_scale", low=0, low_open=True)
        self.normalize = (score == "sigmoid") if normalize is None else normalize
        self.route_scale = float(route_scale)
        self.balance_alpha = check_float(balance_alpha, "balance_alpha", low=0.0)
        self.gate = DeferredLinear(hidden, num_experts, bias=False)
        self.register_buffer("bias", torch.zeros(num_experts))
        self.register_buffer("loads", torch.zeros(num_experts, dtype=torch.long), persistent=False)

    def forward(self, tokens: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [T, hidden]`` -> ``(experts [T, k] int64, weights [T, k])``; ``seq_len``: the
        tokens are T / seq_len sequences one after the other (needed by ``balance_alpha``)."""
        logits = self.gate(tokens)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.bias
        if self.groups > 1:
            per = self.num_experts // self.groups
            by_group = choice.view(len(tokens), self.groups, per)
            group_score = by_group.topk(min(2, per), dim=-1).values.sum(-1)
            keep = group_score.topk(self.top_groups, dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        if self.training and torch.is_grad_enabled():
            self.loads += torch.bincount(experts.reshape(-1), minlength=self.num_experts)
            if self.balance_alpha > 0:
                if seq_len is None:
                    raise ValueError("seq_len=None: balance_alpha > 0 needs the sequence length (the loss is per sequence)")
                aux = self.balance_alpha * sequence_balance_loss(scores, experts, seq_len)
                weights = with_aux_loss(weights, aux)
        return experts, weights


def sequence_balance_loss(scores: torch.Tensor, experts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss without its factor alpha: per sequence of T tokens,
    ``sum_i f_i * P_i`` with ``f_i = E / (k * T) * (tokens of the sequence choosing expert i)`` and
    ``P_i = mean over its tokens of s_i / sum_j s_j``; the mean over the sequences.

    ``scores [B*T, E]`` (affinities, with their gradient), ``experts [B*T, k]`` (the choice)."""
    n, num_experts = scores.shape
    k = experts.shape[1]
    check_int(seq_len, "seq_len", low=1, why=f"dividing the {n} tokens")
    if n % seq_len:
        raise bad("seq_len", seq_len, f"must divide the {n} tokens")
    per_seq = n // seq_len
    chosen = torch.zeros(n, num_experts, dtype=scores.dtype, device=scores.device).scatter_(1, experts, 1.0)
    f = chosen.view(per_seq, seq_len, num_experts).sum(1) * (num_experts / (k * seq_len))
    p = (scores / scores.sum(-1, keepdim=True)).view(per_seq, seq_len, num_experts).mean(1)
    return (f * p).sum(-1).mean()
