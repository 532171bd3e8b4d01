"""Shared-memory pipes: bytes arrive intact and in order, across wrap-around and messages larger
than the ring, in both directions at once; a wait with nobody sending times out; TWINPIPE_HOST_ID
decides which ranks count as one host. One 2-rank world runs every case."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from distributed import run_named, run_world


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list]:
    """Each case's result on rank 0 and rank 1, from one world."""
    per_rank = run_world(2, _world)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def _world(rank, world):
    return run_named([("exchange", lambda: _exchange(rank, world)), ("bad_transport", lambda: _bad_transport(rank, world)),
                      ("setups_that_fail", lambda: _setups_that_fail(rank, world)), ("host_ids", lambda: _host_ids(rank))])


def _exchange(rank, world):
    from twinpipe.runtime.shm import shm_pipes

    group = dist.group.WORLD
    pipes = shm_pipes(group, rank, {0: 0, 1: 1}, {1 - rank}, torch.device("cpu"), capacity=1000)
    if pipes.peers() != {1 - rank}:
        return "no pipe was set up between two CPU ranks on one host"
    gen = torch.Generator().manual_seed(7)
    sizes = [0, 1, 7, 999, 1000, 1001, 5000, 3, 64 * 1024, 17]
    dtypes = [torch.float64, torch.uint8, torch.float32, torch.int64, torch.bool, torch.bfloat16]
    messages = {r: [] for r in (0, 1)}
    for r in (0, 1):
        for i, n in enumerate(sizes):
            dtype = dtypes[i % len(dtypes)]
            t = torch.randint(0, 200, (n,), generator=gen).to(dtype)
            messages[r].append(t)
    # Post every send and receive at once: the rings (1000 bytes) must stream them through.
    sends = [pipes.isend(t, 1 - rank) for t in messages[rank]]
    received = [torch.empty_like(t) for t in messages[1 - rank]]
    recvs = [pipes.irecv(b, 1 - rank) for b in received]
    for work in sends + recvs:
        work.wait(datetime.timedelta(seconds=30))
    for got, want in zip(received, messages[1 - rank]):
        if not torch.equal(got, want):
            return f"a {want.numel()}-element {want.dtype} message arrived changed"
    dist.barrier()
    # Nobody sends now: a receive must give up at its deadline.
    try:
        pipes.irecv(torch.empty(4), 1 - rank).wait(datetime.timedelta(seconds=0.5))
    except RuntimeError as exc:
        return "ok" if "timed out" in str(exc) else f"unexpected error: {exc}"
    return "a receive with no sender completed"


def test_pipes_stream_both_ways_and_time_out(outcomes):
    assert outcomes["exchange"] == ["ok", "ok"]


def test_unknown_transport_is_refused(outcomes):
    # A pipeline with an unknown transport is refused before any communication.
    assert outcomes["bad_transport"] == ["ok", "ok"]


def _bad_transport(rank, world):
    import twinpipe

    try:
        twinpipe.DualPipeV([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], transport="tcp")
    except ValueError as exc:
        return "ok" if "transport='tcp'" in str(exc) else str(exc)
    return "accepted"


def _setups_that_fail(rank, world):
    """Ranks that share a host id but not /dev/shm, then a /dev/shm that fills up: both fall back."""
    import errno
    import glob
    import os
    import tempfile

    import models
    import twinpipe
    from twinpipe.runtime import shm

    out = {}
    before = set(glob.glob("/dev/shm/twinpipe-*"))
    private = tempfile.mkdtemp()
    default_dir, fallocate = shm._SHM_DIR, os.posix_fallocate
    for name in ("separate_dirs", "full"):
        if name == "separate_dirs" and rank == 1:
            shm._SHM_DIR = private  # as a container with its own /dev/shm sees it
        if name == "full" and rank == 0:
            def no_space(fd, offset, length):
                raise OSError(errno.ENOSPC, "No space left on device")
            os.posix_fallocate = no_space
        try:
            pipe = twinpipe.Pipeline([models.MLPStage().double()], "1f1b", timeout=10)
            x = torch.randn(4, 3, models.HIDDEN, dtype=torch.float64)
            loss, _ = pipe.step(*((x,) if rank == 0 else ()), num_chunks=2, criterion=models.mse, labels=(x,) if rank else ())
            out[name] = (sorted(pipe.shared_memory_peers), rank == 0 or loss.shape == (2,))
        except Exception as exc:  # reported, so the test shows it
            out[name] = f"{type(exc).__name__}: {exc}"
        finally:
            shm._SHM_DIR, os.posix_fallocate = default_dir, fallocate
    dist.barrier()
    out["leftovers"] = sorted(set(glob.glob("/dev/shm/twinpipe-*")) - before) + os.listdir(private)
    return out


def test_failed_shared_memory_setup_falls_back_to_the_process_group(outcomes):
    for rank, out in enumerate(outcomes["setups_that_fail"]):
        assert out["separate_dirs"] == ([], True), (rank, out)
        assert out["full"] == ([], True), (rank, out)
        assert out["leftovers"] == [], (rank, out)


HOST_ID_CASES = {"unset": (None, None), "same": ("a", "a"), "different": ("a", "b"), "empty": ("", ""), "blank": (" ", " ")}


def _host_ids(rank):
    """Pipes and the agreement board under each TWINPIPE_HOST_ID setting (each on a fresh group: a
    board is made once per group)."""
    import os

    from twinpipe.runtime import board, shm

    out, before = {}, os.environ.get("TWINPIPE_HOST_ID")
    for name, values in HOST_ID_CASES.items():
        group = dist.new_group([0, 1])
        os.environ.pop("TWINPIPE_HOST_ID", None)
        if values[rank] is not None:
            os.environ["TWINPIPE_HOST_ID"] = values[rank]
        try:
            pipes = shm.shm_pipes(group, rank, {0: 0, 1: 1}, {1 - rank}, torch.device("cpu"), timeout=10, capacity=1000)
            shared = board.shared_board(group, rank, 2, timeout=10)
            out[name] = (sorted(pipes.peers()), shared is not None)
            pipes.close()
            board.release_board(shared)
        except ValueError as exc:
            out[name] = str(exc)
        finally:
            os.environ.pop("TWINPIPE_HOST_ID", None)
            if before is not None:
                os.environ["TWINPIPE_HOST_ID"] = before
    return out


def test_host_id_override_decides_which_ranks_share_memory(outcomes):
    # Two names on one machine: no pipe, no board, as on two machines; one name (or none): both.
    for rank, out in enumerate(outcomes["host_ids"]):
        assert out["unset"] == ([1 - rank], True), (rank, out)
        assert out["same"] == ([1 - rank], True), (rank, out)
        assert out["different"] == ([], False), (rank, out)


@pytest.mark.parametrize("name", ["empty", "blank"])
def test_empty_host_id_is_refused_naming_the_variable(outcomes, name):
    value = HOST_ID_CASES[name][0]
    for out in outcomes["host_ids"]:
        assert out[name] == f"TWINPIPE_HOST_ID={value!r}: must be a non-empty name (ranks with the same name may share memory), " \
                            "or unset (the host name and boot decide)", out
