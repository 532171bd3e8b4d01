"""A safetensors file's header, read without its tensors: each key's dtype and shape, and the file
checked whole (the header's length, its JSON, every tensor's byte range inside the file).

The format: 8 bytes, the header's length N (little-endian), then N bytes of JSON
``{key: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}``, then the data;
offsets count from the end of the header. A file shorter than its header says is truncated (an
interrupted copy or download): found here from its size, no tensor read.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from types import MappingProxyType

from twinpipe.folders import UnsafeFile, open_listed

__all__ = ["TensorHeader", "DamagedFile", "read_header", "FLOATING", "HEADER_MAX_BYTES"]

HEADER_MAX_BYTES = 100 << 20  # safetensors' own limit on a header
# Bytes per element of each dtype the format names.
_ITEM_BYTES = MappingProxyType({"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8})
FLOATING = ("F64", "F32", "BF16", "F16", "F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class TensorHeader:
    dtype: str  # the format's name: "F32", "BF16", ...
    shape: tuple[int, ...]


class DamagedFile(ValueError):
    """A file that is not a whole safetensors file; the message names the file and what is wrong."""


def read_header(folder, name: str) -> dict[str, TensorHeader]:
    """The tensors of safetensors file ``name`` of ``folder`` by key, from its header alone;
    ``DamagedFile`` when the header is not one or the file is shorter than the header says."""
    try:
        with open_listed(folder, name, follow_links=True) as f:  # links followed: the hub's cache is made of them
            size = os.fstat(f.fileno()).st_size  # of the file opened, not of a name
            head = f.read(8)
            if len(head) < 8:
                raise DamagedFile(f"file {name}: {len(head)} bytes, shorter than a safetensors header's 8-byte length")
            length = int.from_bytes(head, "little")
            if length > HEADER_MAX_BYTES or 8 + length > size:
                raise DamagedFile(f"file {name}: its first 8 bytes give a header of {length} bytes, and the file has "
                                  f"{size - 8} after them: damaged or not safetensors")
            raw = f.read(length)
    except UnsafeFile as error:
        raise DamagedFile(str(error)) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise DamagedFile(f"file {name}: its header is not JSON: damaged or not safetensors") from None
    if not isinstance(header, dict):
        raise DamagedFile(f"file {name}: its header is {type(header).__name__}, not a JSON object")
    tensors, end = {}, 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        tensor, span = _entry(name, key, entry)
        tensors[key] = tensor
        end = max(end, span[1])
    if 8 + length + end > size:
        raise DamagedFile(f"file {name}: {size} bytes, and its header places tensor data up to byte {8 + length + end}: "
                          "truncated (an interrupted copy or download?)")
    return tensors


def _entry(name: str, key: str, entry) -> tuple[TensorHeader, tuple[int, int]]:
    """One header entry, its byte range checked against its dtype and shape."""
    try:
        dtype, shape, (start, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        start, end = int(start), int(end)
    except (KeyError, TypeError, ValueError):
        raise DamagedFile(f"file {name}: tensor {key!r}: not a safetensors entry (dtype, shape, data_offsets)") from None
    if dtype not in _ITEM_BYTES:
        raise DamagedFile(f"file {name}: tensor {key!r}: dtype {dtype!r}, not one safetensors names "
                          f"({', '.join(_ITEM_BYTES)})")
    need = math.prod(shape) * _ITEM_BYTES[dtype]
    if min(shape, default=0) < 0 or start < 0 or end - start != need:
        raise DamagedFile(f"file {name}: tensor {key!r}: data_offsets [{start}, {end}] for shape {list(shape)} "
                          f"of {dtype} ({need} bytes): damaged")
    return TensorHeader(dtype, shape), (start, end)
