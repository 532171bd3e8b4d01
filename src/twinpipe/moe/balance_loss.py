"""DeepSeek-V3's sequence-wise balance loss on Hugging Face DeepSeek-V3 gates.

``install_balance_loss(model, alpha)`` puts a forward hook on every ``DeepseekV3TopkRouter`` (any
module with an ``e_score_correction_bias`` buffer returning ``(logits, weights, indices)`` from
hidden states ``[batch, seq, hidden]``): in training it adds ``alpha * sequence_balance_loss`` of
the gate's sigmoid scores and choice to the micro-batch's loss, through the weights' backward
(``twinpipe.runtime.aux_loss``), exactly as ``TopKRouter(balance_alpha=alpha)`` does. Works on the
unsplit model and on any stage built from its layers; the returned handles remove the hooks.
"""

from __future__ import annotations

import torch
from torch import nn

from twinpipe.checks import check_float
from twinpipe.moe.bias import HF_BIAS, hf_gates
from twinpipe.moe.router import sequence_balance_loss
from twinpipe.runtime.aux_loss import with_aux_loss

__all__ = ["install_balance_loss"]


def install_balance_loss(model: nn.Module, alpha: float) -> list:
    """Hook every Hugging Face DeepSeek-V3 gate of ``model``; returns the hooks' handles."""
    alpha = check_float(alpha, "alpha", low=0.0, low_open=True)
    gates = [m for _, m in hf_gates(model)]
    if not gates:
        raise ValueError(f"model ({type(model).__name__}) has no DeepSeek-V3 gate (a module with an {HF_BIAS} buffer)")

    def hook(gate, inputs, output):
        if not (gate.training and torch.is_grad_enabled()):
            return None
        hidden = inputs[0]
        if hidden.dim() != 3:
            raise ValueError(f"the gate got hidden states of shape {tuple(hidden.shape)}: the balance loss is per sequence "
                             "and needs [batch, seq, hidden]")
        logits, weights, indices = output
        aux = alpha * sequence_balance_loss(logits.sigmoid(), indices, hidden.shape[1])
        return logits, with_aux_loss(weights, aux.to(weights.dtype)), indices

    return [gate.register_forward_hook(hook) for gate in gates]
