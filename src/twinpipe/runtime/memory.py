"""Measuring one rank's activation memory during a step, and the bytes of its other state.

``ActivationMeter`` counts the storages a step keeps for backward: every tensor autograd saves
(``torch.autograd.graph.saved_tensors_hooks``), every tensor a deferred weight-gradient closure
captures until its W, and every receive buffer the transport posts. Each storage counts once, by
its bytes, from when it is first seen until it is freed (a weak reference to the storage tells).
Parameters, buffers and the user's inputs and labels are not activations and are left out. The
meter samples the live total after every op (and every receive) and keeps the peak: an op-level
peak, the granularity of the memory model (``twinpipe.sim.memory``).

On CUDA, ``torch.cuda.max_memory_allocated`` over the step is read as well (``device_peak``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from twinpipe.runtime.observe import installed, observing
from twinpipe.sim.memory import StageMemory

__all__ = ["ActivationMeter", "measure_stage", "storage_bytes", "grad_bytes", "optimizer_bytes"]

_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)  # -1 outside a backward


def _key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (s.device.type, s.device.index, s.data_ptr())


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each storage once)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        key = _key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def grad_bytes(params) -> int:
    """Bytes of the parameters' ``.grad`` storages."""
    return storage_bytes(p.grad for p in params if p.grad is not None)


