"""A shared-memory notice board: the step agreement's all-gather when every rank is on one host.

Through gloo, the per-step all-gather of claims costs a few hundred microseconds (its worker thread
must be scheduled, on every rank); on one host, each rank instead writes its claim into its own
slot of a small shared file and reads everyone else's. Slots are double-buffered by round parity:
a rank writes round k+2 only after reading every rank's round k+1, which each rank wrote only
after it was done with round k, so no slot is overwritten while someone may still read it.

One board serves every pipeline on a process group (claims name their pipeline), so two
pipelines stepped in a different order on two ranks still meet, and disagree clearly.
"""

from __future__ import annotations

import mmap
import os
import time

import torch

from twinpipe.runtime import shm, waits
from twinpipe.runtime.collectives import FRAME_BYTES, gather_objects
from twinpipe.runtime.errors import PipelineMismatchError, PipelineTimeoutError

__all__ = ["SharedBoard", "shared_board", "release_board"]

_HEADER = 64  # per slot: round number (int64) and frame length (int64), on their own cache line


class SharedBoard:
    """This rank's view of one group's board: ``post`` a frame for the next round, ``collect`` all."""

    def __init__(self, path: str, size: int, rank: int, create: bool):
        self.size, self.rank, self.round = size, rank, 0
        self.group = None  # the process group it serves (set by shared_board)
        self.users = 0  # pipelines using it (shared_board / release_board)
        slot = _HEADER + FRAME_BYTES
        nbytes = 2 * size * slot
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, nbytes)  # zero-filled: no round posted yet
            self._map = mmap.mmap(fd, nbytes)
        except OSError:
            if create:
                shm._unlink(path)
            raise
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._map, dtype=torch.uint8).view(2, size, slot)
        self._frames = raw[:, :, _HEADER:]
        headers = raw[:, :, :_HEADER]
        # Per (parity, rank): its round number and frame length, as int64 views made once.
        self._header_words = [[headers[p, r].view(torch.int64) for r in range(size)] for p in range(2)]

    def close(self) -> None:
        """Unmap the board (its file was unlinked when every rank had mapped it)."""
        self._frames = self._header_words = None  # the views first: a mapping with views cannot close
        try:
            self._map.close()
        except BufferError:
            pass

    def _words(self, parity: int, rank: int) -> torch.Tensor:
        return self._header_words[parity][rank]

    def post(self, data: bytes) -> int:
        """Write this rank's frame for the next round; returns the round number."""
        self.round += 1
        parity = self.round % 2
        self._frames[parity, self.rank, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        words = self._words(parity, self.rank)
        words[1] = len(data)
        words[0] = self.round  # published last: x86-64 keeps stores in order (see shm.py)
        return self.round

    def arrived(self, round_: int) -> bool:
        """Whether every rank has posted ``round_`` (does not wait)."""
        parity = round_ % 2
        return all(int(self._words(parity, r)[0]) == round_ for r in range(self.size))

    def collect(self, round_: int, timeout: float, what: str) -> list[bytes]:
        """Every rank's frame of ``round_``, in group-rank order, or PipelineTimeoutError
        (PipelinePeerFailedError when a failure notice of the pipeline's groups is out)."""
        parity, deadline = round_ % 2, time.monotonic() + timeout
        frames: list[bytes | None] = [None] * self.size

        def missing() -> list[int]:
            for r in range(self.size):
                if frames[r] is None:
                    words = self._words(parity, r)
                    if int(words[0]) == round_:
                        frame = self._frames[parity, r, : int(words[1])].numpy().tobytes()
                        if int(words[0]) != round_:  # overwritten while read: that rank is rounds ahead
                            raise PipelineMismatchError(f"{what}: group rank {r} is more than one step ahead of this rank")
                        frames[r] = frame
            return [r for r, f in enumerate(frames) if f is None]

        if not waits.poll(lambda: not missing(), deadline, lambda: f"{what} (group rank(s) {missing()})", self.group):
            raise PipelineTimeoutError(f"{what}: group rank(s) {missing()} did not start this step within {timeout:g} s")
        return frames


_BOARDS: dict = {}  # process group -> its board (None: the group's ranks cannot share one)


def shared_board(group, rank: int, size: int, timeout: float) -> SharedBoard | None:
    """The board of ``group`` (made on first use; collective then), or None when its ranks are not
    all on one host with usable shared memory: the agreement then goes through the group."""
    if size < 2:
        return None
    if group in _BOARDS:
        board = _BOARDS[group]
        if board is not None:
            board.users += 1
        return board
    what = f"group rank {rank}: setting up the agreement board"
    ok = shm._eligible(torch.device("cpu"), 2 * size * (_HEADER + FRAME_BYTES))
    everyone = gather_objects(group, (shm.host_id(), ok, os.urandom(8).hex()), timeout, what)
    if not all(e[1] for e in everyone) or len({e[0] for e in everyone}) != 1:
        _BOARDS[group] = None
        return None
    path = os.path.join(shm._SHM_DIR, f"twinpipe-board-{min(e[2] for e in everyone)}")
    board, failed = None, False
    try:
        if rank == 0:
            try:
                board = SharedBoard(path, size, rank, create=True)
            except OSError:
                failed = True
        failed = any(gather_objects(group, failed, timeout, what))
        if not failed and rank != 0:
            try:
                board = SharedBoard(path, size, rank, create=False)
            except OSError:
                failed = True
        failed = any(gather_objects(group, failed, timeout, what))
    finally:
        shm._unlink(path)  # every rank has mapped it, or never will
    if failed and board is not None:
        board.close()
    _BOARDS[group] = None if failed else board
    if board is not None and not failed:
        board.group, board.users = group, 1
    return _BOARDS[group]


def release_board(board: SharedBoard | None) -> None:
    """A pipeline is done with ``board``: the last one to release it unmaps it. Every rank of the
    group must release it alike (as it made it): a board made again is a new file."""
    if board is None:
        return
    board.users -= 1
    if board.users <= 0:
        _BOARDS.pop(board.group, None)
        board.close()
