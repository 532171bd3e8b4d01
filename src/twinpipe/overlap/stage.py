"""``PartedStage``: a stage module made of declared parts, overlapped in F&B ops automatically;
``PartedSequential``: such a stage stacked from layers."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Sequence

from torch import nn

from twinpipe.overlap.engine import forward_backward
from twinpipe.overlap.graph import run_parts
from twinpipe.overlap.parts import Compute, check_parts
from twinpipe.overlap.report import fb_spans

__all__ = ["PartedStage", "PartedSequential"]


class PartedStage(nn.Module):
    """Base class for a pipeline stage that declares its parts (see ``twinpipe.overlap.parts``).

    Subclasses implement ``parts()``; ``forward`` runs them in order. In schedules with F&B ops
    (DualPipe, DualPipeV) the pipeline calls ``overlapped_forward_backward``, which interleaves
    one micro-batch's forward parts with another's backward parts. Set ``overlap = False`` (on the
    forward module of the pair) to run F then B instead. ``fb_events`` holds, per F&B op this module
    ran the forward of (the latest 64), its steps: ``(action, stream, part, start, end)``.
    """

    overlap: bool = True

    @property
    def fb_events(self) -> deque:
        if "_fb_events" not in self.__dict__:
            self.__dict__["_fb_events"] = deque(maxlen=64)
        return self.__dict__["_fb_events"]

    @property
    def last_fb_events(self) -> list | None:
        return self.fb_events[-1] if self.fb_events else None

    def trace_spans(self) -> list[tuple[str, str, float, float]]:
        """The last F&B op's parts as ``(lane, label, start, end)``: the executor records them on
        extra lanes of the pipeline's trace (``Pipeline.step(trace=True)``)."""
        return fb_spans(self.last_fb_events or ())

    def parts(self) -> list:
        raise NotImplementedError(f"{type(self).__name__} must define parts()")

    def forward(self, *inputs):
        name = type(self).__name__
        return run_parts(check_parts(self.parts(), name), inputs, name)

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1):
        outputs0, loss0, events = forward_backward(
            module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1, overlap=module0.overlap
        )
        module0.fb_events.append(events)
        return outputs0, loss0


class PartedSequential(PartedStage):
    """``layers`` in order as one stage. A layer with ``parts()`` contributes its parts (renamed
    ``"i.name"``); any other module is one compute part that calls it (a tensor or a tuple of
    tensors in and out), e.g. an embedding or a head around MoE blocks."""

    def __init__(self, layers: Sequence[nn.Module], overlap: bool = True):
        super().__init__()
        layers = list(layers)
        if not layers or not all(isinstance(layer, nn.Module) for layer in layers):
            raise ValueError(f"layers={layers!r}: must be a non-empty sequence of nn.Module")
        self.layers = nn.ModuleList(layers)
        self.overlap = overlap

    def parts(self) -> list:
        out = []
        for i, layer in enumerate(self.layers):
            if hasattr(layer, "parts"):
                declared = check_parts(layer.parts(), type(layer).__name__)
                out += [dataclasses.replace(p, name=f"{i}.{p.name}") for p in declared]
            else:
                out.append(Compute(f"{i}.{type(layer).__name__}", _called(layer)))
        return out


def _called(layer: nn.Module):
    def run(*state):
        result = layer(*state)
        return result if isinstance(result, tuple) else (result,)

    return run
