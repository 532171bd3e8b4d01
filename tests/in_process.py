"""Run a ``twinpipe`` command in this process: ``twinpipe.cli.main``, the function the console script
calls, in a given folder, with everything it and its ranks write caught.

Its ranks are fresh processes either way; what this saves is a second interpreter importing torch (and
transformers) before it starts them, some seconds of CPU a run on CI's 2 cores.
tests/test_documented_commands.py runs the installed script itself.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

__all__ = ["run_in_process"]


def run_in_process(argv: list[str], cwd) -> subprocess.CompletedProcess:
    """``twinpipe ARGV`` in ``cwd``: its exit code and everything it and its ranks wrote (text)."""
    from twinpipe.cli import main

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, _in_folder(cwd):
        with _descriptors_to(out, err), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(["twinpipe", *argv], code, out.read(), err.read())


@contextlib.contextmanager
def _in_folder(folder):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def _descriptors_to(out, err):
    """File descriptors 1 and 2 to ``out`` and ``err`` (the ranks inherit them), then back."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    try:
        yield
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
