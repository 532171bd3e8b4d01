"""Run a command the way a user types it: a shell line, in a given folder, with ``python`` being
this interpreter and the installed console scripts (``twinpipe``, torch's ``torchrun``) on PATH.

No torchrun variables are inherited (a test run under torchrun must not turn the command into a
rank of it). A command that outlives its limit is killed with everything it started.

``run_typed_once`` runs a line in a fresh folder once per test session: a command that two test
modules check (the documented commands and the examples) starts its processes once, and each module
checks the same output.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

__all__ = ["run_typed", "run_typed_once", "typed_env"]

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
_env: dict[str, str] | None = None
_ROOT = Path(__file__).resolve().parents[1]
_once: dict[tuple[str, tuple[str, ...]], tuple[subprocess.CompletedProcess, Path]] = {}
_once_locks: dict[tuple[str, tuple[str, ...]], threading.Lock] = {}
_locks_lock = threading.Lock()


def typed_env() -> dict[str, str]:
    """The environment of a user's shell after ``pip install -e .`` with this interpreter."""
    global _env
    if _env is None:
        shim = Path(tempfile.mkdtemp(prefix="twinpipe-typed-"))
        atexit.register(shutil.rmtree, shim, True)
        # A script, not a symlink: a virtual environment's interpreter finds its pyvenv.cfg only by its own path.
        (shim / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (shim / "python").chmod(0o755)
        path = [str(shim), sysconfig.get_path("scripts"), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
        env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARIABLES}
        env["PATH"] = os.pathsep.join(path)
        for script in ("twinpipe", "torchrun"):
            assert shutil.which(script, path=env["PATH"]), (
                f"the console script {script!r} is not on PATH next to {sys.executable}: install the package "
                "(pip install -e .) before running these tests")
        _env = env
    return dict(_env)


def run_typed(command: str, cwd, timeout: float) -> subprocess.CompletedProcess:
    """``command`` run by bash in ``cwd``; its exit code and output (text). An AssertionError with the
    output so far when it runs longer than ``timeout`` seconds."""
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=typed_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the ranks it started go too
        out, err = proc.communicate()
        raise AssertionError(f"`{command}` did not finish within {timeout:g} s\n--- stdout\n{out}\n--- stderr\n{err}") from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def run_typed_once(command: str, copy: tuple[str, ...] = (), timeout: float = 300) -> tuple[subprocess.CompletedProcess, Path]:
    """``run_typed(command)`` in a fresh folder holding copies of the repository's folders ``copy``, and
    that folder, run once per session: a later call with the same command and folders gets the same
    result and folder (a command that failed or timed out runs again). The folders go when the session ends."""
    key = (command, tuple(sorted(copy)))
    with _locks_lock:
        lock = _once_locks.setdefault(key, threading.Lock())
    with lock:  # one run per key, even from the documented commands' threads; other keys run meanwhile
        if key not in _once:
            folder = Path(tempfile.mkdtemp(prefix="twinpipe-once-"))
            atexit.register(shutil.rmtree, folder, True)
            for name in key[1]:
                shutil.copytree(_ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
            done = run_typed(command, folder, timeout=timeout)
            if done.returncode != 0:
                return done, folder
            _once[key] = done, folder
        return _once[key]
