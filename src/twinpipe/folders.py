"""The folder a command writes into, checked before any rank starts: a folder there (or one that
can be made) in which this user can create a file. Pure Python."""

from __future__ import annotations

import os
from pathlib import Path

from twinpipe.checks import bad

__all__ = ["writable_folder"]


def writable_folder(path, name: str) -> Path:
    """Make folder ``path`` (and its missing parents) and write and remove a probe file in it; a
    ValueError naming ``name`` and ``path`` when that fails, and then every folder made here is
    removed again."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise bad(name, str(path), "must be a folder; it is a file")
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".twinpipe-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        for p in made:
            try:
                p.rmdir()
            except OSError:
                pass
        raise bad(name, str(path), f"must be a folder this user can write to ({error.strerror or error})") from None
    return folder
