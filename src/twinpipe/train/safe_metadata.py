"""Reading a ``torch.distributed.checkpoint`` folder without running code from it.

DCP stores its ``.metadata`` as a pickle and reads it with ``pickle.load``, and reads non-tensor
items with ``torch.load(weights_only=False)``: a crafted folder runs any code it likes. Here the
metadata is read by an unpickler that builds only the classes DCP writes there (an allow-list,
checked against torch 2.13's ``FileSystemWriter``), the result is checked to be metadata of that
shape, and the planner refuses non-tensor items. Tensor data is read by DCP itself, with torch's
``weights_only`` unpickler.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
)

from twinpipe.folders import UnsafeFile, plain_name, read_listed

__all__ = ["MetadataError", "load_metadata", "SafeFileSystemReader", "TensorsOnlyLoadPlanner", "METADATA_MAX_BYTES"]

METADATA_MAX_BYTES = 256 << 20  # DCP's index of every tensor chunk: a larger .metadata is refused before it is read

_METADATA = "torch.distributed.checkpoint.metadata"
# Every global FileSystemWriter's pickle of ``Metadata`` refers to (torch 2.13), and nothing else.
ALLOWED = frozenset({
    (_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                   "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided")
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})


_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class MetadataError(ValueError):
    """The ``.metadata`` file is not DCP metadata of the kind twinpipe writes (the message says why)."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise MetadataError(f"it refers to {module}.{name}, which checkpoint metadata never holds "
                            "(a crafted file: refused, nothing in it was run)")

    def persistent_load(self, pid):
        raise MetadataError("it refers to persistent objects, which checkpoint metadata never holds (refused)")


def load_metadata(data: bytes) -> Metadata:
    """``Metadata`` from the bytes of a ``.metadata`` file, building only allowed classes, then checked."""
    try:
        metadata = _AllowListUnpickler(io.BytesIO(data)).load()
    except MetadataError:
        raise
    except Exception as error:  # truncated or damaged: pickle raises many kinds
        raise MetadataError(f"not readable as checkpoint metadata ({type(error).__name__}: {error})") from None
    _check(metadata)
    return metadata


def _check(metadata) -> None:
    def fail(what: str):
        raise MetadataError(f"not checkpoint metadata of the expected shape ({what})")

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        fail(f"a {type(metadata).__name__}, not a Metadata")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            fail(f"key {key!r}")
        if isinstance(item, BytesStorageMetadata):
            raise MetadataError(f"item {key!r} is a pickled object; twinpipe's checkpoints hold none, and reading one would "
                                "run code from the file (refused)")
        if not (isinstance(item, TensorStorageMetadata) and isinstance(item.properties, TensorProperties)
                and isinstance(item.properties.dtype, torch.dtype) and isinstance(item.size, torch.Size)
                and isinstance(item.chunks, list) and all(isinstance(c, ChunkStorageMetadata) for c in item.chunks)):
            fail(f"item {key!r}")
    if not isinstance(metadata.storage_data, dict):
        fail("storage_data")
    for index, info in metadata.storage_data.items():
        if not (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo) and isinstance(info.relative_path, str)
                and isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0 and info.length >= 0):
            fail(f"storage entry {index!r}")
        if not plain_name(info.relative_path):
            fail(f"storage entry {index.fqn!r} points outside the folder: {info.relative_path!r}")
        if info.transform_descriptors:  # DCP's experimental stream extensions: twinpipe writes none
            fail(f"storage entry {index.fqn!r} asks for stream transforms {info.transform_descriptors!r}")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        fail("storage_meta")


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose ``read_metadata`` uses the allow-list (``load_metadata``)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata, which twinpipe never writes
            raise MetadataError("twinpipe checkpoints have no per-rank metadata")
        try:
            data = read_listed(self.path, ".metadata", METADATA_MAX_BYTES)  # a regular file, not a link, bounded
        except UnsafeFile as error:
            raise MetadataError(str(error)) from None
        metadata = load_metadata(data)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, refusing non-tensor items (DCP reads them with ``torch.load(weights_only=False)``)."""

    def load_bytes(self, read_item, value) -> None:
        raise MetadataError(f"item {read_item.dest_index.fqn!r} is a pickled object; refused (it could run code)")
