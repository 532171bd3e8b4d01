"""One micro-batch's forward kept part by part, so its backward can run part by part.

Each compute part runs on detached copies of its inputs (leaves), so its autograd graph stands
alone and ``run_backward`` can run it by itself. A part's backward hands on the ``.grad`` of its
leaves, so a later part may use (or return) one of them reached past the state, e.g. inside a
context object: the later part's backward, which runs first, adds to that ``.grad``. The stage's
outputs come out of ``_Join``, an
autograd function over the stage inputs: an ordinary backward (the executor's B or BW op, or
``loss.backward()``) reaches ``_Join.backward``, which runs the parts' backwards in reverse order,
one after the other. The overlap engine instead *captures* the output gradients at ``_Join`` and
runs the same per-part steps itself, interleaved with another micro-batch's forward.
"""

from __future__ import annotations

import torch

from twinpipe.overlap import state
from twinpipe.overlap.parts import Comm, check_state
from twinpipe.runtime.executor import run_backward

__all__ = ["Record", "run_parts", "capture_backward", "record_of"]


def _leaf(value):
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return value.detach().requires_grad_()
    return value


class Record:
    """The parts of one micro-batch's forward, what each saved, and the state between steps."""

    def __init__(self, parts: list, inputs: tuple, owner: str, capture: bool = True):
        self.parts, self.inputs, self.owner = parts, tuple(inputs), owner
        self.capture = capture  # whether capture_backward stops at its _Join (a stage's), or runs through it
        self.state = self.inputs  # forward: the next part's input; backward: the gradients of it
        self.saved: list = []
        self.pending = None
        self.keep = torch.is_grad_enabled()
        # A last stage's criterion may add parts after the stage's own (twinpipe.overlap.tail):
        self.tail_from = len(parts)  # the first of them
        self.width: int | None = None  # how many entries the stage's own parts ended with
        self.tail_outputs: tuple | None = None  # the joined outputs, once the added parts have run

    # ------------------------------------------------------------ forward
    def run(self, k: int) -> None:
        part = self.parts[k]
        self._reach(k)
        if self.keep:
            leaves = tuple(_leaf(v) for v in self.state)
            out = check_state(part.fn(*leaves), part, "its result")
            self.saved.append((leaves, out))
        else:
            out = check_state(part.fn(*self.state), part, "its result")
        self.state = out

    def start(self, k: int) -> None:
        self._reach(k)
        self.pending = self.parts[k].start(*self.state)

    def _reach(self, k: int) -> None:
        if k == self.tail_from:
            self.width = len(self.state)

    def wait(self, k: int) -> None:
        part = self.parts[k]
        result = self.pending.wait()
        self.pending = None
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ValueError(f"part {part.name!r}: start(...).wait() must give (state, ctx)")
        out, ctx = result
        if self.keep:
            self.saved.append((len(self.state), ctx))
        self.state = check_state(out, part, "its state")

    def step_forward(self, k: int) -> None:
        """Run part ``k`` to the end (a comm part is started and waited for at once)."""
        if isinstance(self.parts[k], Comm):
            self.start(k)
            self.wait(k)
        else:
            self.run(k)

    def outputs(self) -> tuple:
        """The stage outputs: the last state, joined to the stage inputs for autograd."""
        bad = [type(v).__name__ for v in self.state if not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"{self.owner}: the last part must return tensors only, got a {bad[0]}")
        if not self.keep:
            return self.state
        # The anchor puts _Join in the graph even when no input needs a gradient (a first stage).
        anchor = torch.empty(0, device=self.state[0].device if self.state else None, requires_grad=True)
        outs = _Join.apply(self, anchor, *self.inputs)
        for o in self.state:
            # The backward needs these only as roots (their grad_fn): let the returned aliases own
            # the data, so that a pipeline that frees sent outputs frees it.
            if o.grad_fn is not None and o._base is None and not any(o is x for x in self.inputs):
                o.data = torch.empty(0, dtype=o.dtype, device=o.device)
        return outs

    def extend(self, parts: list, outputs: tuple) -> tuple:
        """Go on from this record's joined ``outputs`` with ``parts`` (a criterion's, see
        ``twinpipe.overlap.tail``) and join again: one record, one backward for all its parts."""
        self.tail_from = len(self.parts)
        self.parts = [*self.parts, *parts]
        self.state = tuple(outputs)
        for k in range(self.tail_from, len(self.parts)):
            self.step_forward(k)
        self.tail_outputs = self.outputs()
        return self.tail_outputs

    # ------------------------------------------------------------ backward
    def run_back(self, k: int) -> None:
        """Backward of compute part ``k`` (or of a comm part that sends nothing back):
        ``self.state`` holds its output gradients."""
        if isinstance(self.parts[k], Comm):
            n_in = self.saved[k][0]
            self.saved[k] = None
            if len(self.state) != n_in:
                raise ValueError(f"part {self.parts[k].name!r}: with no start_backward its state must keep its "
                                 f"{n_in} entries, got {len(self.state)}")
            return
        leaves, outs = self.saved[k]
        self.saved[k] = None
        position = {id(v): i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)}
        roots, grads, through = [], [], []
        for o, g in zip(outs, self.state):
            if g is None or not isinstance(o, torch.Tensor) or not o.requires_grad:
                continue
            if id(o) in position:  # an input handed on unchanged
                through.append((leaves[position[id(o)]], g))
            elif o.grad_fn is not None:
                roots.append(o)
                grads.append(g)
            else:  # a leaf of an earlier part, reached past the state (e.g. inside a context object):
                through.append((o, g))  # that part's backward reads its .grad, as for any use of it
        if roots:
            run_backward(roots, grads)
        for leaf, g in through:
            leaf.grad = g if leaf.grad is None else leaf.grad + g
        self.state = tuple(v.grad if isinstance(v, torch.Tensor) and v.requires_grad else None for v in leaves)

    def start_back(self, k: int) -> None:
        ctx = self.saved[k][1]
        self.pending = self.parts[k].start_backward(ctx, self.state)

    def wait_back(self, k: int) -> None:
        part = self.parts[k]
        n_in = self.saved[k][0]
        grads = check_state(self.pending.wait(), part, "start_backward(...).wait()")
        self.pending, self.saved[k] = None, None
        if len(grads) != n_in:
            raise ValueError(f"part {part.name!r}: start_backward gave {len(grads)} gradients for {n_in} input entries")
        self.state = grads

    def step_backward(self, k: int) -> None:
        if self.parts[k].backward_kind == "comm":
            self.start_back(k)
            self.wait_back(k)
        else:
            self.run_back(k)

    def input_grads(self) -> tuple:
        """After every part's backward: one gradient (or None) per stage input."""
        return tuple(g if isinstance(x, torch.Tensor) and x.requires_grad else None for x, g in zip(self.inputs, self.state))


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx, record: Record, anchor, *inputs):
        ctx.record = record
        ctx.set_materialize_grads(False)
        outs = tuple(t.detach() for t in record.state)
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        record, n = ctx.record, len(ctx.needs_input_grad)
        captured = state.captured()
        if captured is not None and record.capture:  # capture_backward: hand the record over, run nothing
            captured.append((record, grads))
            return (None,) * n
        record.state = grads
        for k in reversed(range(len(record.parts))):
            record.step_backward(k)
        return (None, None, *record.input_grads())


