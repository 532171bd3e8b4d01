"""A ``transformers`` checkpoint folder's safetensors files: which file holds which key, and reading
single keys or some rows of one, opening each file once and only the files asked for.

A folder holds ``model.safetensors`` or shards named in ``model.safetensors.index.json``
(``{"weight_map": {key: file}}``); a single file's key list is its header (read without its data).
Each file is read through ``twinpipe.folders``' rules: a plain name of the folder, a regular file
(a FIFO would block), the index of bounded size; symbolic links are followed, as the Hugging Face
hub's cache is made of them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from twinpipe.folders import UnsafeFile, listed_stat, read_listed_json
from twinpipe.train.checkpoint_files import CheckpointError

__all__ = ["SINGLE", "INDEX", "CheckpointFiles", "shard_name"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
INDEX_MAX_BYTES = 64 << 20  # a key -> file map: a larger index is refused before it is read


def shard_name(i: int, n: int) -> str:
    """The name ``save_pretrained`` gives shard ``i`` (from 0) of ``n``."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class CheckpointFiles:
    """The safetensors files of one folder (``where``: the key -> file map); ``open(file)`` once each."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self._open: dict[str, object] = {}
        if self._file(INDEX):
            try:
                weight_map = read_listed_json(self.folder, INDEX, INDEX_MAX_BYTES, follow_links=True)["weight_map"]
                self.where = {str(k): str(v) for k, v in weight_map.items()}
            except UnsafeFile as error:
                raise CheckpointError(self.folder, str(error)) from None
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise CheckpointError(self.folder, f"file {INDEX}: not a safetensors index ({type(error).__name__}: {error})") from None
            bad = sorted({f for f in self.where.values() if not self._file(f, quiet=True)})
            if bad:
                raise CheckpointError(self.folder, f"file {INDEX}: names shard(s) {', '.join(bad)} that are not files in the folder")
        elif self._file(SINGLE):
            self.where = {key: SINGLE for key in self.open(SINGLE).keys()}
        else:
            raise CheckpointError(self.folder, f"holds neither {SINGLE} nor {INDEX} (not a safetensors checkpoint of transformers)")

    def _file(self, name: str, quiet: bool = False) -> bool:
        """Whether ``name`` is a plain name of a regular file of the folder (a link to one counts);
        something else by that name (a FIFO, a folder): a CheckpointError, or False with ``quiet``."""
        try:
            return listed_stat(self.folder, name, follow_links=True) is not None
        except UnsafeFile as error:
            if quiet:
                return False
            raise CheckpointError(self.folder, str(error)) from None

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
