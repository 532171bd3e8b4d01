"""Where a parameter's gradient accumulates: one rule for the weight-gradient store, the mirrored
copies' sum and the trainer.

A parameter with a ``main_grad`` attribute (mixed precision: a bf16 parameter and its FP32 buffer,
as Megatron-LM names it) accumulates there, in the buffer's dtype; any other in ``.grad``. The
trainer gives its parameters the buffer and a hook that moves what autograd leaves in ``.grad``
into it (``twinpipe.train.precision``); deferred weight gradients (W) add into it directly.
"""

from __future__ import annotations

import torch

__all__ = ["grad_of", "zeros_if_missing", "accumulate", "accumulate_product"]


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient of ``p``: its ``main_grad`` when it has one, else ``.grad`` (None: none yet)."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def zeros_if_missing(p: torch.Tensor) -> torch.Tensor:
    """``grad_of(p)``, made a zero tensor first when there is none."""
    g = grad_of(p)
    if g is None:
        p.grad = g = torch.zeros_like(p)
    return g


def accumulate(p: torch.Tensor, grad: torch.Tensor) -> None:
    """``grad_of(p) += grad`` (into ``main_grad`` in its own dtype, where it exists)."""
    main = getattr(p, "main_grad", None)
    if main is not None:
        main.add_(grad.to(main.dtype))
    elif p.grad is None:
        p.grad = grad
    else:
        p.grad.add_(grad)


def accumulate_product(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``grad_of(p) += a @ b``, accumulated inside the matrix product. Into a ``main_grad`` the
    factors are widened to its dtype first: products of bf16 numbers are exact in FP32, so this is
    the FP32-accumulating weight-gradient GEMM (Megatron's ``gradient_accumulation_fusion``)."""
    main = getattr(p, "main_grad", None)
    if main is not None:
        main.addmm_(a.to(main.dtype), b.to(main.dtype))
    elif p.grad is None:
        p.grad = a.mm(b)
    else:
        p.grad.addmm_(a, b)
