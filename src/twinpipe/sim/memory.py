"""Per-rank memory, in bytes: the one report shape that measured runs and predictions share.

A rank's memory comes in parts (``MemoryParts``): its stages' parameters, their gradients, the
FP32 master weights (mixed precision; 0 otherwise), the optimizer state, and the peak bytes its
activations reach during a step (what autograd saves for backward, what the weight-gradient
closures keep until W, and the receive buffers of messages not yet consumed). ``total`` is their
sum. A ``RankMemory`` pairs what a run measured with what was predicted for the same rank.

Pure Python: the trainer fills ``measured`` (``twinpipe.runtime.memory``), the planner and the
trainer's up-front check fill ``predicted`` (``activation_peaks`` below and
``twinpipe.plan``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["PARTS", "MemoryParts", "RankMemory", "format_bytes", "memory_lines"]

PARTS = ("params", "grads", "master", "optimizer", "activations_peak")


@dataclass
class MemoryParts:
    """One rank's bytes, by part. ``device_peak``: ``torch.cuda.max_memory_allocated`` over the
    step where there is a GPU (measured only; not part of ``total``)."""

    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer: int = 0
    activations_peak: int = 0
    device_peak: int | None = None

    @property
    def total(self) -> int:
        return sum(int(getattr(self, part)) for part in PARTS)

    def to_dict(self) -> dict:
        out = {part: int(getattr(self, part)) for part in PARTS}
        out["total"] = self.total
        if self.device_peak is not None:
            out["device_peak"] = int(self.device_peak)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> MemoryParts:
        return cls(**{k: data[k] for k in (*PARTS, "device_peak") if k in data})


@dataclass
class RankMemory:
    """What one rank measured and what was predicted for it (bytes, by part)."""

    rank: int
    dp_rank: int = 0
    pp_rank: int = 0
    measured: MemoryParts = field(default_factory=MemoryParts)
    predicted: MemoryParts = field(default_factory=MemoryParts)

    def to_dict(self) -> dict:
        """The entry ``train-log.json`` holds under ``"memory"`` (one per rank)."""
        return {"rank": self.rank, "dp_rank": self.dp_rank, "pp_rank": self.pp_rank,
                "measured": self.measured.to_dict(), "predicted": self.predicted.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> RankMemory:
        return cls(data["rank"], data.get("dp_rank", 0), data.get("pp_rank", 0),
                   MemoryParts.from_dict(data["measured"]), MemoryParts.from_dict(data["predicted"]))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def memory_lines(entries: list[RankMemory]) -> list[str]:
    """One line per rank: measured / predicted activation peak and total, and their ratio."""
    lines = []
    for e in entries:
        m, p = e.measured, e.predicted
        ratio = f"{m.activations_peak / p.activations_peak:.2f}" if p.activations_peak else "-"
        lines.append(f"rank {e.rank} (dp {e.dp_rank}, pp {e.pp_rank}): activations measured {format_bytes(m.activations_peak)}, "
                     f"predicted {format_bytes(p.activations_peak)} (x{ratio}); total measured {format_bytes(m.total)}, "
                     f"predicted {format_bytes(p.total)}")
    return lines
