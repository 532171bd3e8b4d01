"""Stage-local auxiliary losses: a term any stage adds to the step's loss, with no new message.

``with_aux_loss(x, aux)`` returns ``x`` itself in the forward; in the backward, when ``x``'s
gradient arrives, ``aux`` gets the gradient 1, as if ``aux`` had been added to the micro-batch's
loss. A stage attaches its term (a MoE router's balance loss, say) to a tensor on its path to the
output, and every schedule carries it as it carries that tensor's gradient: split backward (B/W),
F&B overlap and mirrored copies need nothing more, and the single-process model computes the same
graph (Megatron-Core's ``MoEAuxLossAutoScaler`` does the same). ``x`` must reach the loss (its
gradient must arrive), which holds for any tensor the stage's output depends on.

The value of ``aux`` is not in the losses ``Pipeline.step`` returns (only its gradient is in the
parameters' gradients).
"""

from __future__ import annotations

import torch

__all__ = ["with_aux_loss"]


class _AuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_shape, ctx.aux_dtype, ctx.aux_device = aux.shape, aux.dtype, aux.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=ctx.aux_device)


def with_aux_loss(x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """``x``, with the one-element ``aux`` added to the loss through ``x``'s backward (see above).
    Without grad mode, or when ``aux`` needs no gradient, ``x`` is returned untouched."""
    if not isinstance(aux, torch.Tensor) or aux.numel() != 1:
        raise ValueError(f"aux={aux!r}: must be a one-element tensor (a loss)")
    if not torch.is_grad_enabled() or not aux.requires_grad:
        return x
    return _AuxLoss.apply(x, aux)
