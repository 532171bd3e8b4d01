"""Run a function on N gloo processes once, and hand back what each rank returned.

Test modules start one process group per module and run many cases inside it; each case's
outcome comes back as data so that pytest can report it as its own test.
"""

from __future__ import annotations

from twinpipe.launch import run_local


def run_world(world_size: int, fn, *args, timeout: float = 600.0, backend: str = "gloo", allow_deaths: bool = False) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the per-rank results.

    ``twinpipe.launch.run_local`` with one torch thread per rank and a deadline for the whole world
    (TimeoutError after ``timeout`` s). A rank that fails or dies fails the run (RuntimeError with
    its traceback); with ``allow_deaths``, a process that exits without reporting gives
    ``("died", exit code)`` instead (fault-injection tests kill ranks on purpose).
    """
    return run_local(world_size, fn, *args, timeout=timeout, threads=1, backend=backend, allow_deaths=allow_deaths)


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


def run_named(named) -> dict:
    """Run ``(name, fn)`` pairs in order on this rank, a barrier after each: ``{name: fn()}``, an
    exception becoming ``[its text]`` (a list of problems), so one broken case fails its own test."""
    import torch.distributed as dist

    results = {}
    for name, fn in named:
        try:
            results[name] = fn()
        except Exception as exc:
            results[name] = [f"{type(exc).__name__}: {exc}"]
        dist.barrier()
    return results
