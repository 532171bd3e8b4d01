"""Training data: a byte corpus every machine has, and a deterministic sampler of global batches.

Batch ``step`` depends only on the corpus, the seed, the step and the batch shape: every rank that
computes it gets the same rows, whatever the schedule, pipeline size or data-parallel size, and a
resumed run sees the batches it would have seen. Each rank then keeps its rows (``replica_rows``,
then the pipeline's ``batch_layout``).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from twinpipe.checks import check_int

__all__ = ["stdlib_corpus", "BatchSampler", "replica_rows", "batch_seed"]


def stdlib_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """The source of Python's standard library (``*.py``, sorted by path) as a uint8 tensor.

    Reads files until ``max_bytes``; tests and site-packages are skipped so the text is the same
    on every machine with the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in _sources(root):
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


_SKIPPED_TOP = ("site-packages", "dist-packages", "test", "idlelib")  # installed packages, the stdlib's own tests


def _sources(root: Path) -> list[Path]:
    """The ``*.py`` files under ``root``, sorted by path, without the folders ``_SKIPPED_TOP`` (at the
    top) and ``tests`` (anywhere). Those folders are never listed: site-packages alone can hold far
    more files than the standard library, and every rank reads the corpus at start."""
    found = []
    for folder, dirs, files in os.walk(root):  # symlinked folders are not entered
        top = folder == str(root)
        dirs[:] = [d for d in dirs if d != "tests" and not (top and d in _SKIPPED_TOP)]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens; ``batch(step, rows)`` -> (inputs, next-token labels).

    ``tokens``: a 1-D tensor, or a 1-D numpy array of integer ids such as a memory map of a token file
    (``twinpipe.train.tokens.open_tokens``): only the windows a batch draws are read. The windows'
    starts come from a torch generator seeded with (seed, step), so a tensor and an array of the same
    ids give the same batches."""

    def __init__(self, tokens, seq_len: int, seed: int = 0):
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise ValueError("tokens: must be a 1-D array of integer token ids")
            size = tokens.size
        elif isinstance(tokens, torch.Tensor) and tokens.dim() == 1:
            tokens, size = tokens.long(), tokens.numel()
        else:
            raise ValueError("tokens: must be a 1-D tensor or numpy array of token ids")
        check_int(seq_len, "seq_len", low=1, high=size - 1, why="the corpus length - 1 at most")
        self.tokens, self.seq_len, self.seed, self.size = tokens, seq_len, int(seed), size

    def batch(self, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(batch_seed(self.seed, step))
        return self.windows(torch.randint(0, self.size - self.seq_len, (rows,), generator=gen))

    def windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, next-token labels) of the windows of ``seq_len + 1`` tokens at ``starts``."""
        if isinstance(self.tokens, torch.Tensor):
            window = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)]
        else:  # read only the windows (a memory map stays on disk)
            window = torch.from_numpy(np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64)
                                                for s in starts.tolist()]))
        return window[:, :-1], window[:, 1:]


_GOLDEN = 0x9E3779B9  # odd: seed -> seed * _GOLDEN is one-to-one modulo 2**32, and spreads neighbouring seeds apart


def batch_seed(seed: int, step: int) -> int:
    """The generator seed of batch ``step``: ``(seed * 0x9E3779B9 + step) mod 2**32``.

    torch's CPU generator keeps only the low 32 bits of a seed, so ``seed`` must act inside them (a
    ``(seed << 32) + step`` would be lost, and every seed would draw seed 0's batches). Seed 0 draws
    batch ``step`` from seed ``step``; another seed's batches are seed 0's shifted by ``seed * 0x9E3779B9``
    modulo 2**32 steps (any two seeds of 0..1000: at least 1.9 million steps apart)."""
    return (int(seed) * _GOLDEN + int(step)) & 0xFFFFFFFF


def replica_rows(batch_size: int, dp: int, dp_rank: int) -> slice:
    """The contiguous rows of a global batch that data-parallel replica ``dp_rank`` trains on."""
    per = batch_size // dp
    return slice(dp_rank * per, (dp_rank + 1) * per)
