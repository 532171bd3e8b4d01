"""``PartedStage``: a stage module made of declared parts, overlapped in F&B ops automatically."""

from __future__ import annotations

from collections import deque

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
