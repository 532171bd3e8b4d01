"""The one line a demo prints when a rank fails: the rank, its error, the remedy; the tracebacks in a file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from twinpipe.launch import RankFailedError, failure_line, write_tracebacks

__all__ = ["failure_message"]


def failure_message(error: RankFailedError, timeout: float, rank_name=str) -> str:
    """``rank R: <error>; <remedy>; tracebacks in /tmp/twinpipe-demo-failure-PID.txt`` (the demos
    write no folder of their own, so the tracebacks go to the temporary directory)."""
    path = Path(tempfile.gettempdir()) / f"twinpipe-demo-failure-{os.getpid()}.txt"
    return failure_line(error, rank_name, timeout, write_tracebacks(error, path))
