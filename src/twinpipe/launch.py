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
import re
import signal
import socket
import threading
import time
import traceback
from pathlib import Path

from twinpipe.checks import DEFAULT_TIMEOUT, check_int, checked_timeout

__all__ = ["free_port", "run_local", "init_torchrun_group", "exit_worker", "RankFailedError", "StartupSignals", "failure_line",
           "write_tracebacks"]

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


class RankFailedError(RuntimeError):
    """A rank of ``run_local`` failed (``kind`` "timeout", "peer" or "error") or died ("died").

    ``summary``: its error in one line (``Type: message``); ``first``: with "peer", the account of
    the rank whose failure made this one give up; ``tracebacks``: the failed ranks' tracebacks by
    rank. ``str()`` is the summary line followed by the tracebacks, as before this class."""

    def __init__(self, rank: int, kind: str, summary: str, first: str = "", tracebacks: dict | None = None,
                 dead: tuple = ()):
        self.rank, self.kind, self.summary, self.first = rank, kind, summary, first
        self.tracebacks, self.dead = dict(tracebacks or {}), tuple(dead)
        text = f"rank {rank} " + (summary if kind == "died" else "failed")
        notes = [f"rank {r} exited (code {code}) without a result" for r, code in self.dead]
        super().__init__(text + "".join(f"; {n}" for n in notes) + "".join(f":\n{t}" for t in self.tracebacks.values()))

    @classmethod
    def caught(cls, rank: int, exc: BaseException) -> "RankFailedError":
        """The error of ``rank`` that raised ``exc`` in this process (call it in the ``except`` block:
        a torchrun worker reporting its own failure)."""
        kind, summary, first = _account(exc)
        return cls(rank, kind, summary, first, {rank: traceback.format_exc()})


def _account(exc: BaseException) -> tuple[str, str, str]:
    """(kind, one-line summary, first failure) of a rank's exception, read where its type is known."""
    from twinpipe.runtime.errors import PipelinePeerFailedError, PipelineTimeoutError

    summary = " ".join(f"{type(exc).__name__}: {exc}".split())
    if isinstance(exc, PipelinePeerFailedError):
        return "peer", summary, " ".join(exc.first.split())
    timed_out = isinstance(exc, (PipelineTimeoutError, TimeoutError)) or re.search(r"timed out|timeout", str(exc), re.I) is not None
    return ("timeout" if timed_out else "error"), summary, ""


def failure_line(error: RankFailedError, rank_name, timeout: float | None, traceback_file=None) -> str:
    """What went wrong, in one line: the rank (``rank_name(global rank)``), its error and the remedy
    (for a wait that ran out of time, a longer ``--timeout``; for one that gave up because another
    rank failed, that rank's own failure). ``traceback_file``: where the full tracebacks are."""
    where = f"rank {rank_name(error.rank)}"
    if error.kind == "timeout":
        remedy = (f"if the ranks are only slow (a loaded machine), raise --timeout (now {timeout:g} s)" if timeout
                  else "raise --timeout if the ranks are only slow")
    elif error.kind == "peer":
        remedy = "fix the first failure it quotes"
    elif error.kind == "died":
        remedy = "it was killed or crashed (out of memory? a signal?)"
    else:
        remedy = ""
    more = f"tracebacks in {traceback_file}" if traceback_file else ""
    tail = "; ".join(part for part in (remedy, more) if part)
    return f"{where}: {error.summary}" + (f"; {tail}" if tail else "")


