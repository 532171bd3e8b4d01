"""The arithmetic floor of bench_vs_torch.py: each rank's ops of one schedule replayed in one process.

No pipeline around them: no messages, no waits, no copies. What a rank receives is made up in
advance (random tensors of the right shape); what it sends is dropped. A real step cannot be
shorter than its busiest rank's replay, so this is the yardstick for the step times that
bench_vs_torch.py prints (same model, same micro-batches, one thread).

    python bench/bench_floor.py [--steps 10] [--hidden 512] [--schedule dualpipev]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import twinpipe
from bench_vs_torch import MICROBATCHES, RANKS, SCHEDULES, _loss, _stages
from twinpipe.runtime.executor import run_backward
from twinpipe.runtime.weight_grad import WeightGradStore
from twinpipe.schedule.ops import OpKind


def replay(name: str, rank: int, hidden: int, rows: int, steps: int) -> list[float]:
    """Seconds per step of ``rank``'s ops of schedule ``name``, run back to back ``steps`` times."""
    schedule = twinpipe.schedule.build(name, RANKS, MICROBATCHES)
    placement = schedule.placement
    stages, made = _stages(name, hidden, rank)
    defer = SCHEDULES[name][1]
    modules = dict(zip(stages, (twinpipe.defer_weight_grads(m) if defer else m for m in made)))
    made_up = {j: torch.randn(rows, hidden) for j in range(MICROBATCHES)}  # stands in for any message
    labels = {j: torch.randn(rows, hidden) for j in range(MICROBATCHES)}

    def local(stage) -> bool:
        return stage is not None and placement.rank_of(stage) == rank

    def one_step() -> None:
        acts, grads, saved = {}, {}, {}

        def forward(s, j):
            prev = placement.prev_stage(s)
            x = acts.pop((s, j)) if local(prev) else made_up[j].detach().requires_grad_(prev is not None)
            out = modules[s](x)
            loss = _loss(out, labels[j]) if placement.is_last(s) else None
            if local(placement.next_stage(s)):
                acts[(placement.next_stage(s), j)] = out.detach().requires_grad_()
            saved[(s, j)] = (x, out, loss)

        def backward(s, j, defer):
            x, out, loss = saved.pop((s, j))
            if loss is not None:
                root, grad = loss, torch.ones_like(loss)
            else:
                root, grad = out, grads.pop((s, j)) if local(placement.next_stage(s)) else made_up[j]
            WeightGradStore.enabled = defer
            run_backward([root], [grad])
            WeightGradStore.enabled = False
            if defer:
                WeightGradStore.flush((s, j))
            if local(placement.prev_stage(s)):
                grads[(placement.prev_stage(s), j)] = x.grad

        for op in schedule.ops[rank]:
            if op.kind is OpKind.F:
                forward(op.stage, op.microbatch)
            elif op.kind in (OpKind.B, OpKind.BW):
                backward(op.stage, op.microbatch, op.kind is OpKind.B)
            elif op.kind is OpKind.W:
                WeightGradStore.pop((op.stage, op.microbatch))
            else:
                forward(op.stage, op.microbatch)
                backward(op.backward.stage, op.backward.microbatch, False)
        for m in modules.values():
            m.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up
        one_step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", type=int, default=0, help="rows per micro-batch (default as bench_vs_torch.py)")
    parser.add_argument("--schedule", default="dualpipev", choices=sorted(SCHEDULES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = args.rows or (32 if args.hidden < 128 else 256)
    print(f"{args.schedule} ops of each rank replayed in one process (hidden {args.hidden}, {rows} rows/micro-batch, "
          f"{MICROBATCHES} micro-batches, 1 thread), {args.steps} steps")
    for rank in range(RANKS):
        times = replay(args.schedule, rank, args.hidden, rows, args.steps)
        print(f"rank {rank}: median {statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
