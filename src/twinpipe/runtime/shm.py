"""Same-host CPU messages through shared memory: one byte pipe per ordered pair of neighbour ranks.

On one machine, gloo carries every CPU message through TCP loopback, and each send or receive call
costs tens to hundreds of microseconds once the cores are busy. Like NCCL's SHM transport, we put
a single-producer single-consumer ring buffer in shared memory for each ordered pair of ranks on
the same host: the sender copies bytes in, the receiver copies them out, and order is kept because
a pipe is a FIFO byte stream (messages are consecutive byte ranges; both sides know their sizes).

Head (bytes written) and tail (bytes read) are 8-byte words each written by one side only. The
payload is copied before the head is published; on x86-64 stores become visible in program order,
so a reader that sees the head sees the bytes. Other architectures use the process group.
"""

from __future__ import annotations

import math
import mmap
import os
import platform
import socket
import time
import uuid
from collections import deque

import torch

from twinpipe.checks import DEFAULT_TIMEOUT, bad
from twinpipe.runtime import waits
from twinpipe.runtime.collectives import gather_objects

__all__ = ["HOST_ID_VARIABLE", "ShmPipes", "host_id", "shm_pipes"]

_HEAD, _TAIL = 0, 8  # int64 indices: head at byte 0, tail at byte 64 (separate cache lines)
_CONTROL = 128  # bytes before the ring


class _Work:
    """A send or receive in flight on a pipe; ``wait`` moves every pipe of this rank along."""

    __slots__ = ("pipes", "data", "offset", "done")

    def __init__(self, pipes: ShmPipes, data: torch.Tensor):
        self.pipes, self.data, self.offset = pipes, data, 0
        self.done = data.numel() == 0

    def is_completed(self) -> bool:
        if not self.done:
            self.pipes.progress()
        return self.done

    def wait(self, timeout=None) -> bool:
        deadline = math.inf if timeout is None else time.monotonic() + timeout.total_seconds()
        if not waits.poll(self.is_completed, deadline, "shared-memory transfer", self.pipes.group):
            raise RuntimeError("shared-memory transfer timed out")
        return True


class _Pipe:
    """A byte ring in a shared file mapping; this rank is either its writer or its reader."""

    def __init__(self, path: str, capacity: int, create: bool):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                # Reserve the pages now: writing to a mapping of a full tmpfs would kill the
                # process (SIGBUS), a failed reservation only raises.
                os.posix_fallocate(fd, 0, _CONTROL + capacity)  # zero-filled: head = tail = 0
            self._map = mmap.mmap(fd, _CONTROL + capacity)
        except OSError:
            if create:
                _unlink(path)
            raise
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._control = raw[:_CONTROL].view(torch.int64)
        self._ring = raw[_CONTROL:]
        self.capacity, self.writer = capacity, create  # the sender creates its outgoing pipe
        self.position = 0  # bytes this side has written (writer) or read (reader)
        self.queue: deque[_Work] = deque()

    def close(self) -> None:
        self.queue.clear()
        del self._control, self._ring  # the views first: a mapping with views on it cannot close
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view: the mapping goes when it does
            pass

    def _copy(self, work: _Work, n: int, writing: bool) -> None:
        at = self.position % self.capacity
        first = min(n, self.capacity - at)
        pieces = [(at, work.offset, first)]
        if n > first:  # wrap around the end of the ring
            pieces.append((0, work.offset + first, n - first))
        for ring_at, data_at, size in pieces:
            ring = self._ring[ring_at : ring_at + size]
            data = work.data[data_at : data_at + size]
            (ring if writing else data).copy_(data if writing else ring)

    def move(self) -> None:
        """Writer: copy queued sends in as far as there is room, then publish the new head.
        Reader: copy arrived bytes out into posted receives, then publish the new tail."""
        while self.queue:
            work = self.queue[0]
            if self.writer:
                ready = self.capacity - (self.position - int(self._control[_TAIL]))
            else:
                ready = int(self._control[_HEAD]) - self.position
            n = min(ready, work.data.numel() - work.offset)
            if n <= 0:
                return
            self._copy(work, n, writing=self.writer)
            self.position += n
            self._control[_HEAD if self.writer else _TAIL] = self.position
            work.offset += n
            if work.offset == work.data.numel():
                work.done = True
                self.queue.popleft()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class ShmPipes:
    """This rank's pipes to and from its same-host neighbours (keyed by pipeline rank)."""

    def __init__(self, outgoing: dict[int, _Pipe], incoming: dict[int, _Pipe], group=None):
        self.outgoing, self.incoming = outgoing, incoming
        self.group = group  # whose failure notices end a wait (see waits.py)
        self._all = [*outgoing.values(), *incoming.values()]

    def peers(self) -> set[int]:
        return set(self.outgoing)

    def isend(self, tensor: torch.Tensor, peer: int) -> _Work:
        return self._enqueue(self.outgoing[peer], tensor)

    def irecv(self, tensor: torch.Tensor, peer: int) -> _Work:
        return self._enqueue(self.incoming[peer], tensor)

    def _enqueue(self, pipe: _Pipe, tensor: torch.Tensor) -> _Work:
        work = _Work(self, _bytes(tensor))
        if not work.done:
            pipe.queue.append(work)
            pipe.move()
        return work

    def progress(self) -> None:
        for pipe in self._all:
            if pipe.queue:
                pipe.move()

    def close(self) -> None:
        """Unmap every pipe (the files were unlinked at setup: the memory goes with the last map)."""
        for pipe in self._all:
            pipe.close()
        self.outgoing, self.incoming, self._all = {}, {}, []


