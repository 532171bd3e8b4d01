"""Deferred weight gradients (the "W" of zero bubble).

A layer that supports deferral computes its input gradient during backward at once, and hands
the weight-gradient computation to ``WeightGradStore`` as a closure. The executor turns the store
on for a B op, files the closures under that op's (stage, micro-batch), and runs them at the
matching W op. Layers that do not defer simply compute their weight gradients during B.

``WeightGradStore`` keeps the official DualPipe's class-level API (``enabled``, ``put``, ``flush``,
``pop``, ``clear``) so layers written for it work unchanged; ``flush``/``pop`` also take a key.
"""

from __future__ import annotations

import queue
from typing import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WeightGradStore", "DeferredLinear", "defer_weight_grads"]


class WeightGradStore:
    """Process-wide store of deferred weight-gradient closures."""

    enabled: bool = False
    cache: list[Callable[[], None]] = []
    funcs_queue: queue.Queue = queue.Queue()
    _by_key: dict[Hashable, list[Callable[[], None]]] = {}

    @classmethod
    def put(cls, func: Callable[[], None]) -> None:
        cls.cache.append(func)

    @classmethod
    def flush(cls, key: Hashable | None = None) -> None:
        """File the closures gathered since the last flush: under ``key``, or FIFO if None."""
        if key is None:
            cls.funcs_queue.put(cls.cache)
        else:
            cls._by_key[key] = cls.cache
        cls.cache = []

    @classmethod
    def pop(cls, key: Hashable | None = None) -> None:
        """Run the closures filed under ``key`` (or the oldest FIFO entry if None)."""
        if key is None:
            try:
                funcs = cls.funcs_queue.get_nowait()
            except queue.Empty:
                raise RuntimeError("WeightGradStore.pop(): nothing was flushed") from None
        else:
            funcs = cls._by_key.pop(key, [])
        for func in funcs:
            func()

    @classmethod
    def clear(cls) -> None:
        cls.enabled = False
        cls.cache = []
        cls.funcs_queue = queue.Queue()
        cls._by_key = {}

    @classmethod
    def pending(cls) -> int:
        """How many keyed entries still wait for their W."""
        return len(cls._by_key) + cls.funcs_queue.qsize()


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _accumulate_product(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``param.grad += a @ b``, accumulated inside the matrix product (no temporary, one pass)."""
    if param.grad is None:
        param.grad = a.mm(b)
    else:
        param.grad.addmm_(a, b)


class _DeferredLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        # Parameters are kept as objects: W accumulates into their .grad later.
        ctx.weight, ctx.bias = weight, bias
        # The same kernel as nn.Linear (2-D addmm/mm), so outputs are bitwise equal to it. Like
        # aten::linear, reshape back with _unsafe_view so the output is not a view (views cannot
        # be freed after sending).
        if x.dim() <= 2:
            return F.linear(x, weight, bias)
        out = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        grad_in = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        weight_needs, bias_needs = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]

        def weight_grad() -> None:
            g = grad_out.reshape(-1, grad_out.shape[-1])
            with torch.no_grad():
                if weight_needs:
                    _accumulate_product(weight, g.t(), x.reshape(-1, x.shape[-1]))
                if bias_needs:
                    _accumulate(bias, g.sum(0))

        if weight_needs or bias_needs:
            if WeightGradStore.enabled:
                WeightGradStore.put(weight_grad)
            else:
                weight_grad()
        return grad_in, None, None


class DeferredLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient is deferred to W when the store is enabled."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not (self.weight.requires_grad or x.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return _DeferredLinearFunction.apply(x, self.weight, self.bias)


def defer_weight_grads(module: nn.Module) -> nn.Module:
    """Swap every ``nn.Linear`` inside ``module`` for a ``DeferredLinear`` with the same parameters.

    Returns ``module`` (changed in place; a bare ``nn.Linear`` is returned as a new object).
    Results are unchanged; only when weight gradients are computed moves.
    """
    if type(module) is nn.Linear:
        return _deferred_copy(module)
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, _deferred_copy(child))
        else:
            defer_weight_grads(child)
    return module


def _deferred_copy(linear: nn.Linear) -> DeferredLinear:
    new = DeferredLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    new.weight = linear.weight
    new.bias = linear.bias
    new.train(linear.training)
    return new
