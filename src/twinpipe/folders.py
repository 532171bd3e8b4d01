"""Folders a command is given, checked. Pure Python.

``writable_folder``: the folder a command writes into, checked before any rank starts (a folder
there, or one that can be made, in which this user can create a file).

``open_listed`` / ``read_listed`` / ``read_listed_json``: the one way to read a file that a folder's
own index names (a checkpoint's completion marker, a safetensors index): the name must be a plain
file name of that folder (not absolute, no folder part, not ``..``), the file a regular file (never
a FIFO, which would block the reader, nor a device), not a symbolic link unless the caller allows
links, and no larger than the caller's bound, checked before anything is read. A refusal is an
``UnsafeFile`` (a ValueError) naming the file and the reason.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from twinpipe.checks import bad

__all__ = ["writable_folder", "UnsafeFile", "plain_name", "listed_stat", "open_listed", "read_listed", "read_listed_json",
           "decode_json"]

# Opening never follows a link swapped in after the check, and a FIFO opens without waiting for a writer.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


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


class UnsafeFile(ValueError):
    """A file named by a folder's index that is not read: the message says which and why."""


def plain_name(name) -> bool:
    """Whether ``name`` names a file directly in a folder: a string, not absolute, no folder part, not ``.``/``..``."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
            and "/" not in name and "\\" not in name and Path(name).name == name)


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _checked_stat(name: str, st: os.stat_result, limit: int | None) -> os.stat_result:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFile(f"file {name}: is a symbolic link; refused (only the folder's own files are read)")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"file {name}: is {_kind(st.st_mode)}, not a regular file; refused")
    if limit is not None and st.st_size > limit:
        raise UnsafeFile(f"file {name}: {st.st_size} bytes, more than the {_size(limit)} such a file may hold; refused "
                         "(damaged or crafted)")
    return st


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def _name(name) -> str:
    if not plain_name(name):
        raise UnsafeFile(f"{name!r} is not a file of the folder (absolute, with a folder part, or '..'); refused")
    return name


def listed_stat(folder, name, *, follow_links: bool = False, limit: int | None = None) -> os.stat_result | None:
    """The checked ``stat`` of file ``name`` of ``folder`` (see the module's rules); None when it does not exist."""
    name = _name(name)
    try:
        st = (os.stat if follow_links else os.lstat)(Path(folder) / name)
    except FileNotFoundError:
        return None
    return _checked_stat(name, st, limit)


def open_listed(folder, name, *, follow_links: bool = False, limit: int | None = None):
    """File ``name`` of ``folder`` opened for reading in binary (see the module's rules); the checks
    are made on the opened file itself, so nothing swapped in between is read."""
    name = _name(name)
    flags = os.O_RDONLY | _NONBLOCK | (0 if follow_links else _NOFOLLOW) | getattr(os, "O_BINARY", 0)
    if not follow_links:
        listed_stat(folder, name)  # where O_NOFOLLOW is missing, a link is still named as one
    try:
        fd = os.open(Path(folder) / name, flags)
    except FileNotFoundError:
        raise UnsafeFile(f"file {name}: missing") from None
    except OSError as error:  # ELOOP: a link swapped in after the check
        raise UnsafeFile(f"file {name}: cannot be opened ({error.strerror or error}); refused") from None
    try:
        _checked_stat(name, os.fstat(fd), limit)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_listed(folder, name, limit: int, *, follow_links: bool = False) -> bytes:
    """The bytes of file ``name`` of ``folder``, at most ``limit`` of them (the size is checked first)."""
    with open_listed(folder, name, follow_links=follow_links, limit=limit) as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew while being read
        raise UnsafeFile(f"file {name}: more than the {_size(limit)} such a file may hold; refused (damaged or crafted)")
    return data


def read_listed_json(folder, name, limit: int, *, follow_links: bool = False):
    """File ``name`` of ``folder`` as JSON (``read_listed``); damaged, nested too deeply or not UTF-8:
    an ``UnsafeFile`` naming it."""
    return decode_json(name, read_listed(folder, name, limit, follow_links=follow_links))


def decode_json(name: str, data: bytes):
    """``data`` (the bytes of file ``name``) as JSON; damaged, nested too deeply or not UTF-8: an ``UnsafeFile``."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UnsafeFile(f"file {name}: not readable JSON ({type(error).__name__}: {error}): damaged") from None
