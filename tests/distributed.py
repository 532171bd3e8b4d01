"""Run a function on N gloo processes once, and hand back what each rank returned.

Test modules start one process group per module and run many cases inside it; each case's
outcome comes back as data so that pytest can report it as its own test.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, backend="gloo"):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report, never hang the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_world(world_size: int, fn, *args, timeout: float = 600.0, backend: str = "gloo", allow_deaths: bool = False) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the per-rank results.

    With ``allow_deaths``, a process that exits without reporting gives ``("died", exit code)``
    instead of failing the run (fault-injection tests kill ranks on purpose).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode is not None and queue.empty():
                        if not allow_deaths:
                            raise RuntimeError(f"rank {r} died (exit code {p.exitcode}) without reporting") from None
                        results[r] = ("died", p.exitcode)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the world did not finish within {timeout:g} s") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def run_cases(rank: int, world_size: int, cases: dict) -> dict:
    """Run named cases in one world; use as ``run_world(world, run_cases, cases)``.

    ``cases`` maps a name to ``(ranks, fn)``: ``fn(group)`` runs on the first ``ranks`` ranks, in a
    group of just those, after the same seed everywhere. An exception becomes the case's result as
    text, so one broken case fails its own test and not the whole module.
    """
    import torch
    import torch.distributed as dist

    results = {}
    for name, (ranks, fn) in cases.items():
        group = dist.new_group(list(range(ranks)))
        if rank < ranks:
            torch.manual_seed(0)
            try:
                results[name] = fn(group)
            except Exception as exc:
                results[name] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
    return results
