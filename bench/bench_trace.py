"""Measured vs predicted bubble rate of a real CPU run (gloo, one thread per rank).

Runs ``--schedule`` (default dualpipev) on ``--ranks`` processes with MLP stages of width
``--hidden``, traces ``--steps`` steps after a warm-up, gathers each into a measured Timeline,
reads per-stage op times (and the message latency) off it, simulates the same schedule with those
costs, and prints both bubble rates. With --out, writes the last step's report there
(trace.json for Perfetto, measured.png, predicted.png, compare.png).

    PYTHONPATH=src python bench/bench_trace.py
    PYTHONPATH=src python bench/bench_trace.py --schedule 1f1b --chunks 16 --out /tmp/trace
"""

from __future__ import annotations

import argparse
import statistics

from twinpipe.launch import run_local


def _stage(hidden: int):
    import torch.nn as nn

    import twinpipe

    return twinpipe.defer_weight_grads(nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)))


def _worker(rank: int, world: int, args) -> list | None:
    import torch
    import torch.nn.functional as F

    import twinpipe
    from twinpipe.schedule.registry import placement_for
    from twinpipe.trace import compare_numbers, estimate_costs, gather_timeline, predict, write_run_report

    placement = placement_for(args.schedule, args.ranks)
    torch.manual_seed(rank)
    pipe = twinpipe.Pipeline([_stage(args.hidden) for _ in placement.stages_of(rank)], args.schedule)
    first = any(placement.is_first(s) for s in pipe.stages)
    last = any(placement.is_last(s) for s in pipe.stages)
    rows = args.chunks * args.batch
    x, y = torch.randn(rows, args.hidden), torch.randn(rows, args.hidden)
    kwargs = {"criterion": lambda out, label: F.mse_loss(out, label), "labels": (y,)} if last else {}
    results = []
    for step in range(args.warmup + args.steps):
        traced = step >= args.warmup
        pipe.zero_grad()
        pipe.step(*((x,) if first else ()), num_chunks=args.chunks, trace=traced, **kwargs)
        if traced:
            timeline = gather_timeline(pipe, args.chunks)
            if timeline is not None:
                schedule = pipe.schedule_for(args.chunks)
                if args.out and step == args.warmup + args.steps - 1:
                    results.append(write_run_report(args.out, timeline, schedule))
                else:
                    costs = estimate_costs(timeline)
                    results.append(compare_numbers(timeline, predict(timeline, schedule, costs), costs))
    return results if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="dualpipev")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="traced steps")
    parser.add_argument("--out", default=None, help="write the last step's report (trace.json, PNGs) here")
    args = parser.parse_args()

    results = run_local(args.ranks, _worker, args, timeout=600)[0]

    print(f"{args.schedule}: {args.ranks} ranks x 1 thread, {args.chunks} micro-batches of {args.batch} x {args.hidden}, gloo on CPU")
    print(f"{'step':>4} {'measured bubble':>16} {'predicted':>10} {'measured makespan':>18} {'predicted':>10} {'waits':>6} {'overhead':>9} {'T_comm':>8}")
    for i, r in enumerate(results):
        print(f"{i:>4} {r['measured_bubble_rate']:>16.1%} {r['predicted_bubble_rate']:>10.1%} "
              f"{r['measured_makespan_s'] * 1e3:>15.2f} ms {r['predicted_makespan_s'] * 1e3:>7.2f} ms "
              f"{r['measured_wait_share']:>6.1%} {r['measured_overhead']:>9.1%} {r['costs']['t_comm'] * 1e6:>5.0f} us")
    med = lambda key: statistics.median(r[key] for r in results)  # noqa: E731
    print(f"median: measured bubble {med('measured_bubble_rate'):.1%}, predicted {med('predicted_bubble_rate'):.1%}; "
          f"makespan {med('measured_makespan_s') * 1e3:.2f} ms measured, {med('predicted_makespan_s') * 1e3:.2f} ms predicted; "
          f"clock alignment error <= {max(r['clock_error_s'] for r in results) * 1e6:.0f} us")
    costs = results[-1]["costs"]
    print("last step's per-stage means (ms): " + ", ".join(
        f"{k[2:].upper()} [{', '.join(f'{v * 1e3:.2f}' for v in costs[k])}]" for k in ("t_f", "t_b", "t_w", "t_fb") if costs[k] is not None))
    if args.out:
        print(f"report: {results[-1]['files']}")


if __name__ == "__main__":
    main()