def optimizer_bytes(optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (moments, steps), each storage once."""
    return storage_bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


class ActivationMeter:
    """Live bytes of the activations a step holds, and their peak (see the module doc).

    ``exclude``: tensors whose storages are not activations (parameters, buffers, user data)."""

    def __init__(self, exclude=(), device: torch.device | None = None):
        self.excluded = {_key(t) for t in exclude if isinstance(t, torch.Tensor) and not t.is_meta}
        self.tracked: dict[tuple, tuple[StorageWeakRef, int]] = {}
        self.live = 0
        self.peak = 0
        self.device_peak: int | None = None
        self.device = device

    def track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        key = _key(t)
        if key in self.excluded:
            return
        seen = self.tracked.get(key)
        if seen is not None:
            if not seen[0].expired():
                return
            self.live -= seen[1]  # a freed storage whose address was reused
        self.tracked[key] = (StorageWeakRef(storage), nbytes)
        self.live += nbytes  # the peak is taken at ``sample``, once freed storages are swept

    def sample(self) -> int:
        """Forget freed storages; the live total now (and update the peak)."""
        dead = [k for k, (ref, _) in self.tracked.items() if ref.expired()]
        for k in dead:
            self.live -= self.tracked.pop(k)[1]
        self.peak = max(self.peak, self.live)
        return self.live

    def _pack(self, t: torch.Tensor):
        self.track(t)
        if _graph_task_id() != -1:  # saved during a backward: a reentrant checkpoint recomputing
            self.sample()  # its region, freed before the op ends (see _counting_recomputation)
        # A new tensor on the same storage: returning ``t`` itself would tie an output to its own
        # graph node (a reference cycle) and share its data with the executor's freeing of sent outputs.
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @contextmanager
    def measuring(self):
        """Count while inside: saved tensors, and what is reported through ``runtime/observe.py`` (this meter is installed there); and
        the activations ``torch.utils.checkpoint`` recomputes in a backward (``_counting_recomputation``)."""
        cuda = self.device is not None and self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            with observing(self), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), _counting_recomputation():
                yield self
        finally:
            self.sample()
            if cuda:
                self.device_peak = int(torch.cuda.max_memory_allocated(self.device))


_recomputing = 0  # measuring contexts open (any thread): the checkpoint hook below is installed while > 0
_recomputing_lock = threading.Lock()


@contextmanager
def _counting_recomputation():
    """While measuring, count what a non-reentrant ``torch.utils.checkpoint`` region recomputes.

    Inside a checkpointed region checkpoint's own saved-tensor hooks replace the meter's: its
    forward keeps only the region's inputs (seen: they are saved outside the region), and a
    backward recomputes the region's activations under another hook of its own, keeps them until
    the backward has used them, all inside one B op, between the meter's samples. So the meter
    takes them here: each recomputed tensor is tracked as checkpoint saves it, and the live total
    is sampled once the recomputation is done (every recomputed tensor alive). A reentrant
    checkpoint recomputes under the meter's own hooks: ``_pack`` samples what is saved during a backward.
    """
    global _recomputing
    import torch.utils.checkpoint as checkpoint

    if not isinstance(getattr(checkpoint, "_recomputation_hook", None), type):  # a torch without it: not counted
        yield
        return
    with _recomputing_lock:
        _recomputing += 1
        if _recomputing == 1:
            original = checkpoint._recomputation_hook
            checkpoint._recomputation_hook = type("_counted_recomputation_hook", (original,), {
                "__init__": _counted_init, "__exit__": _counted_exit, "_original": original})
    try:
        yield
    finally:
        with _recomputing_lock:
            _recomputing -= 1
            if _recomputing == 0:
                checkpoint._recomputation_hook = checkpoint._recomputation_hook._original


def _counted_init(self, *args, **kwargs) -> None:
    type(self)._original.__init__(self, *args, **kwargs)
    pack = self.pack_hook

    def counting_pack(x):
        meter = installed()
        if meter is not None:
            meter.track(x)
        return pack(x)

    self.pack_hook = counting_pack


def _counted_exit(self, *exc) -> None:
    type(self)._original.__exit__(self, *exc)
    meter = installed()
    if meter is not None:
        meter.sample()


def _message_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_stage(module, inputs, *, first: bool = False, criterion=None, labels=()) -> StageMemory:
    """What one micro-batch of ``module`` holds (``twinpipe.sim.memory.StageMemory``), measured on
    the stage itself as the executor runs it: F on ``inputs`` (copies, as if received, unless
    ``first``; with ``criterion`` and ``labels`` for a last stage), then B with its weight
    gradients deferred, then W. Parameters' gradients are left as they were."""
    from twinpipe.runtime.weight_grad import GradStore

    grads_before = [(p, p.grad) for p in module.parameters()]
    ins = list(inputs) if first else [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    labels = tuple(labels)
    meter = ActivationMeter([*module.parameters(), *module.buffers(), *labels, *(ins if first else ())])
    store = GradStore()
    try:
        with store.active(), meter.measuring():
            found = _measure_forward(meter, module, ins, first, criterion, labels)
            roots, grads = found.pop("roots"), found.pop("grads")
            found.update(_measure_backward(meter, store, roots, grads, ins if not first else [], criterion is None, found))
            del roots, grads, ins
            store.pop("measured")
    finally:
        store.clear()
        for p, g in grads_before:
            p.grad = g
    return StageMemory(**found)


def _measure_forward(meter: ActivationMeter, module, ins: list, first: bool, criterion, labels: tuple) -> dict:
    """F: what autograd saved, besides the input and output storages."""
    from twinpipe.runtime.executor import _as_tuple

    outputs = _as_tuple(module(*ins))
    loss = criterion(*outputs, *labels) if criterion is not None else None
    meter.sample()
    in_keys = set() if first else {_key(t) for t in ins}
    in_bytes = 0 if first else _message_bytes(ins)
    out_bytes = _message_bytes(outputs)
    floats = [o for o in outputs if o.is_floating_point() and o.requires_grad]
    saves_in = bool(in_keys & set(meter.tracked))
    saves_out = bool({_key(t) for t in outputs} & set(meter.tracked))
    found = dict(in_bytes=in_bytes, out_bytes=out_bytes, out_grad_bytes=_message_bytes(floats), in_tensors=len(ins),
                 out_tensors=len(outputs), saves_in=saves_in, saves_out=saves_out,
                 f_other=max(0, meter.live - in_bytes * saves_in - out_bytes * saves_out))
    if loss is not None:  # the executor holds a last stage's outputs until its backward is done
        found.update(roots=[loss, *outputs], grads=[torch.ones_like(loss)])
    else:
        found.update(roots=floats, grads=[torch.ones_like(o) for o in floats])  # values do not matter; no RNG drawn
    return found


def _measure_backward(meter: ActivationMeter, store, roots: list, grads: list, ins: list, received_grad: bool, found: dict) -> dict:
    """B with deferred weight gradients: what W keeps, besides the input and the received gradient."""
    from twinpipe.runtime.executor import run_backward

    grad_refs = [(StorageWeakRef(g.untyped_storage()), _key(g)) for g in grads]
    before, peak = meter.sample(), meter.peak
    meter.peak = before  # what the B holds on top while it runs (a checkpointed region recomputed)
    store.enabled = True
    with store.running_backward():
        run_backward(roots[:len(grads)], grads)
    store.enabled = False
    b_extra, meter.peak = meter.peak - before, max(peak, meter.peak)
    store.flush("measured")
    in_grads = [t.grad for t in ins if t.is_floating_point() and t.grad is not None]
    in_grad_bytes = _message_bytes(in_grads)
    for t in ins:
        t.grad = None
    in_refs = [(StorageWeakRef(t.untyped_storage()), _key(t)) for t in ins]
    roots.clear(), grads.clear(), ins.clear()
    del in_grads
    meter.sample()
    alive = lambda refs: any(not ref.expired() and key in meter.tracked for ref, key in refs)  # noqa: E731
    w_keeps_in, w_keeps_grad = alive(in_refs), received_grad and alive(grad_refs)
    w_other = meter.live - found["in_bytes"] * w_keeps_in - found["out_grad_bytes"] * w_keeps_grad
    return dict(in_grad_bytes=in_grad_bytes, w_other=max(0, w_other), w_keeps_in=w_keeps_in, w_keeps_grad=w_keeps_grad,
                b_extra=b_extra)
