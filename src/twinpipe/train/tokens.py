"""Token files for training: a flat array of token ids, memory-mapped, or text tokenized here.

Formats (``open_tokens``):

- ``.npy``: a 1-D integer array (``np.load(mmap_mode="r")``), any integer dtype;
- ``.bin``: raw little-endian token ids with no header, nanoGPT's ``train.bin`` (``uint16``) and the
  token stream of a Megatron ``.bin``/``.idx`` pair. The dtype is ``dtype=`` (``uint16`` or
  ``uint32``), or read from a Megatron ``.idx`` file beside it (same name, ``.idx``: its header's
  dtype code; the document boundaries it lists are not used: the ``.bin`` is read as one stream).
  With neither, an error: read with the wrong width, the ids would be wrong and nothing would say so;
- text: a ``.txt`` file, a folder (its ``*.txt`` files, sorted by path) or a glob pattern, tokenized
  with a ``transformers`` tokenizer (``tokenize_text``), files joined by the tokenizer's
  end-of-sequence token when it has one. Text is held in memory; large corpora belong in ``.npy``.

``token_range`` scans a memory-mapped array in chunks of ``CHUNK`` ids, so a file of gigabytes is read
once, never copied whole into the process's memory (the mapped pages are the system's file cache). Numpy only (no torch at import): the command line checks a file
before any rank starts.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from types import MappingProxyType

import numpy as np

__all__ = ["BIN_DTYPES", "CHUNK", "MEGATRON_DTYPES", "open_tokens", "text_files", "tokenize_text", "token_range", "is_text"]

BIN_DTYPES = ("uint16", "uint32")
CHUNK = 1 << 24  # ids per chunk of token_range's scan (16 Mi ids: 32 or 64 MiB)
# Megatron's MMapIndexedDataset .idx header: 9 magic bytes, version (<Q, 1), dtype code (<B).
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = MappingProxyType({1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"})  # its integer codes


def is_text(path: str) -> bool:
    """Whether ``path`` names text (a ``.txt`` file, a folder or a glob pattern), not a token array."""
    p = Path(path)
    return p.suffix.lower() == ".txt" or p.is_dir() or glob.has_magic(path)


def open_tokens(path: str, dtype: str | None = None, *, name: str = "path", dtype_name: str = "dtype") -> np.ndarray:
    """The ids of a ``.npy`` or ``.bin`` file as a read-only 1-D memory map (ValueError naming ``name``
    or ``dtype_name``, the names the caller's user typed)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{name}={path!r}: no such file")
    if p.stat().st_size == 0:
        raise ValueError(f"{name}={path!r}: the file is empty")
    suffix = p.suffix.lower()
    if suffix == ".npy":
        if dtype is not None:
            raise ValueError(f"{dtype_name}={dtype!r}: only for .bin files (a .npy file records its dtype)")
        try:
            tokens = np.load(p, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as error:
            raise ValueError(f"{name}={path!r}: not a readable .npy array ({error})") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{name}={path!r}: must hold a 1-D array of integer token ids; it holds a "
                             f"{tokens.ndim}-D array of {tokens.dtype}")
    elif suffix == ".bin":
        dtype = _bin_dtype(p, dtype, name, dtype_name)
        width = np.dtype(dtype).itemsize
        if p.stat().st_size % width:
            raise ValueError(f"{name}={path!r}: {p.stat().st_size} bytes is not a whole number of {dtype} ids "
                             f"({width} bytes each); is {dtype_name} right?")
        tokens = np.memmap(p, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    else:
        raise ValueError(f"{name}={path!r}: must be a .npy or .bin file of token ids, or text (.txt, a folder, a glob)")
    if tokens.size == 0:
        raise ValueError(f"{name}={path!r}: holds no tokens")
    return tokens


def _bin_dtype(path: Path, dtype: str | None, name: str, dtype_name: str) -> str:
    """The width of a ``.bin`` file's ids: ``dtype``, or its Megatron ``.idx``'s (they must agree)."""
    if dtype is not None and dtype not in BIN_DTYPES:
        raise ValueError(f"{dtype_name}={dtype!r}: must be one of {', '.join(BIN_DTYPES)}")
    idx = path.with_suffix(".idx")
    recorded = None
    if idx.is_file():
        with open(idx, "rb") as f:
            head = f.read(len(MEGATRON_MAGIC) + 9)
        if head[: len(MEGATRON_MAGIC)] != MEGATRON_MAGIC or len(head) < len(MEGATRON_MAGIC) + 9:
            raise ValueError(f"{name}={str(path)!r}: {idx} is not a Megatron index (.idx) file; move it away or "
                             f"give {dtype_name} for the raw .bin")
        code = head[-1]
        recorded = MEGATRON_DTYPES.get(code)
        if recorded is None:
            raise ValueError(f"{name}={str(path)!r}: {idx} records dtype code {code}, not an integer token dtype "
                             f"({', '.join(f'{c}: {d}' for c, d in MEGATRON_DTYPES.items())})")
    if dtype is None and recorded is None:
        raise ValueError(f"{name}={str(path)!r}: a .bin file has no header: give {dtype_name} ({' or '.join(BIN_DTYPES)}; "
                         "nanoGPT writes uint16) or put its Megatron .idx beside it")
    if dtype is not None and recorded is not None and dtype != recorded:
        raise ValueError(f"{dtype_name}={dtype!r}: {idx} says the ids are {recorded}")
    return dtype or recorded


def token_range(tokens: np.ndarray, chunk: int = CHUNK) -> tuple[int, int]:
    """The smallest and largest id, scanning ``chunk`` ids at a time (memory: one chunk)."""
    low, high = None, None
    for start in range(0, tokens.size, chunk):
        part = np.asarray(tokens[start : start + chunk])
        a, b = int(part.min()), int(part.max())
        low = a if low is None else min(low, a)
        high = b if high is None else max(high, b)
    return low, high


def text_files(spec: str, *, name: str = "path") -> list[Path]:
    """The text files ``spec`` names: a file, a folder's ``*.txt`` (recursively, sorted) or a glob (sorted)."""
    p = Path(spec)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.txt") if f.is_file())
        where = f"no .txt files in the folder {spec}"
    elif glob.has_magic(spec):
        files = sorted(Path(f) for f in glob.glob(spec, recursive=True) if os.path.isfile(f))
        where = "the pattern matches no files"
    else:
        files = [p] if p.is_file() else []
        where = "no such file"
    if not files:
        raise ValueError(f"{name}={spec!r}: {where}")
    return files


def tokenize_text(spec: str, tokenizer, *, name: str = "path") -> np.ndarray:
    """The files of ``spec`` tokenized with ``tokenizer`` (a ``transformers`` tokenizer), one after
    another, each followed by the end-of-sequence token when the tokenizer has one; int64 ids."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for f in text_files(spec, name=name):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"{name}={spec!r}: cannot read {f} as UTF-8 text ({error})") from None
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids.append(int(eos))
    tokens = np.asarray(ids, dtype=np.int64)
    if tokens.size == 0:
        raise ValueError(f"{name}={spec!r}: the text holds no tokens")
    return tokens
