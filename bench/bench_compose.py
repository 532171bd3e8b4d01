"""Zero bubble with activation checkpointing and torch.compile, on 2 CPU ranks.

1. Memory: for ZB-H1 and DualPipeV (and 1F1B, which does not defer W, for comparison), with and
   without activation checkpointing (non-reentrant),
   the executor's peak of live activation sets (``pipe.last_peak_live``) and the peak of bytes the
   step allocated beyond what it started with, measured by torch.profiler's CPU memory records
   (allocations through torch's CPU allocator, at op granularity), per rank.
2. Time: eager stages against ``torch.compile(stage)`` (inductor), same weights, same data. Timed
   blocks of BLOCK steps of the two alternate, so both see the same machine load; we report the
   median step time of each and the median of the paired ratios (compiled block over the eager
   block beside it). Compilation happens in untimed warm-up steps.

    python bench/bench_compose.py [--hidden 256] [--rows 64] [--steps 30 | 0 for memory only]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from twinpipe.launch import run_local

RANKS = 2
MICROBATCHES = 8
BLOCK = 3  # steps per timed block
SCHEDULES = ("zb-h1", "dualpipev")
MEMORY_SCHEDULES = ("1f1b", *SCHEDULES)  # 1F1B: the same pipeline without deferred W, for comparison


class Stage(nn.Module):
    """A transformer-style MLP block: LayerNorm, Linear(h, 4h), GELU, Linear(4h, h), residual."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def _stages(schedule: str, hidden: int, rank: int) -> list[nn.Module]:
    import twinpipe

    torch.manual_seed(0)
    count = 2 * RANKS if schedule == "dualpipev" else RANKS
    model = [twinpipe.defer_weight_grads(Stage(hidden)) for _ in range(count)]
    return [model[s] for s in twinpipe.stages_of_rank(schedule, RANKS, rank)]


def _pipeline(schedule: str, modules):
    import twinpipe

    if schedule == "dualpipev":
        return twinpipe.DualPipeV(modules)
    return twinpipe.Pipeline(modules, schedule)


def _step_args(pipe, x, y):
    """What this rank passes to step(): inputs on a first stage, criterion and labels on a last."""
    placement = pipe.schedule_for(MICROBATCHES).placement
    first = any(placement.is_first(s) for s in pipe.stages)
    last = any(placement.is_last(s) for s in pipe.stages)
    kwargs = {"num_chunks": MICROBATCHES}
    if last:
        kwargs.update(criterion=lambda out, label: F.mse_loss(out, label), labels=(y,))
    return ((x,) if first else ()), kwargs


def _peak_bytes(prof) -> int:
    """Peak of the running sum of bytes allocated minus freed, over the profiled region."""
    changes = []
    for e in prof.events():
        delta = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if delta:
            changes.append((e.time_range.start, delta))
    live = peak = 0
    for _, delta in sorted(changes):
        live += delta
        peak = max(peak, live)
    return peak


def _memory(schedule: str, ckpt: bool, hidden: int, x, y, rank: int) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    modules = [Checkpointed(m) if ckpt else m for m in _stages(schedule, hidden, rank)]
    pipe = _pipeline(schedule, modules)
    args, kwargs = _step_args(pipe, x, y)
    pipe.step(*args, **kwargs)  # warm-up: message layouts, .grad buffers
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pipe.step(*args, **kwargs)
    return pipe.last_peak_live, _peak_bytes(prof)


def _timing(schedule: str, hidden: int, x, y, rank: int, steps: int) -> dict[str, list[float]]:
    eager_modules = _stages(schedule, hidden, rank)
    compiled_modules = [torch.compile(copy.deepcopy(m)) for m in eager_modules]
    pipes = {"eager": _pipeline(schedule, eager_modules), "inductor": _pipeline(schedule, compiled_modules)}
    args = {name: _step_args(pipe, x, y) for name, pipe in pipes.items()}
    for name, pipe in pipes.items():  # untimed: compilation, layouts, .grad buffers
        for _ in range(3):
            pipe.step(*args[name][0], **args[name][1])
    times = {name: [] for name in pipes}
    for _ in range(steps // BLOCK):
        for name, pipe in pipes.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(BLOCK):
                pipe.step(*args[name][0], **args[name][1])
            times[name].append((time.perf_counter() - t0) / BLOCK)
    return times


def _worker(rank: int, world: int, args) -> tuple:
    torch.manual_seed(1)
    x = torch.randn(MICROBATCHES * args.rows, args.hidden)
    y = torch.randn_like(x)
    memory = {(s, c): _memory(s, c, args.hidden, x, y, rank) for s in MEMORY_SCHEDULES for c in (False, True)}
    timing = {s: _timing(s, args.hidden, x, y, rank, args.steps) for s in SCHEDULES} if args.steps >= BLOCK else {}
    return memory, timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256, help="model width h (default 256)")
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch (default 64)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (default 30; 0: memory only)")
    args = parser.parse_args()
    results = run_local(RANKS, _worker, args)  # [(memory, timing)] by rank

    act_mib = args.rows * args.hidden * 4 / 2**20
    print(f"{RANKS} CPU ranks, {MICROBATCHES} micro-batches of {args.rows} x {args.hidden} float32 "
          f"(one stage input: {act_mib:.3f} MiB), torch {torch.__version__}, {os.cpu_count()} cores")
    print("\nmemory per rank (peak live activation sets; peak MiB allocated during the step)")
    print(f"{'schedule':<10} {'checkpointing':<14} " + "  ".join(f"rank {r}: live   MiB" for r in range(RANKS)))
    for s in MEMORY_SCHEDULES:
        for c in (False, True):
            cells = "  ".join(f"{res[0][(s, c)][0]:>12} {res[0][(s, c)][1] / 2**20:>6.2f}" for res in results)
            print(f"{s:<10} {'non-reentrant' if c else 'off':<14} {cells}")
        ratios = [res[0][(s, True)][1] / res[0][(s, False)][1] for res in results]
        print(f"{'':<10} {'ratio':<14} " + "  ".join(f"{'':>12} {r:>6.2f}" for r in ratios))

    if not results[0][1]:
        return
    print(f"\nstep time, rank 0 (median of {args.steps // BLOCK} blocks of {BLOCK} steps; paired ratio = median of compiled/eager per pair)")
    for s in SCHEDULES:
        t = results[0][1][s]
        eager, compiled = statistics.median(t["eager"]), statistics.median(t["inductor"])
        paired = statistics.median(c / e for c, e in zip(t["inductor"], t["eager"]))
        print(f"{s:<10} eager {eager * 1e3:7.2f} ms   inductor {compiled * 1e3:7.2f} ms   compiled/eager {paired:.3f}")


if __name__ == "__main__":
    main()