def _as_caller(environ: dict, outputs: tuple) -> None:
    """This rank with the caller's environment and standard output and error of the call, not the
    fork server's from when it started."""
    os.environ.clear()
    os.environ.update(environ)
    for fd, target in zip(outputs, (1, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


class StartupSignals:
    """A rank's SIGTERM handler from its first line until the run installs its own
    (``twinpipe.train.stopping.StopOnSignals``, which takes over what it heard): it only notes when
    the signal came, so that a signal while the rank starts up is not lost, nor kills the rank."""

    def __init__(self):
        self.heard: dict[int, float] = {}  # signal -> time.monotonic() of its first arrival

    def __call__(self, signum, frame) -> None:
        self.heard.setdefault(signum, time.monotonic())


def _rank_main(rank: int, world: int, port: int, call: bytes, results, backend: str, threads: int | None,
               group_timeout: float | None, environ: dict, outputs: tuple, forwarded: bool = False) -> None:
    if forwarded:  # first: a SIGTERM passed on while this rank imports and joins the group is noted, not fatal
        signal.signal(signal.SIGTERM, StartupSignals())
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
    except BaseException as exc:  # reported to the parent, which would otherwise wait for this rank
        results.put((rank, (traceback.format_exc(), _account(exc)), None))
        # Alive until the parent ends every rank: rank 0 holds the group's store, and peers still
        # running would otherwise find it gone and print torch's stack dumps, not their own error.
        time.sleep(_LINGER)
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


def init_torchrun_group(backend: str, timeout: float = DEFAULT_TIMEOUT) -> None:
    """The default process group of a rank torchrun started (from its environment), ``timeout``
    seconds its limit: the one way twinpipe's commands and examples make it. Its keys go under a
    prefix per restart (``TORCHELASTIC_RESTART_COUNT``):
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


def exit_worker(code: int | None) -> None:
    """End a worker process now with ``code``, its output flushed, without the interpreter's teardown.

    A worker torchrun started ends as a plain Python program does, and then C++ threads of
    process groups that something still references can outlive the objects they use while the
    process tears down: one two-host run in about 40 aborted there, after its work was done
    ("terminate called without an active exception", SIGABRT), and torchrun counts that as a
    failed rank. The ranks ``run_local`` starts end this way already (multiprocessing's children
    leave through ``os._exit``). Call it last: after the process group is destroyed and every
    file written."""
    import logging
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more can be said there
            pass
    logging.shutdown()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


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
    what a signal means (``twinpipe train``: save and stop). Until ``fn`` installs its handler, a rank
    only notes a SIGTERM (``StartupSignals``, which ``train.stopping.StopOnSignals`` takes over): an
    ``fn`` that installs none never ends on one."""
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
    try:
        _wait_for_results(values, procs, results, forwarder, timeout=timeout, allow_deaths=allow_deaths)
    finally:
        forwarder.uninstall()
        grace = 30.0 if len(values) == world else 0.0  # after a failure: ended at once (the error is in hand)
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world)]


def _wait_for_results(values: dict, procs, results, forwarder: _Forwarder, *, timeout: float | None,
                      allow_deaths: bool) -> None:
    """Fill ``values`` (rank -> result) from the ``results`` queue until every rank of ``procs`` has
    given one, passing signals on meanwhile; raises ``RankFailedError`` for a rank that failed (or
    died, unless ``allow_deaths``: then ``("died", exit code)``), ``TimeoutError`` after ``timeout`` s."""
    world = len(procs)
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(values) < world:
        forwarder.pass_on()
        try:
            rank, error, value = results.get(timeout=0.2 if forwarder.active else 1.0)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and _ended(p)]
            if dead and results.empty():
                if not allow_deaths:
                    code = procs[dead[0]].exitcode
                    raise RankFailedError(dead[0], "died", f"exited (code {code}) without a result") from None
                values.update((r, ("died", procs[r].exitcode)) for r in dead)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(values))} of {world} did not finish "
                                   f"within {timeout:g} s") from None
            continue
        if error is not None:
            raise _failure(rank, error, results, procs, values) from None
        values[rank] = pickle.loads(value)


_SETTLE = 1.0  # seconds to wait for the root cause when the first error heard only quotes it
_LINGER = 10.0  # seconds a failed rank stays alive for the parent to end it


def _failure(rank: int, error: tuple, results, procs, values: dict) -> RankFailedError:
    """The error ``run_local`` raises when ``rank`` reported ``error``, naming the rank whose failure
    caused the others: when ``error`` is a rank giving up because another failed ("peer"), the
    others' reports are heard for up to ``_SETTLE`` s (which also lets a rank still cleaning up after
    the failure, such as removing its unfinished checkpoint folder, finish before the caller ends
    every rank); a rank that died is named too (a likely cause)."""
    reports, finished = {rank: error}, set(values)
    deadline = time.monotonic() + _SETTLE
    while time.monotonic() < deadline:
        if all(r in reports or r in finished or _ended(p) for r, p in enumerate(procs)):
            break
        try:
            other, other_error, _ = results.get(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
        except queue_module.Empty:
            continue
        if other_error is not None:
            reports[other] = other_error
        else:
            finished.add(other)
    cause = next((r for r, (_, (kind, _, _)) in reports.items() if kind != "peer"), rank)
    kind, summary, first = reports[cause][1]
    dead = tuple((r, p.exitcode) for r, p in enumerate(procs) if r not in reports and r not in values and _ended(p))
    tracebacks = {r: reports[r][0] for r in sorted(reports, key=lambda r: r != cause)}
    return RankFailedError(cause, kind, summary, first, tracebacks, dead)


def write_tracebacks(error: RankFailedError, path) -> str | None:
    """The failed ranks' tracebacks written to ``path`` (the cause's first); its name, or None when
    there are none or the file cannot be written (the one-line message then says so by omission)."""
    if not error.tracebacks:
        return None
    text = "".join(f"--- rank {rank}\n{trace}\n" for rank, trace in error.tracebacks.items())
    try:
        with open(path, "w") as file:
            file.write(text)
    except OSError:
        return None
    return str(path)