def run_parts(parts: list, inputs: tuple, owner: str, *, capture: bool = True):
    """A stage's plain forward: every part in order; returns a tensor or a tuple of tensors.
    ``capture=False``: parts run inside something else (a block called in a criterion), whose
    backward runs through them even under ``capture_backward``, as any autograd function's."""
    record = Record(parts, inputs, owner, capture)
    for k in range(len(parts)):
        record.step_forward(k)
    outs = record.outputs()
    return outs[0] if len(outs) == 1 else tuple(outs)


def record_of(outputs) -> Record | None:
    """The record whose join gave ``outputs`` (a stage in parts, with autograd on), else None."""
    for out in outputs:
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            record = getattr(out.grad_fn, "record", None)  # a custom function's node is its ctx: _Join's keeps the record
            return record if isinstance(record, Record) else None
    return None


def capture_backward(roots: list, grads: list) -> list[tuple[Record, tuple]]:
    """Backward from ``roots`` that stops at every ``_Join`` it reaches (of records made with
    ``capture``) and returns, for each, the record and its output gradients (the parts themselves are left to the caller)."""
    if not roots:
        return []
    with state.capturing() as captured:
        run_backward(roots, grads)
    return captured


def input_grad_roots(record: Record) -> tuple[list, list]:
    """The stage-input gradients: added into ``.grad`` of leaf inputs; the other inputs and their
    gradients returned, for a backward through what computed them."""
    roots, grads = [], []
    for x, g in zip(record.inputs, record.input_grads()):
        if g is None:
            continue
        if x.is_leaf:
            x.grad = g if x.grad is None else x.grad + g
        else:
            roots.append(x)
            grads.append(g)
    return roots, grads


def accumulate_input_grads(record: Record) -> None:
    """Hand the stage-input gradients on: into ``.grad`` of leaf inputs, through the graph otherwise."""
    roots, grads = input_grad_roots(record)
    if roots:
        run_backward(roots, grads)
