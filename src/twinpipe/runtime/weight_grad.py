"""Deferred weight gradients (the "W" of zero bubble).

A layer that supports deferral computes its input gradient during backward at once, and hands
the weight-gradient computation to the weight-gradient store as a closure. The executor turns the
store on for a B op, files the closures under that op's (stage, micro-batch), and runs them at the
matching W op. Layers that do not defer simply compute their weight gradients during B.

Each pipeline has its own ``GradStore``, so two pipelines in one process (two models, or two
threads) never see each other's closures. ``WeightGradStore`` keeps the official DualPipe's
class-level API (``enabled``, ``put``, ``flush``, ``pop``, ``clear``) so layers written for it work
unchanged: it acts on the store of the pipeline whose step runs in the calling thread (or whose
backward autograd is running, for backward functions autograd calls from its own device threads),
else on one process-wide store. ``flush``/``pop`` also take a key.
"""

from __future__ import annotations

import queue
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from twinpipe.runtime import observe
from twinpipe.runtime.main_grad import accumulate, accumulate_product

__all__ = ["GradStore", "WeightGradStore", "DeferredLinear", "defer_weight_grads", "current_store"]


class GradStore:
    """One pipeline's deferred weight-gradient closures."""

    def __init__(self):
        self.enabled = False
        self.cache: list[Callable[[], None]] = []
        self.funcs_queue: queue.Queue = queue.Queue()
        self._by_key: dict[Hashable, list[Callable[[], None]]] = {}

    def put(self, func: Callable[[], None]) -> None:
        self.cache.append(func)

    def flush(self, key: Hashable | None = None) -> None:
        """File the closures gathered since the last flush: under ``key``, or FIFO if None."""
        observe.note_closures(self.cache)  # what they keep until W counts in a measured step
        if key is None:
            self.funcs_queue.put(self.cache)
        else:
            self._by_key[key] = self.cache
        self.cache = []

    def pop(self, key: Hashable | None = None) -> None:
        """Run the closures filed under ``key`` (or the oldest FIFO entry if None)."""
        if key is None:
            try:
                funcs = self.funcs_queue.get_nowait()
            except queue.Empty:
                raise RuntimeError("WeightGradStore.pop(): nothing was flushed") from None
        else:
            funcs = self._by_key.pop(key, [])
        for func in funcs:
            func()

    def clear(self) -> None:
        self.enabled = False
        self.cache = []
        self.funcs_queue = queue.Queue()
        self._by_key = {}

    def pending(self) -> int:
        """How many filed entries still wait for their W."""
        return len(self._by_key) + self.funcs_queue.qsize()

    @contextmanager
    def active(self):
        """Make this the store the class-level API acts on, in this thread."""
        previous = getattr(_local, "store", None)
        _local.store = self
        try:
            yield self
        finally:
            _local.store = previous

    def running_backward(self) -> _RunningBackward:
        """Mark a backward in progress for this store (autograd may call layers from other threads)."""
        return _RunningBackward(self)


class _RunningBackward:
    """``with store.running_backward():`` (a class, not a generator: it runs once per B op)."""

    __slots__ = ("store", "key")

    def __init__(self, store: GradStore):
        self.store = store

    def __enter__(self) -> None:
        self.key = threading.get_ident()
        _in_backward[self.key] = self.store  # one dict store: atomic under the GIL

    def __exit__(self, *exc) -> None:
        _in_backward.pop(self.key, None)


_PROCESS_STORE = GradStore()
_local = threading.local()
_in_backward: dict[int, GradStore] = {}


def current_store() -> GradStore:
    """The store the class-level ``WeightGradStore`` API acts on here and now."""
    store = getattr(_local, "store", None)
    if store is not None:
        return store
    running = {id(s): s for s in list(_in_backward.values())}
    if len(running) == 1:  # a backward function called from one of autograd's device threads
        return next(iter(running.values()))
    if len(running) > 1:
        raise RuntimeError(
            "WeightGradStore was used from a thread that runs no pipeline step while several pipelines "
            "run backward at once, so it cannot tell which pipeline the weight gradient belongs to"
        )
    return _PROCESS_STORE


class _CurrentStoreAttributes(type):
    """Class-level attributes of ``WeightGradStore`` read and write the current store."""

    enabled = property(lambda cls: current_store().enabled, lambda cls, v: setattr(current_store(), "enabled", bool(v)))
    cache = property(lambda cls: current_store().cache, lambda cls, v: setattr(current_store(), "cache", v))
    funcs_queue = property(lambda cls: current_store().funcs_queue, lambda cls, v: setattr(current_store(), "funcs_queue", v))


class WeightGradStore(metaclass=_CurrentStoreAttributes):
    """The official class-level API, acting on the current pipeline's store (see module docs)."""

    @classmethod
    def put(cls, func: Callable[[], None]) -> None:
        current_store().put(func)

    @classmethod
    def flush(cls, key: Hashable | None = None) -> None:
        current_store().flush(key)

    @classmethod
    def pop(cls, key: Hashable | None = None) -> None:
        current_store().pop(key)

    @classmethod
    def clear(cls) -> None:
        current_store().clear()

    @classmethod
    def pending(cls) -> int:
        return current_store().pending()


class _DeferredLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        # Parameters are kept as objects: W accumulates into their .grad (or main_grad, main_grad.py) later.
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
                    accumulate_product(weight, g.t(), x.reshape(-1, x.shape[-1]))  # into main_grad where there is one
                if bias_needs:
                    accumulate(bias, g.sum(0))

        if weight_needs or bias_needs:
            _defer_or_run(weight_grad)
        return grad_in, None, None


def _file_or_run(weight_grad: Callable[[], None]) -> None:
    if WeightGradStore.enabled:
        WeightGradStore.put(weight_grad)
        return
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    if compiled_autograd is not None and getattr(compiled_autograd, "in_compiled_autograd_region", False):
        # Compiled autograd owns .grad during its backward and would silently drop this gradient.
        raise RuntimeError(
            "DeferredLinear cannot compute its weight gradient during a backward run by compiled autograd "
            "(torch._dynamo.config.compiled_autograd): it would be lost. Run this backward with the "
            "WeightGradStore enabled (a pipeline's B op), or without compiled autograd."
        )
    weight_grad()


_file_or_run_untraced = None


def _defer_or_run(weight_grad: Callable[[], None]) -> None:
    """File ``weight_grad`` for W if the current store is on, else run it now.

    The store is read when backward runs, never by a tracer: under torch.compile the call is
    excluded from graphs (``torch._dynamo.disable``), so dynamo runs the layer's autograd Function
    eagerly and no compiled graph can bake in the on/off decision it saw while tracing.
    """
    global _file_or_run_untraced
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:  # nothing can be tracing: torch.compile was never used in this process
        _file_or_run(weight_grad)
        return
    if _file_or_run_untraced is None:
        _file_or_run_untraced = dynamo.disable(_file_or_run)
    _file_or_run_untraced(weight_grad)


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
