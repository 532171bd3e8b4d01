"""The overlapped F&B op: one micro-batch's forward parts against another's backward parts.

The order comes from ``twinpipe.sim.overlap.fb_order`` (the parts' kinds only, so every rank of
an expert-parallel group issues its collectives in the same sequence). B parts defer their
weight gradients to the running pipeline's weight-gradient store under a key of their own; W steps
run them. Called with the store on (the backward half of the op is a B, as in ZB-H1 and ZB-V), it
runs no W step: the weight gradients stay in the store's cache for the caller to file under its B.
The parts a last stage's criterion adds (``twinpipe.overlap.tail``: DeepSeek-V3's MTP layers) run
in the forward record after the stage's own, interleaved alike.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from twinpipe.overlap.graph import Record, accumulate_input_grads, capture_backward
from twinpipe.overlap.parts import check_parts
from twinpipe.overlap.tail import tail_parts
from twinpipe.runtime.weight_grad import current_store
from twinpipe.sim.overlap import Step, fb_order

__all__ = ["forward_backward", "FBEvent"]



class FBEvent(NamedTuple):
    """One step of an F&B op as it ran (``twinpipe.overlap.report.fb_spans`` draws them)."""

    action: str  # run | start | wait (twinpipe.sim.overlap.Step)
    stream: str  # F | B | W
    part: str  # the part's name
    start: float  # seconds (time.perf_counter)
    end: float


def _backward_record(module1, loss1, outputs1, output_grads1) -> Record | None:
    """Run the criterion's backward (if any) up to module1's ``_Join`` and return its record,
    holding the gradients of the stage outputs."""
    if loss1 is not None:
        roots, grads = [loss1], [torch.ones_like(loss1)]
    else:
        roots, grads = list(outputs1), list(output_grads1)
    captured = capture_backward(roots, grads)
    if not captured:
        return None
    if len(captured) != 1:
        raise ValueError(f"{type(module1).__name__}: the backward reached {len(captured)} part-declaring stages; expected one")
    record, out_grads = captured[0]
    record.state = out_grads
    return record


def forward_backward(module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1, overlap: bool = True):
    """F of ``module0`` on ``inputs0`` with the full backward of ``module1``'s micro-batch.

    Returns ``(outputs0, loss0, events)``; gradients are accumulated into ``.grad`` (weights
    and module1's stage inputs), as the executor expects of ``overlapped_forward_backward``.
    """
    owner = type(module0).__name__
    own = check_parts(module0.parts(), owner)
    fwd = Record(own + tail_parts(criterion0, labels0), tuple(inputs0), owner)
    fwd.tail_from = len(own)
    bwd = _backward_record(module1, loss1, outputs1, output_grads1)
    b_parts = list(reversed(bwd.parts)) if bwd is not None else []
    n_b = len(b_parts)
    order = fb_order([p.kind for p in fwd.parts], [p.backward_kind for p in b_parts], overlap)
    events: list[FBEvent] = []
    clock = time.perf_counter
    store = current_store()  # the running pipeline's (class-level WeightGradStore acts on it too)
    enabled = store.enabled
    if enabled:  # the caller defers the weight gradients (a B half): no W steps, nothing filed here
        order = [step for step in order if step.stream != "W"]
    try:
        for step in order:
            t0 = clock()
            if step.stream == "F":
                name = fwd.parts[step.index].name
                _forward_step(fwd, step)
            else:
                k = n_b - 1 - step.index
                name = bwd.parts[k].name
                _backward_step(bwd, k, step, store, enabled)
            events.append(FBEvent(step.action, step.stream, name, t0, clock()))
    finally:
        store.enabled = enabled
    if bwd is not None:
        accumulate_input_grads(bwd)
    outputs0 = fwd.outputs()
    if fwd.width is not None:  # the criterion's parts ran: it reads their outputs (with_tail), the caller the stage's
        fwd.tail_outputs, outputs0 = outputs0, outputs0[: fwd.width]
    loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
    return list(outputs0), loss0, events


def _forward_step(fwd: Record, step: Step) -> None:
    """Run, start or wait for forward part ``step.index``."""
    if step.action == "run":
        fwd.run(step.index)
    elif step.action == "start":
        fwd.start(step.index)
    else:
        fwd.wait(step.index)


def _backward_step(bwd: Record, k: int, step: Step, store, enabled: bool) -> None:
    """Backward part ``k`` (stream B), or the weight gradients it deferred (stream W, under its own key)."""
    key = ("overlap", id(bwd), k)
    if step.stream == "W":
        store.pop(key)
    elif step.action == "run":
        store.enabled = True
        try:
            with store.running_backward():  # autograd's device threads find the store
                bwd.run_back(k)
        finally:
            store.enabled = enabled
        if not enabled:  # else the closures stay in the cache for the caller's key
            store.flush(key)
    elif step.action == "start":
        bwd.start_back(k)
    else:
        bwd.wait_back(k)
