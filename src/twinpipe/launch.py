"""Run one function as N ranks of a process group on this host: how the demos, the bench
scripts, ``twinpipe train`` and the multi-process tests start their ranks when torchrun does not.

Each rank is a process forked from multiprocessing's fork server (which imported torch once;
spawned where there is none) that joins the group, runs ``fn(rank, world, *args)`` with the
caller's environment, standard output and error of the call, and sends back what it returned;
the caller gets every rank's value in rank order, or an error naming the rank that failed, died
or ran out of time, never a wait without end. torch is imported only when ranks start, so
importing this module stays cheap for ``--help``.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import signal
import socket
import threading
import time
import traceback
from pathlib import Path

from twinpipe.checks import check_int, checked_timeout

__all__ = ["free_port", "run_local", "init_torchrun_group"]

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port that is free on this host now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class _Fd:
    """A file descriptor of the caller, handed to a rank as the rank starts (``multiprocessing.reduction.DupFd``)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup) -> int:
    return dup.detach()


def _as_caller(environ: dict, outputs: tuple) -> None:
    """This rank with the caller's environment and standard output and error of the call, not the
    fork server's from when it started."""
    os.environ.clear()
    os.environ.update(environ)
    for fd, target in zip(outputs, (1, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _rank_main(rank: int, world: int, port: int, call: bytes, results, backend: str, threads: int | None,
               group_timeout: float | None, environ: dict, outputs: tuple, forwarded: bool = False) -> None:
    _as_caller(environ, outputs)
    if forwarded:  # a terminal's Ctrl-C reaches every process of its group: this rank hears it from the caller, once
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    import datetime

    import torch
    import torch.distributed as dist

    if threads is not None:
        torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = None if group_timeout is None else datetime.timedelta(seconds=group_timeout)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        # Pickled here, by value: a queue would hand tensors over as shared memory through a socket
        # this process closes when it exits, possibly before the caller reads them.
        fn, args = pickle.loads(call)
        results.put((rank, None, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # reported to the parent, which would otherwise wait for this rank
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context(mp):
    """Where ranks start: forked from multiprocessing's fork server, which imported torch once (a
    rank then starts in milliseconds, not the second or two of a fresh interpreter importing torch);
    spawned where there is no fork server (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])  # no-op once the server runs
    return ctx


def _ended(proc) -> bool:
    """Whether a rank's process has ended. Its exit code comes through the fork server, which reports
    255 for every rank once it is gone itself (a scheduler's SIGTERM to every process of the job ends
    it), while the ranks may still be finishing: then the process itself is asked."""
    if proc.exitcode is None:
        return False
    if proc.exitcode != 255 or proc.pid is None:
        return True
    try:
        os.kill(proc.pid, 0)  # no signal sent: whether the process exists
    except (ProcessLookupError, PermissionError):  # gone (or its pid reused by another user's process)
        return True
    try:  # a zombie has ended too (its new parent has not reaped it yet)
        return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):  # no /proc here, or it went meanwhile
        return not Path("/proc").is_dir()


class _Forwarder:
    """While the ranks run: SIGTERM or SIGINT to the caller is passed to every live rank as SIGTERM
    (the handler only counts; the caller's wait loop passes them on)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, procs, active: bool):
        self.procs, self.active, self.pending, self._previous = procs, active, 0, {}

    def install(self) -> None:
        if self.active and threading.current_thread() is threading.main_thread():  # elsewhere Python cannot install handlers
            self._previous = {s: signal.signal(s, self._count) for s in self.SIGNALS}

    def _count(self, signum, frame) -> None:
        self.pending += 1

    def pass_on(self) -> None:
        while self.pending:
            self.pending -= 1
            for p in self.procs:
                if p.pid is not None and p.exitcode is None:
                    try:
                        os.kill(p.pid, signal.SIGTERM)
                    except ProcessLookupError:  # it ended meanwhile
                        pass

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def init_torchrun_group(backend: str, timeout: float) -> None:
    """The default process group of a rank torchrun started (from its environment), ``timeout``
    seconds its limit. Its keys go under a prefix per restart (``TORCHELASTIC_RESTART_COUNT``):
    torch 2.13's agent keeps one store across ``--max-restarts`` restarts, and without it the
    restarted ranks' gloo met the previous attempt's addresses ("Connection refused", then
    "Gloo connectFullMesh failed")."""
    import datetime

    import torch.distributed as dist

    limit = datetime.timedelta(seconds=checked_timeout(timeout, "timeout"))
    store, rank, world = next(dist.rendezvous("env://", timeout=limit))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"twinpipe-attempt-{attempt}", store), rank=rank,
                            world_size=world, timeout=limit)


def run_local(world: int, fn, *args, timeout: float | None = None, threads: int | None = 1,
              backend: str = "gloo", group_timeout: float | None = None, allow_deaths: bool = False,
              forward_signals: bool = False) -> list:
    """``[fn(rank, world, *args) for rank in range(world)]``, each rank in its own process, all in
    one process group (``backend``; with ``"nccl"`` rank r uses GPU r % count). ``fn`` must be a
    module-level function and its arguments and result picklable (tensors go and come back by value); ``threads``: torch threads per
    rank (None: torch's default); ``group_timeout``: the process group's own timeout in seconds
    (None: torch's default). Raises RuntimeError with a rank's traceback if it fails or dies,
    TimeoutError when not every rank returned within ``timeout`` seconds (None: no limit). With
    ``allow_deaths`` a rank that exits without a result gives ``("died", exit code)`` instead of
    an error, and the others go on (for runs that kill ranks on purpose). With ``forward_signals``, a
    SIGTERM or SIGINT to the caller reaches every rank as SIGTERM (ranks ignore SIGINT: a terminal's
    Ctrl-C comes through here, once) and the caller keeps waiting for the ranks: their handlers decide
    what a signal means (``twinpipe train``: save and stop)."""
    check_int(world, "world", low=1, why="processes")
    import torch.multiprocessing as mp

    if group_timeout is not None:
        group_timeout = checked_timeout(group_timeout, "group_timeout")

    ctx = _context(mp)
    results = ctx.Queue()
    port = free_port()
    # (fn, args) pickled here, by value: as a process's arguments, torch would hand tensors over as
    # shared memory, one file descriptor each, and a fork server takes at most a few hundred.
    call = pickle.dumps((fn, args))
    environ, outputs = dict(os.environ), (_Fd(1), _Fd(2))
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, call, results, backend, threads, group_timeout, environ, outputs,
                                                  forward_signals))
             for r in range(world)]
    forwarder = _Forwarder(procs, forward_signals)
    for p in procs:
        p.start()
    forwarder.install()
    values: dict[int, object] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while len(values) < world:
            forwarder.pass_on()
            try:
                rank, error, value = results.get(timeout=0.2 if forward_signals else 1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and _ended(p)]
                if dead and results.empty():
                    if not allow_deaths:
                        raise RuntimeError(f"rank {dead[0]} exited (code {procs[dead[0]].exitcode}) without a result") from None
                    values.update((r, ("died", procs[r].exitcode)) for r in dead)
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world)) - set(values))} of {world} did not finish "
                                       f"within {timeout:g} s") from None
                continue
            if error is not None:  # a rank that died first is the likelier cause: name it too
                dead = [f"rank {r} exited (code {p.exitcode}) without a result" for r, p in enumerate(procs)
                        if r != rank and r not in values and _ended(p)]
                raise RuntimeError(f"rank {rank} failed{'; ' + '; '.join(dead) if dead else ''}:\n{error}")
            values[rank] = pickle.loads(value)
    finally:
        forwarder.uninstall()
        grace = 30.0 if len(values) == world else 1.0  # after a failure the others may wait on it
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world)]
