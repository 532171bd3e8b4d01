"""Mixed precision (``TrainConfig(precision="bf16-mixed")``): bf16 weights for compute, FP32 masters
the optimizer updates, gradients accumulated in FP32.

The rule, shared by ``Trainer`` and the single-process ``ReferenceTrainer`` (so both run the same
arithmetic):

- the model is built in FP32; each parameter the optimizer updates gets an FP32 master (a copy),
  then every parameter is cast to bf16 in place (``nn.Module.to``: the same objects);
- each bf16 parameter gets ``main_grad``, an FP32 buffer zeroed before every step. Autograd's bf16
  gradient of one backward is added into it and ``.grad`` cleared (a post-accumulate hook);
  deferred weight gradients (W) add into it directly, by an FP32 matrix product
  (``twinpipe.runtime.main_grad``). Micro-batches, mirrored copies and replicas are summed there;
- scaling, the norm, clipping and the optimizer work on the FP32 gradients (a master's ``.grad``
  is its parameter's ``main_grad``: the same tensor); the optimizer state is FP32 like its masters;
- after each update the bf16 weights are refreshed from the masters (round to nearest).

``precision="pure"`` (the default) is everything in the model's dtype (``Trainer(dtype=...)``,
``twinpipe train --dtype``): float64 for the exactness tests, or bf16 weights, gradients and
optimizer state (where an update below half a bf16 step of the weight is lost).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from twinpipe.precisions import MASTER_DTYPE_NAME, PRECISIONS, check_model_dtype

__all__ = ["PRECISIONS", "COMPUTE_DTYPE", "MASTER_DTYPE", "check_dtype", "make_masters", "to_compute", "zero_main_grads",
           "refresh"]

COMPUTE_DTYPE = torch.bfloat16
MASTER_DTYPE = getattr(torch, MASTER_DTYPE_NAME)


def check_dtype(precision: str, dtype: torch.dtype | None) -> None:
    """``dtype`` (the model's, ``Trainer(dtype=...)``) allowed with ``precision``."""
    check_model_dtype(precision, dtype)


def make_masters(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """An FP32 leaf copy of each parameter (the optimizer's tensors)."""
    return [nn.Parameter(p.detach().to(MASTER_DTYPE, copy=True)) for p in params]


def _move_grad(p: torch.Tensor) -> None:
    """Post-accumulate hook: autograd's bf16 gradient into the FP32 buffer (none: a deferred layer's
    weight, whose autograd gradient is None; W adds into ``main_grad`` itself)."""
    if p.grad is not None:
        p.main_grad.add_(p.grad)
        p.grad = None


def to_compute(modules: Sequence[nn.Module]) -> list:
    """Cast ``modules`` to bf16 in place and give every parameter its FP32 ``main_grad`` and hook
    (returns the hook handles)."""
    handles = []
    for module in modules:
        module.to(COMPUTE_DTYPE)
        for p in module.parameters():
            if getattr(p, "main_grad", None) is None:
                p.main_grad = torch.zeros(p.shape, dtype=MASTER_DTYPE, device=p.device)
                handles.append(p.register_post_accumulate_grad_hook(_move_grad))
    return handles


def zero_main_grads(params: Sequence[torch.Tensor]) -> None:
    """Start a step: every gradient zero (``main_grad``) or absent (``.grad``)."""
    for p in params:
        p.grad = None
        main = getattr(p, "main_grad", None)
        if main is not None:
            main.zero_()


def refresh(params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor]) -> None:
    """Each bf16 weight from its master (round to nearest)."""
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m)
