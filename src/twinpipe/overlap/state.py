"""What the overlap package keeps between calls, in one place (nothing else in ``overlap/`` holds
module-level state).

``side_stream(device)``: the CUDA stream all-to-alls of ``device`` run on, made once and reused
(so their order on the stream follows the order they were started in). ``capturing()``: while a
``capture_backward`` runs, the list the stages' joins hand their records to instead of running
their backward parts; ``captured()`` is that list (None outside one).
"""

from __future__ import annotations

from contextlib import contextmanager

__all__ = ["side_stream", "capturing", "captured"]


class _State:
    def __init__(self):
        self.side_streams: dict = {}  # torch.device -> torch.cuda.Stream
        self.captured: list | None = None  # (record, output grads) of the joins one capture_backward reached


_STATE = _State()


def side_stream(device):
    """The side stream of CUDA ``device`` (made on first use)."""
    import torch

    if device not in _STATE.side_streams:
        _STATE.side_streams[device] = torch.cuda.Stream(device)
    return _STATE.side_streams[device]


@contextmanager
def capturing():
    """Collect what the joins a backward reaches hand over; yields the list (restored after, nested too)."""
    outer, _STATE.captured = _STATE.captured, []
    try:
        yield _STATE.captured
    finally:
        _STATE.captured = outer


def captured() -> list | None:
    """The list a running ``capturing()`` collects into, else None."""
    return _STATE.captured