_SHM_DIR = "/dev/shm"


HOST_ID_VARIABLE = "TWINPIPE_HOST_ID"


def host_id() -> str:
    """Which host this rank is on: ranks share memory only with ranks of the same identity.

    ``$TWINPIPE_HOST_ID`` overrides it (an empty value is refused): give two groups of ranks on one
    machine different values and they talk only through the process group, as two machines do.
    Otherwise the host name and boot (a name alone may repeat across containers).
    """
    override = os.environ.get(HOST_ID_VARIABLE)
    if override is not None:
        if not override.strip():
            raise bad(HOST_ID_VARIABLE, override, "must be a non-empty name (ranks with the same name may share memory), "
                      "or unset (the host name and boot decide)")
        return f"set:{override}"  # never a host name's form (a host name has no colon)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _eligible(device: torch.device, needed: int) -> bool:
    if device.type != "cpu" or platform.machine().lower() not in ("x86_64", "amd64") or not os.path.isdir(_SHM_DIR):
        return False
    stats = os.statvfs(_SHM_DIR)
    return stats.f_bavail * stats.f_frsize >= 4 * needed  # leave room for everyone else


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def shm_pipes(group, rank: int, group_rank_of: dict[int, int], neighbours: set[int], device: torch.device,
              timeout: float = DEFAULT_TIMEOUT, capacity: int = 4 << 20) -> ShmPipes:
    """Set up pipes to the same-host ``neighbours`` (pipeline ranks). Collective over ``group``.

    Every rank learns every rank's host and eligibility, so both ends of a pair agree on whether
    they try a pipe. A pair whose files cannot be created or opened (a full /dev/shm, or ranks that
    share a host name and boot but not /dev/shm, as containers with host networking do) falls back
    to the process group, on both ends. Files are unlinked as soon as both ends have mapped them,
    and whatever happens (a failure, a peer dying), before this returns or raises.
    """
    needed = len(neighbours) * (_CONTROL + capacity)
    info = (rank, host_id(), _eligible(device, needed), sorted(neighbours), uuid.uuid4().hex)
    what = f"rank {rank}: setting up shared-memory pipes"
    everyone = gather_objects(group, info, timeout, what)
    by_rank = {r: (host, ok, set(nb)) for r, host, ok, nb, _ in everyone}
    token = min(everyone)[4]  # the same on every rank

    def shared(a: int, b: int) -> bool:
        return by_rank[a][1] and by_rank[b][1] and by_rank[a][0] == by_rank[b][0] and b in by_rank[a][2]

    def path(src: int, dst: int) -> str:
        return os.path.join(_SHM_DIR, f"twinpipe-{token}-{src}-{dst}")

    peers = [p for p in sorted(neighbours) if p != rank and shared(rank, p) and shared(p, rank)]
    if not any(shared(a, b) for a in by_rank for b in by_rank if a != b):
        return ShmPipes({}, {}, group)
    outgoing, incoming, failed = {}, {}, set()
    try:
        for p in peers:
            try:
                outgoing[p] = _Pipe(path(rank, p), capacity, create=True)
            except OSError:
                failed.add(p)
        failed = _agree_on_failures(group, rank, failed, timeout, what)
        for p in peers:
            if p not in failed:
                try:
                    incoming[p] = _Pipe(path(p, rank), capacity, create=False)
                except OSError:
                    failed.add(p)
        failed = _agree_on_failures(group, rank, failed, timeout, what)
    finally:  # both ends are mapped (or never will be): the memory lives until both unmap
        for p in peers:
            _unlink(path(rank, p))
            _unlink(path(p, rank))
    usable = [p for p in peers if p not in failed]
    for p in failed:  # mapped on one end only: unmap it
        for pipe in (outgoing.pop(p, None), incoming.pop(p, None)):
            if pipe is not None:
                pipe.close()
    return ShmPipes({p: outgoing[p] for p in usable}, {p: incoming[p] for p in usable}, group)


def _agree_on_failures(group, rank: int, failed: set[int], timeout: float, what: str) -> set[int]:
    """Peers this rank must not use a pipe with: its own failures and those its peers report."""
    reports = gather_objects(group, (rank, sorted(failed)), timeout, what)
    return set(failed) | {r for r, theirs in reports if rank in theirs}
