"""twinpipe plan: how fast it answers, and how close its step time comes to a real CPU run's.

1. Speed: ``plan`` for a 64-layer dense model on 64 GPUs, 1024 micro-batches, every registered
   schedule at pipeline sizes 2..64 (and at 64 alone), median of --repeats; baseline measured in
   the same run: simulating the same (schedule, size) pairs whole at m=1024, for the sizes where
   that is affordable (16 and 32; the searching schedules are left out of both).
2. Accuracy: real runs on CPU (gloo, one thread per rank, MLP stages) on 2 and 4 ranks; each
   step's wall time (barrier to barrier) is measured. --steps untraced steps give the baseline;
   then --steps traced steps, each written as a trace.json, and the planner's step time from each
   file (the path `twinpipe plan --from-trace` takes) is compared with that step's own wall time
   (median and range of the ratios) and with the untraced steps' median.

    PYTHONPATH=src python bench/bench_plan.py
    PYTHONPATH=src python bench/bench_plan.py --skip-speed --ranks 2 --schedules 1f1b
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def _speed(repeats: int) -> None:
    from twinpipe.plan import Cluster, Model, plan
    from twinpipe.plan.predict import simulate_metrics
    from twinpipe.plan.costs import layout, stage_costs
    from twinpipe.schedule import registry

    model, cluster, m = Model(layers=64, hidden=4096, seq=4096), Cluster(gpus=64), 1024
    cases = {"pp 2..64": None, "pp 64 alone": [64], "pp 16,32": [16, 32]}
    print(f"plan speed: {model.layers} layers x {model.hidden}, {cluster.gpus} GPUs, m={m}, {len(registry.names())} schedules, "
          f"{os.cpu_count()} cores")
    for label, sizes in cases.items():
        medians = {}
        for workers in (None, 1):  # the default (a process per core when large) against one process
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                results = plan(model, cluster, m, sizes, workers=workers)
                times.append(time.perf_counter() - start)
            medians[workers] = statistics.median(times)
        skipped = sum(r.why.startswith("skipped") for r in results)
        approx = sum(bool(r.extrapolated_from and len(r.extrapolated_from) == 3) for r in results)
        print(f"  {label:12} median {medians[None]:6.2f} s (workers=1: {medians[1]:.2f} s, {medians[1] / medians[None]:.1f}x) "
              f"over {repeats}; {len(results)} predictions, {skipped} skipped, {approx} approximate")
    fast = [n for n in registry.names() if registry.get(n).max_pairs >= 2**17]
    whole, planned = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for p in (16, 32):
            costs = stage_costs(model, cluster, layout(model, cluster, p))[0]
            for name in fast:
                simulate_metrics(name, p, m, costs)
        whole.append(time.perf_counter() - start)
        start = time.perf_counter()
        plan(model, cluster, m, [16, 32], fast, workers=1)
        planned.append(time.perf_counter() - start)
    print(f"  baseline: simulating {len(fast)} schedules whole at pp 16 and 32, m={m}: median {statistics.median(whole):.2f} s; "
          f"plan on the same, one process: {statistics.median(planned):.2f} s ({statistics.median(whole) / statistics.median(planned):.1f}x faster)")


def _stage(hidden: int):
    import torch.nn as nn

    import twinpipe

    return twinpipe.defer_weight_grads(nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)))


def _worker(rank: int, world: int, args) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import twinpipe
    from twinpipe.schedule.registry import placement_for
    from twinpipe.trace import gather_timeline, write_chrome_trace

    out = {}
    for schedule in args.schedules.split(","):
        placement = placement_for(schedule, world)
        torch.manual_seed(rank)
        pipe = twinpipe.Pipeline([_stage(args.hidden) for _ in placement.stages_of(rank)], schedule)
        first = any(placement.is_first(s) for s in pipe.stages)
        last = any(placement.is_last(s) for s in pipe.stages)
        x, y = torch.randn(args.chunks * args.batch, args.hidden), torch.randn(args.chunks * args.batch, args.hidden)
        kwargs = {"criterion": lambda o, t: F.mse_loss(o, t), "labels": (y,)} if last else {}
        untraced, traced = [], []  # wall times; (wall time, trace path) of the traced steps
        for step in range(args.warmup + 2 * args.steps):
            tracing = step >= args.warmup + args.steps
            pipe.zero_grad()
            dist.barrier()
            start = time.perf_counter()
            pipe.step(*((x,) if first else ()), num_chunks=args.chunks, trace=tracing, **kwargs)
            dist.barrier()
            wall = time.perf_counter() - start
            if tracing:
                timeline = gather_timeline(pipe, args.chunks, name=schedule)
                path = None if timeline is None else str(write_chrome_trace(timeline, os.path.join(args.out, f"{schedule}-{world}-{step}.json")))
                traced.append((wall, path))
            elif step >= args.warmup:
                untraced.append(wall)
        out[schedule] = (untraced, traced)
    return out


def _run(world: int, args) -> dict:
    from twinpipe.launch import run_local

    return run_local(world, _worker, args, timeout=900)[0]


def _accuracy(args) -> None:
    from twinpipe.plan import Cluster, predict_one
    from twinpipe.plan.measured import load_traced

    print(f"plan vs a real CPU run: MLP stages {args.hidden}-{4 * args.hidden}-{args.hidden}, {args.chunks} micro-batches of "
          f"{args.batch} rows, gloo, 1 thread per rank, {os.cpu_count()} cores; {args.steps} untraced then {args.steps} traced steps "
          f"after {args.warmup} warm-up")
    for world in args.ranks:
        results = _run(world, args)
        for schedule, (untraced, traced) in results.items():
            ratios, predictions = [], []
            for wall, path in traced:
                costs = load_traced(path).costs_for(schedule, world)  # what `twinpipe plan --from-trace` reads
                predicted = predict_one(schedule, None, Cluster(gpus=world), world, args.chunks, costs=costs).step_time
                ratios.append(predicted / wall)
                predictions.append(predicted)
            base = statistics.median(untraced)
            print(f"  {schedule:10} {world} ranks: predicted / its traced step median {statistics.median(ratios):.3f}x "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} steps); median prediction "
                  f"{statistics.median(predictions) * 1e3:6.1f} ms / untraced steps' median {base * 1e3:6.1f} ms = "
                  f"{statistics.median(predictions) / base:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-run", action="store_true")
    parser.add_argument("--ranks", type=lambda t: [int(v) for v in t.split(",")], default=[2, 4])
    parser.add_argument("--schedules", default="1f1b,dualpipev")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    if not args.skip_speed:
        _speed(args.repeats)
    if not args.skip_run:
        with tempfile.TemporaryDirectory() as out:
            args.out = out
            _accuracy(args)


if __name__ == "__main__":
    main()
