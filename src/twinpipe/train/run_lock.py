"""One ``twinpipe train`` run per output folder: a lock file in ``--out`` that names its holder.

The rule: the launching process takes the lock before any rank starts (under torchrun, the process
of global rank 0 alone, ``RANK=0``) and releases it when it exits. A second run with the same
``--out`` is refused, naming the first (host, process id, start time, command). The lock is an
``flock`` on ``.twinpipe-train.lock``, which the system drops when its holder dies however it
dies, so a run killed with SIGKILL leaves no lock behind, only its record, which the next run takes
over with a note. On a filesystem without ``flock`` the record alone decides: its holder is gone
when it ran on this host and no process has its id, or when it belongs to the same torchrun job
(``TORCHELASTIC_RUN_ID``: torchrun restarted every worker); a holder on another host is taken to run.
Pure Python.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path

from twinpipe.checks import bad
from twinpipe.folders import UnsafeFile, decode_json
from twinpipe.train.owners import gone, this_host

try:
    import fcntl
except ImportError:  # Windows: the record alone decides
    fcntl = None

__all__ = ["LOCK_FILE", "RunLock", "take_run_lock"]

LOCK_FILE = ".twinpipe-train.lock"
_RECORD_MAX_BYTES = 1 << 20


class RunLock:
    """The held lock of one run (``take_run_lock``); ``note``: what taking it over said, or None."""

    def __init__(self, path: Path, fd: int, note: str | None):
        self.path, self._fd, self.note = path, fd, note

    def release(self) -> None:
        """Remove the lock file (if it is still this lock's) and drop the lock; a second call does nothing."""
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _flock(fd: int) -> bool | None:
    """True: this process holds it now; False: another holds it; None: not possible here."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None  # ENOLCK, EOPNOTSUPP: a filesystem without flock


def _record(fd: int) -> dict | None:
    """The record in the lock file (None: empty, or not a record)."""
    data = os.pread(fd, _RECORD_MAX_BYTES, 0)
    try:
        record = decode_json(LOCK_FILE, data) if data else None
    except UnsafeFile:
        return None
    return record if isinstance(record, dict) else None


def _describe(record: dict | None) -> str:
    if record is None:
        return "a run whose lock file holds no record yet (it may be starting)"
    return (f"process {record.get('pid')} on host {record.get('host')}, started {record.get('started')}, "
            f"command {record.get('command')!r}")


def holder_gone(record: dict, run_id: str | None) -> bool:
    """Without ``flock``: whether the run that wrote ``record`` is certainly over (see the module's rule)."""
    if run_id and record.get("run_id") == run_id:
        return True
    pid = record.get("pid")
    return isinstance(pid, int) and isinstance(record.get("host"), str) and gone(record["host"], pid)


def take_run_lock(folder, option: str = "--out") -> RunLock:
    """Take the run lock of ``folder`` (which exists) for this process, or raise a ValueError naming
    ``option``, the folder and the run that holds it."""
    path = Path(folder) / LOCK_FILE
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or None
    for _ in range(5):  # again when the holder removed the file between our open and our lock
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as error:  # ELOOP: a symbolic link planted there
            raise bad(option, str(folder), f"its run lock {path} cannot be opened ({error.strerror or error}); "
                      "remove it if it is not a file twinpipe wrote") from None
        try:
            held, previous = _flock(fd), _record(fd)
            if held is False or (held is None and previous is not None and not holder_gone(previous, run_id)):
                raise bad(option, str(folder), f"is the folder of another twinpipe train run that is still running: "
                          f"{_describe(previous)} (its lock: {path}); wait for it to end or give another {option}")
            if not _same_file(fd, path):
                os.close(fd)
                continue
            note = None
            if previous is not None:
                note = (f"{option}={str(folder)!r}: took over the lock of an earlier run that ended without releasing it "
                        f"({_describe(previous)})")
            record = {"host": this_host(), "pid": os.getpid(), "run_id": run_id,
                      "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv)}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            return RunLock(path, fd, note)
        except BaseException:
            os.close(fd)
            raise
    raise bad(option, str(folder), f"its run lock {path} keeps changing: another run is starting or ending there; try again")
