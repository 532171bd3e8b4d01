"""Who made a file or folder that outlives a moment (a save's temporary folder, a run's lock), and
whether that process is certainly gone. Pure Python.

An owner is a host name and a process id. Only a process on this host can be checked: it is gone
when no process has its id (a recycled id looks alive: the owner is kept, never wrongly removed).
A process on another host cannot be checked from here; callers decide by age or by a run's id.
Hosts sharing a filesystem must have distinct host names.
"""

from __future__ import annotations

import os
import re
import socket

__all__ = ["this_host", "alive_here", "gone"]


def this_host() -> str:
    """This host's name, as owners record it (characters other than letters, digits, '.', '_', '-' as '_')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "localhost"


def alive_here(pid: int) -> bool:
    """Whether a process with id ``pid`` runs on this host (another user's counts)."""
    if pid <= 0:
        return False
    if os.name == "nt":  # os.kill(pid, 0) there would send CTRL_C_EVENT: assume it runs
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    except OSError:  # no way to ask (some platforms): assume it runs
        return True
    return True


def gone(host: str, pid: int) -> bool:
    """Whether the owner ``(host, pid)`` is certainly gone: on this host, and no process has its id."""
    return host == this_host() and not alive_here(pid)
