"""Per-op timing of a real step: a monotonic clock on CPU, CUDA events on GPU."""

from __future__ import annotations

import time

import torch

__all__ = ["Recorder"]


class Recorder:
    """Collects (kind, label, start, end) for each op and wait of this rank, in seconds.

    On CPU the marks are ``time.perf_counter()``. On CUDA they are events on the current stream,
    so slices show when the GPU ran the work (and how long the stream waited for messages);
    they are turned into seconds on the same clock after the step, measured from an event
    recorded while the GPU was idle.
    """

    def __init__(self, device: torch.device | None = None):
        self.cuda = device is not None and device.type == "cuda"
        self._raw: list[tuple] = []
        if self.cuda:
            torch.cuda.synchronize(device)
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
            self._origin_wall = time.perf_counter()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, kind: str, label: str, start, end) -> None:
        self._raw.append((kind, label, start, end))

    @property
    def events(self) -> list[tuple[str, str, float, float]]:
        if not self.cuda:
            return list(self._raw)
        torch.cuda.synchronize()

        def seconds(event) -> float:
            return self._origin_wall + self._origin.elapsed_time(event) / 1e3

        return [(k, label, seconds(a), seconds(b)) for k, label, a, b in self._raw]
