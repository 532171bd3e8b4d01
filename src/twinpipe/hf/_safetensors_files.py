"""A ``transformers`` checkpoint folder's safetensors files: which file holds which key, and reading
single keys or some rows of one, opening each file once and only the files asked for.

A folder holds ``model.safetensors`` or shards named in ``model.safetensors.index.json``
(``{"weight_map": {key: file}}``); a single file's key list is its header (read without its data).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from twinpipe.train.checkpoint_files import CheckpointError

__all__ = ["SINGLE", "INDEX", "CheckpointFiles", "shard_name"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def shard_name(i: int, n: int) -> str:
    """The name ``save_pretrained`` gives shard ``i`` (from 0) of ``n``."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class CheckpointFiles:
    """The safetensors files of one folder (``where``: the key -> file map); ``open(file)`` once each."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self._open: dict[str, object] = {}
        index, single = self.folder / INDEX, self.folder / SINGLE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.where = {str(k): str(v) for k, v in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise CheckpointError(self.folder, f"file {INDEX}: not a safetensors index ({type(error).__name__}: {error})") from None
            bad = sorted({f for f in self.where.values() if Path(f).name != f or not (self.folder / f).is_file()})
            if bad:
                raise CheckpointError(self.folder, f"file {INDEX}: names shard(s) {', '.join(bad)} that are not files in the folder")
        elif single.is_file():
            self.where = {key: SINGLE for key in self.open(SINGLE).keys()}
        else:
            raise CheckpointError(self.folder, f"holds neither {SINGLE} nor {INDEX} (not a safetensors checkpoint of transformers)")

    def open(self, file: str):
        if file not in self._open:
            try:
                self._open[file] = safe_open(str(self.folder / file), framework="pt")
            except Exception as error:
                raise CheckpointError(self.folder, f"file {file}: not readable as safetensors ({type(error).__name__}: {error})") from None
        return self._open[file]

    def opened(self) -> list[str]:
        return sorted(self._open)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def _slice(self, key: str):
        file = self.where[key]
        try:
            return self.open(file).get_slice(key)
        except Exception as error:  # the index names a key the file lacks
            raise CheckpointError(self.folder, f"file {file}: has no tensor {key!r} ({type(error).__name__}: {error}); "
                                               f"{INDEX} says it does") from None

    def read(self, key: str, rows=None) -> torch.Tensor:
        """Tensor ``key``, or its ``rows`` along dim 0 (in that order, repeats allowed), reading only those rows."""
        piece = self._slice(key)
        if rows is None:
            return piece[:]
        parts, start = [], 0
        rows = list(rows)
        while start < len(rows):  # runs of consecutive rows as one slice each
            end = start + 1
            while end < len(rows) and rows[end] == rows[end - 1] + 1:
                end += 1
            parts.append(piece[rows[start] : rows[end - 1] + 1])
            start = end
        return torch.cat(parts) if len(parts) > 1 else parts[0]
