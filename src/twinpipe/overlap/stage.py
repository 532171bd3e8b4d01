"""``PartedStage``: a stage module made of declared parts, overlapped in F&B ops automatically."""

from __future__ import annotations

from torch import nn

from twinpipe.overlap.engine import forward_backward
from twinpipe.overlap.graph import run_parts
from twinpipe.overlap.parts import check_parts

__all__ = ["PartedStage"]


class PartedStage(nn.Module):
    """Base class for a pipeline stage that declares its parts (see ``twinpipe.overlap.parts``).

    Subclasses implement ``parts()``; ``forward`` runs them in order. In schedules with F&B ops
    (DualPipe, DualPipeV) the pipeline calls ``overlapped_forward_backward``, which interleaves
    one micro-batch's forward parts with another's backward parts. Set ``overlap = False`` (on the
    forward module of the pair) to run F then B instead. ``last_fb_events`` holds the steps of the
    latest F&B op this module ran the forward of: ``(action, stream, part, start, end)``.
    """

    overlap: bool = True

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
        module0.last_fb_events = events
        return outputs0, loss0
