"""``twinpipe.launch.run_local``: every rank's value in rank order; a rank that fails or dies is
named at once, while its peers still wait in a collective, instead of a wait without end."""

from __future__ import annotations

import os

import pytest

from twinpipe.launch import run_local


def _sum_ranks(rank: int, world: int, offset: int):
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + offset])
    dist.all_reduce(total)
    return rank, world, int(total), torch.get_num_threads(), total


def _fail(rank: int, world: int, how: str) -> None:
    import torch.distributed as dist

    if rank == 1:
        if how == "raise":
            raise ValueError("rank one refuses")
        os._exit(3)
    if how == "die-alone":
        return None
    dist.barrier()  # rank 0 waits for rank 1 (gloo's default timeout: 30 minutes)


def test_values_come_back_in_rank_order_from_one_process_group():
    values = run_local(2, _sum_ranks, 10, threads=1, timeout=120)
    assert [v[:4] for v in values] == [(0, 2, 21, 1), (1, 2, 21, 1)]
    # Tensors come back by value, not as shared memory handed over a socket the rank may close
    # when it exits before the caller reads it ("Connection reset by peer" on a loaded machine).
    assert [v[4].tolist() for v in values] == [[21], [21]]
    assert not any(v[4].is_shared() for v in values)


@pytest.mark.parametrize("how,message", [("raise", "rank 1 failed:"), ("die", "rank 1 exited (code 3) without a result")])
def test_a_rank_that_fails_or_dies_is_named(how, message):
    with pytest.raises(RuntimeError) as info:
        run_local(2, _fail, how, timeout=120)
    assert message in str(info.value)
    if how == "raise":
        assert "ValueError: rank one refuses" in str(info.value)


def _start(rank: int, world: int, tensors=()) -> tuple:
    import sys

    sys.stdout.write(f"rank {rank} says hello\n")  # one write each: two ranks' lines may interleave, not their halves
    sys.stdout.flush()
    sys.stderr.write(f"rank {rank} warns\n")
    sys.stderr.flush()
    return os.getppid(), os.environ.get("TWINPIPE_LAUNCH_MARK"), int(sum(t.sum() for t in tensors))


def test_ranks_fork_from_one_server_with_torch_and_get_the_callers_environment_and_output_now(monkeypatch, capfd):
    # A rank starts from multiprocessing's fork server (torch imported there once), not as a fresh
    # interpreter that imports torch again: its parent is the server, the same for every call. The
    # server's environment and output are the caller's when it started: each rank gets the caller's
    # of now (here pytest's capture). 300 tensors as arguments: by value, not 300 shared-memory
    # file descriptors (a fork server takes at most a few hundred).
    import torch

    first = run_local(2, _start, timeout=120)
    monkeypatch.setenv("TWINPIPE_LAUNCH_MARK", "set after the server started")
    second = run_local(2, _start, [torch.ones(2) for _ in range(300)], timeout=120)
    servers = {ppid for ppid, _, _ in first + second}
    assert len(servers) == 1 and os.getpid() not in servers, (os.getpid(), servers)
    assert [mark for _, mark, _ in second] == ["set after the server started"] * 2
    assert [mark for _, mark, _ in first] == [None, None]
    assert [total for _, _, total in first + second] == [0, 0, 600, 600]
    out, err = capfd.readouterr()
    assert [out.count(f"rank {r} says hello") for r in range(2)] == [2, 2], out  # in any order
    assert [err.count(f"rank {r} warns") for r in range(2)] == [2, 2], err


def test_world_must_be_a_positive_int():
    with pytest.raises(ValueError, match="world=0"):
        run_local(0, _sum_ranks, 0)


def _late(rank: int, world: int) -> float | None:
    import time

    import torch.distributed as dist

    if rank == 0:
        time.sleep(5.0)  # alive, but not at the barrier: when it exits, the barrier fails anyway
        return None
    start = time.perf_counter()
    try:
        dist.barrier()
    except RuntimeError:
        pass
    return time.perf_counter() - start


def test_group_timeout_bounds_the_groups_own_collectives():
    waited = run_local(2, _late, timeout=120, group_timeout=1.0)[1]
    assert 0.9 < waited < 3.5  # its own timeout, not rank 0's exit


def test_allow_deaths_reports_a_dead_rank_and_keeps_the_others():
    assert run_local(2, _fail, "die-alone", timeout=120, allow_deaths=True) == [None, ("died", 3)]


def _second_is_the_cause(rank: int, world: int) -> None:
    import time

    from twinpipe.runtime.errors import PipelinePeerFailedError

    if rank == 0:  # heard first, but it only gave up because of rank 1
        raise PipelinePeerFailedError("step 0: stopped waiting, another rank failed: rank 1 refuses", "rank 1 refuses")
    time.sleep(0.3)
    raise ValueError("rank one refuses")


def test_the_rank_whose_failure_caused_the_others_is_named_not_the_first_heard():
    from twinpipe.launch import RankFailedError

    with pytest.raises(RankFailedError) as info:
        run_local(2, _second_is_the_cause, timeout=120)
    error = info.value
    assert (error.rank, error.kind, error.summary) == (1, "error", "ValueError: rank one refuses")
    assert list(error.tracebacks) == [1, 0] and "PipelinePeerFailedError" in error.tracebacks[0]


def test_exit_worker_flushes_what_was_printed_and_exits_with_the_code():
    import subprocess
    import sys

    script = ("import sys; from twinpipe.launch import exit_worker; print('said', end=''); "
              "sys.stderr.write('warned'); exit_worker(int(sys.argv[1]))")
    for code in (0, 3, 75):
        done = subprocess.run([sys.executable, "-c", script, str(code)], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout, done.stderr) == (code, "said", "warned")
