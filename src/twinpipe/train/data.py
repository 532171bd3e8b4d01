"""Training data: a byte corpus every machine has, and a deterministic sampler of global batches.

Batch ``step`` depends only on the corpus, the seed, the step and the batch shape: every rank that
computes it gets the same rows, whatever the schedule, pipeline size or data-parallel size, and a
resumed run sees the batches it would have seen. Each rank then keeps its rows (``replica_rows``,
then the pipeline's ``batch_layout``).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from twinpipe.checks import check_int

__all__ = ["stdlib_corpus", "BatchSampler", "replica_rows"]


def stdlib_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """The source of Python's standard library (``*.py``, sorted by path) as a uint8 tensor.

    Reads files until ``max_bytes``; tests and site-packages are skipped so the text is the same
    on every machine with the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "dist-packages", "test", "idlelib") or "tests" in rel:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"found no Python source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class BatchSampler:
    """Random windows of ``seq_len + 1`` bytes; ``batch(step, rows)`` -> (inputs, next-byte labels)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int = 0):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise ValueError("tokens: must be a 1-D tensor of token ids")
        check_int(seq_len, "seq_len", low=1, high=tokens.numel() - 1, why="the corpus length - 1 at most")
        self.tokens, self.seq_len, self.seed = tokens.long(), seq_len, int(seed)

    def batch(self, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed((self.seed << 32) + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (rows,), generator=gen)
        window = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)]
        return window[:, :-1], window[:, 1:]


def replica_rows(batch_size: int, dp: int, dp_rank: int) -> slice:
    """The contiguous rows of a global batch that data-parallel replica ``dp_rank`` trains on."""
    per = batch_size // dp
    return slice(dp_rank * per, (dp_rank + 1) * per)
