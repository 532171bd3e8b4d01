"""Runs one rank's lowered program on real tensors. One executor serves every schedule.

Per op: receive what it needs (``Transport``), compute, hand the results on. Outputs that were
sent are freed at once (autograd keeps only what backward needs). B defers weight gradients to the
pipeline's ``GradStore`` under the op's (stage, micro-batch); W runs them. An optional
``on_grads_ready(stage)`` runs right after the last op of the step that writes the stage's weight
gradients (``last_grad_writes``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd import Variable

from twinpipe.runtime import observe
from twinpipe.runtime.recorder import Recorder
from twinpipe.runtime.releases import early_release
from twinpipe.runtime.transport import Transport
from twinpipe.runtime.weight_grad import GradStore
from twinpipe.runtime.wiring import StepWiring
from twinpipe.schedule.lower import Message
from twinpipe.schedule.ops import Op, OpKind

__all__ = ["StepData", "StepResult", "Executor", "run_backward", "last_grad_writes"]


@dataclass
class StepData:
    """What the user gave this rank for one step, already split into micro-batches."""

    inputs: dict[int, list[tuple]]  # first stage -> per micro-batch of its chain, the input tensors
    labels: dict[int, list[tuple]]  # last stage -> per micro-batch, the label tensors
    criterion: object | None
    return_outputs: bool
    training: bool


@dataclass
class StepResult:
    losses: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # last stage -> per-mb loss
    outputs: dict[int, list[tuple]] = field(default_factory=dict)  # last stage -> per-mb outputs
    peak_live: int = 0  # most (stage, micro-batch) activation sets held at once
    busy_s: float = 0.0  # seconds this rank ran its ops (not waiting for messages); the host's clock


def _profiling() -> bool:
    # Label ops for torch.profiler only while one records (entering a label costs ~20 us).
    return torch.autograd.profiler._is_profiler_enabled


def run_backward(tensors, grads) -> None:
    """Backward from ``tensors`` with ``grads``, accumulating into ``.grad``.

    Unlike ``torch.autograd.backward`` it skips the shape check: outputs that were sent to the next
    stage have had their data freed, but their graph nodes still know the right shapes. Use it in
    ``overlapped_forward_backward``.
    """
    Variable._execution_engine.run_backward(tuple(tensors), tuple(grads), False, False, (), True, True)


def last_grad_writes(ops) -> dict[int, list[int]]:
    """Op index -> the stages whose weight gradients are final once that op has run: for each stage,
    its last W, BW or F&B (by its backward half) in ``ops``. B counts too (layers that do not defer
    compute their weight gradients in B), though a valid schedule always runs its W later."""
    last: dict[int, int] = {}
    for index, op in enumerate(ops):
        if op.kind is OpKind.FB:
            last[op.backward.stage] = index
        elif op.kind is not OpKind.F:
            last[op.stage] = index
    ready: dict[int, list[int]] = {}
    for stage, index in last.items():
        ready.setdefault(index, []).append(stage)
    return ready


def _as_tuple(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise TypeError(f"a stage must return a tensor or a tuple/list of tensors, got {type(value).__name__}")


class Executor:
    """Executes one rank's program for one step (``wiring``) with its stage ``modules`` and weight-gradient
    ``store``. Created per step; layouts persist outside."""

    def __init__(self, wiring: StepWiring, modules: dict[int, nn.Module], store: GradStore, recorder: Recorder | None = None,
                 overlap_fn=None, on_grads_ready=None):
        self.program, self.placement, self.modules = wiring.program, wiring.placement, modules
        self.rank, self.store, self.device = wiring.program.rank, store, wiring.device
        self.recorder, self.overlap_fn, self.on_grads_ready = recorder, overlap_fn, on_grads_ready
        self.transport = Transport(wiring, self._where)
        self.acts: dict[tuple[int, int], tuple] = {}  # inputs waiting for a forward
        self.grads: dict[tuple[int, int], tuple] = {}  # output gradients waiting for a backward
        self.saved: dict[tuple[int, int], tuple] = {}  # (inputs, outputs, loss) kept for backward
        self.live = 0
        self.op_index = -1
        # Set to measure the step's activation memory: an observer whose ``measuring()`` installs it for
        # the step (runtime/observe.py; the meter, runtime/memory.py), sampled after each op.
        self.observer = None

    def _where(self) -> str:
        ops = self.program.ops
        op = ops[self.op_index] if 0 <= self.op_index < len(ops) else "end of step"
        return f"rank {self.rank}, op {self.op_index} ({op})"

    def _chunk(self, stage: int, mb: int) -> int:
        """Which of its chain's chunks of the user's batch micro-batch ``mb`` is."""
        chain = self.placement.chain_of_stage(stage)
        return mb - self.placement.microbatches_of_chain(chain, self._num_mb)[0]

    def _inputs_for(self, stage: int, mb: int, data: StepData) -> tuple:
        if self.placement.is_first(stage):
            return data.inputs[stage][self._chunk(stage, mb)]
        return self.acts.pop((stage, mb))

    def _labels_for(self, stage: int, mb: int, data: StepData) -> tuple:
        return data.labels[stage][self._chunk(stage, mb)]

    def _forward(self, stage: int, mb: int, data: StepData, outputs=None, loss=None, inputs=None) -> None:
        """Run (or, with ``outputs`` given, finish) the forward of ``stage`` on micro-batch ``mb``."""
        if inputs is None:
            inputs = self._inputs_for(stage, mb, data)
        last = self.placement.is_last(stage)
        if outputs is None:
            outputs = _as_tuple(self.modules[stage](*inputs))
            if last and data.criterion is not None:
                loss = data.criterion(*outputs, *self._labels_for(stage, mb, data))
        if last:
            if loss is not None:
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"criterion must return a one-element tensor, got {type(loss).__name__} "
                                     f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
                # A copy: a loss can be a view of an output-sized buffer (F.mse_loss's is), which a
                # detached view would keep alive for the whole step.
                kept = loss.detach().clone() if early_release("losses") else loss.detach()
                observe.note((kept,))  # held to the step's end: counted when measured
                self.result.losses.setdefault(stage, []).append(kept)
            if data.return_outputs:
                self.result.outputs.setdefault(stage, []).append(tuple(o.detach() for o in outputs))
        else:
            nxt = self.placement.next_stage(stage)
            handed = tuple(o.detach() for o in outputs)
            if self.placement.rank_of(nxt) == self.rank:  # the V turn: hand over locally
                self.acts[(nxt, mb)] = tuple(t.requires_grad_() if data.training and t.is_floating_point() else t for t in handed)
            else:
                self.transport.send(Message("act", stage, nxt, mb, self.rank, self.placement.rank_of(nxt)), handed)
                if data.training and not data.return_outputs:
                    self._free(outputs, inputs)
        if data.training:
            self.saved[(stage, mb)] = (inputs, outputs, loss)
            self.live += 1
            self.result.peak_live = max(self.result.peak_live, self.live)

    @staticmethod
    def _free(outputs: tuple, inputs: tuple) -> None:
        """Drop the data of sent outputs the stage computed; backward needs only their graph nodes.

        Leaves (the stage's inputs passed through, the user's tensors) and views (their memory
        belongs to another tensor, often an input) are kept as they are."""
        kept = {id(t) for t in inputs}
        for o in outputs:
            if o.grad_fn is not None and o._base is None and id(o) not in kept:
                o.data = torch.empty(0, dtype=o.dtype, device=o.device)

    def _graph_roots(self, stage: int, mb: int, outputs: tuple) -> tuple[list, list]:
        """The outputs a non-last stage backpropagates from, paired with their received gradients."""
        received = self.grads[(stage, mb)]
        floats = [o for o in outputs if o.is_floating_point() or o.is_complex()]
        pairs = [(o, g) for o, g in zip(floats, received) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _backward(self, stage: int, mb: int, defer_w: bool, data: StepData, run_graph: bool = True) -> None:
        inputs, outputs, loss = self.saved.pop((stage, mb))
        if self.placement.is_last(stage):
            if loss is None:
                raise ValueError(f"stage {stage} is a last stage and training needs a loss: pass criterion= to step()")
            roots, grads = [loss], [torch.ones_like(loss)]
        else:
            roots, grads = self._graph_roots(stage, mb, outputs)
            del self.grads[(stage, mb)]
        prev = self.placement.prev_stage(stage)
        # A full backward whose input gradient goes to another rank sends it before computing the
        # weight gradients: the peer waits only for B, and W runs while the message travels.
        send_first = not defer_w and prev is not None and self.placement.rank_of(prev) != self.rank
        if run_graph:
            self._backward_graph(roots, grads, defer_w or send_first, (stage, mb))
        if prev is not None:
            in_grads = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t in inputs
                if t.is_floating_point() or t.is_complex()
            )
            if self.placement.rank_of(prev) == self.rank:
                self.grads[(prev, mb)] = in_grads
            else:
                self.transport.send(Message("grad", stage, prev, mb, self.rank, self.placement.rank_of(prev)), in_grads)
            if early_release("input grad"):
                for t in inputs:  # handed on: W, which may keep the input itself, does not need its gradient
                    t.grad = None
        if send_first and run_graph:
            self.store.pop((stage, mb))
        if not defer_w:
            self.live -= 1

    def _backward_graph(self, roots, grads, defer_w: bool, key) -> None:
        if roots:
            self.store.enabled = defer_w
            try:
                with self.store.running_backward():
                    run_backward(roots, grads)
            finally:
                self.store.enabled = False
        if defer_w:
            self.store.flush(key)

    def _weight(self, stage: int, mb: int) -> None:
        self.store.pop((stage, mb))
        self.live -= 1

    def _forward_backward(self, op: Op, data: StepData) -> None:
        """F of one micro-batch with the backward of another (a full BW, or a B whose weight
        gradients wait for a W op): the user's overlapped implementation when the modules provide
        one, else one after the other. For a B half the store is on while the overlapped
        implementation runs, so that deferring layers file their weight gradients under the B."""
        f_stage, f_mb = op.stage, op.microbatch
        b_stage, b_mb = op.backward.stage, op.backward.microbatch
        defer_w = op.backward.kind is OpKind.B
        module0, module1 = self.modules[f_stage], self.modules[b_stage]
        if self.overlap_fn is None:
            self._forward(f_stage, f_mb, data)
            observe.sample()  # the forward's activations are live before the backward frees the other's
            self._backward(b_stage, b_mb, defer_w, data)
            return
        inputs0 = self._inputs_for(f_stage, f_mb, data)
        last0 = self.placement.is_last(f_stage)
        criterion0 = data.criterion if last0 else None
        labels0 = list(self._labels_for(f_stage, f_mb, data)) if last0 else []
        _, outputs1_all, loss1 = self.saved[(b_stage, b_mb)]
        if self.placement.is_last(b_stage):
            outputs1, grads1 = [], []
        else:
            outputs1, grads1 = self._graph_roots(b_stage, b_mb, outputs1_all)
        self.store.enabled = defer_w
        try:
            outputs0, loss0 = self.overlap_fn(module0, list(inputs0), criterion0, labels0, module1, loss1, outputs1, grads1)
        finally:
            self.store.enabled = False
        if defer_w:
            self.store.flush((b_stage, b_mb))
        # A stage that reports its parts' times (``trace_spans``) gets them on extra trace lanes.
        if self.recorder is not None and not self.recorder.cuda and hasattr(module0, "trace_spans"):
            for lane, label, start, end in module0.trace_spans():
                self.recorder.add(f"part:{lane}", label, start, end)
        # Finish both halves as the separate ops would; the backward graph has already run.
        self._forward(f_stage, f_mb, data, outputs=_as_tuple(outputs0), loss=loss0, inputs=inputs0)
        self._backward(b_stage, b_mb, defer_w, data, run_graph=False)

    # ---------------------------------------------------------------- the loop
    def run(self, data: StepData, num_microbatches: int) -> StepResult:
        if self.observer is None:
            return self._run(data, num_microbatches)
        with self.observer.measuring():
            return self._run(data, num_microbatches)

    def _run(self, data: StepData, num_microbatches: int) -> StepResult:
        self._num_mb = num_microbatches
        self.result = StepResult()
        program, rec = self.program, self.recorder
        hook = self.on_grads_ready if data.training else None  # forward-only steps write no gradients
        ready = last_grad_writes(program.ops) if hook is not None else {}
        unwritten = sorted(set(self.modules) - {s for stages in ready.values() for s in stages}) if hook is not None else ()
        for index, op in enumerate(program.ops):
            self.op_index = index
            if program.recvs[index]:
                t0 = rec.mark() if rec else 0.0
                for msg in program.recvs[index]:
                    tensors = self.transport.receive(msg)
                    if msg.kind == "act":
                        self.acts[(msg.dst_stage, msg.microbatch)] = tuple(
                            t.requires_grad_() if data.training and t.is_floating_point() else t for t in tensors
                        )
                    else:
                        self.grads[(msg.dst_stage, msg.microbatch)] = tuple(tensors)
                if early_release("last message"):
                    del tensors  # the loop must not keep the last message alive past its op
                if rec:
                    rec.add("wait", f"recv for {op}", t0, rec.mark())
                observe.sample()
            t0, began = rec.mark() if rec else 0.0, time.perf_counter()
            if _profiling():
                with torch.profiler.record_function(str(op)):
                    self._run_op(op, data)
            else:
                self._run_op(op, data)
            self.result.busy_s += time.perf_counter() - began
            if rec:
                rec.add("compute", str(op), t0, rec.mark())
            self.transport.open_if_agreed()
            if self.transport.in_flight:
                self.transport.retire(wait=False)
            observe.sample()
            if ready and index in ready:  # after the op's sends went out: peers wait on them, not on the hook
                for stage in ready[index]:
                    hook(stage)
        self.op_index = len(program.ops)
        for stage in unwritten:  # a stage no op of this step computes a gradient for
            hook(stage)
        t0 = rec.mark() if rec else 0.0
        self.transport.finish()
        if rec and self.transport.channels:
            rec.add("wait", "drain sends", t0, rec.mark())
        return self.result

    def _run_op(self, op: Op, data: StepData) -> None:
        kind = op.kind
        if kind is OpKind.F:
            if data.training:
                self._forward(op.stage, op.microbatch, data)
            else:
                with torch.no_grad():
                    self._forward(op.stage, op.microbatch, data)
        elif kind is OpKind.B:
            self._backward(op.stage, op.microbatch, True, data)
        elif kind is OpKind.BW:
            self._backward(op.stage, op.microbatch, False, data)
        elif kind is OpKind.W:
            self._weight(op.stage, op.microbatch)
        else:
            self._forward_backward(op, data)
