"""twinpipe against PyTorch's ``torch.distributed.pipelining``: every schedule both libraries have,
on the same model and the same micro-batches.

GPipe, 1F1B, interleaved 1F1B, ZB-V and DualPipeV on 2 CPU ranks (gloo process group, one thread
each), each stage Linear-tanh-Linear, 8 micro-batches. twinpipe uses its default transport, which
sends messages between CPU ranks on one host through shared memory (``--transport process-group``
makes it use gloo for them too); PyTorch sends them with gloo. For every schedule, timed blocks of
BLOCK back-to-back steps of the two libraries alternate, so both see the same machine load; we report
the median step time of each and the median of the paired ratios (each twinpipe block over the torch
block beside it), which cancels the slow drift of a shared machine. The baseline is PyTorch's step.

    python bench/bench_vs_torch.py [--steps 30] [--hiddens 32,512] [--schedules zbv,dualpipev]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twinpipe.launch import run_local

RANKS = 2
MICROBATCHES = 8
BLOCK = 3  # steps per timed block


def alternating_blocks(runs: dict, blocks: int, block: int) -> tuple[dict, dict]:
    """Time ``blocks`` blocks of ``block`` back-to-back calls of each of the two ``runs`` ({label: fn}),
    the two alternating which goes first block by block, all ranks starting each block together.
    Returns ({label: seconds per call, one per block}, {label: every call's return value})."""
    (a, fa), (b, fb) = runs.items()
    times, outputs = {a: [], b: []}, {a: [], b: []}
    for i in range(blocks):
        for label, fn in (((b, fb), (a, fa)) if i % 2 else ((a, fa), (b, fb))):
            dist.barrier()
            start = time.perf_counter()
            out = [fn() for _ in range(block)]
            dist.barrier()
            times[label].append((time.perf_counter() - start) / block)
            outputs[label] += out
    return times, outputs
# twinpipe's name -> (torch.distributed.pipelining class name, whether twinpipe defers W for it)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", False),
    "zbv": ("ScheduleZBVZeroBubble", True),
    "dualpipev": ("ScheduleDualPipeV", True),
}


class Stage(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _loss(out, target):
    return F.mse_loss(out, target, reduction="sum")


def _stages(name: str, hidden: int, rank: int) -> tuple[list[int], list[nn.Module]]:
    """This rank's stage numbers under ``name`` and fresh modules for them (the same weights in both libraries)."""
    import twinpipe

    stages = list(twinpipe.stages_of_rank(name, RANKS, rank))
    total = len(stages) * RANKS
    torch.manual_seed(0)
    full = [Stage(hidden) for _ in range(total)]
    return stages, [full[s] for s in stages]


def _worker(rank, world, name, hidden, rows, steps, transport):
    import torch.distributed.pipelining as pipelining

    import twinpipe

    torch_class, defer = SCHEDULES[name]
    device = torch.device("cpu")
    torch.manual_seed(1)
    x = torch.randn(MICROBATCHES * rows, hidden)
    y = torch.randn(MICROBATCHES * rows, hidden)

    numbers, mine = _stages(name, hidden, rank)
    ours = twinpipe.Pipeline([twinpipe.defer_weight_grads(m) if defer else m for m in mine], name, transport=transport)
    layout = twinpipe.batch_layout(name, RANKS, rank, MICROBATCHES)
    _, theirs_modules = _stages(name, hidden, rank)
    total = len(numbers) * RANKS
    stages = [pipelining.PipelineStage(m, s, total, device) for s, m in zip(numbers, theirs_modules)]
    cls = getattr(pipelining.schedules, torch_class)
    theirs = cls(stages if len(stages) > 1 else stages[0], n_microbatches=MICROBATCHES, loss_fn=_loss, scale_grads=False)
    first, last = layout.inputs(x), layout.labels(y)

    def step_ours():
        ours.step(*first, num_chunks=MICROBATCHES, criterion=_loss if last else None, labels=last)
        ours.zero_grad(set_to_none=True)

    def step_theirs():
        kwargs = {"target": y, "losses": []} if last else {}
        theirs.step(*((x,) if first else ()), **kwargs)
        for m in theirs_modules:
            m.zero_grad(set_to_none=True)

    # Blocks of back-to-back steps (as in training: no barrier between steps), the two libraries
    # alternating block by block; a block's time / its steps is one sample.
    for fn in (step_ours, step_theirs) * 2:  # warm-up: metadata discovery, allocator, first P2P
        fn()
    times, _ = alternating_blocks({"twinpipe": step_ours, "torch": step_theirs}, steps, BLOCK)
    getattr(ours, "close", lambda: None)()  # (older twinpipe: no close)
    return times


def measure(name: str, hidden: int, rows: int, steps: int, transport: str = "auto") -> dict:
    return run_local(RANKS, _worker, name, hidden, rows, steps, transport, timeout=900)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed blocks per library")
    parser.add_argument("--hiddens", default="32,512")
    parser.add_argument("--rows", type=int, default=0, help="rows per micro-batch (default: 32 for hidden<128, else 256)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, of {', '.join(SCHEDULES)}")
    parser.add_argument("--transport", choices=["auto", "process-group"], default="auto",
                        help="twinpipe's transport (default auto: shared memory between CPU ranks on one host)")
    args = parser.parse_args()
    names = args.schedules.split(",")
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        parser.error(f"--schedules: {', '.join(unknown)} not shared by both libraries; allowed: {', '.join(SCHEDULES)}")
    print(f"{RANKS} CPU ranks (gloo, 1 thread each; twinpipe transport {args.transport}), stages of Linear-tanh-Linear, "
          f"{MICROBATCHES} micro-batches, {args.steps} blocks of {BLOCK} steps each, medians; baseline: torch's step")
    print(f"{'schedule':>16} {'hidden':>6} {'rows/mb':>7} {'torch ms':>9} {'twinpipe ms':>11} {'ratio':>6}  (median of paired blocks)")
    for hidden in (int(h) for h in args.hiddens.split(",")):
        rows = args.rows or (32 if hidden < 128 else 256)
        for name in names:
            times = measure(name, hidden, rows, args.steps, args.transport)
            t_torch, t_ours = statistics.median(times["torch"]), statistics.median(times["twinpipe"])
            ratio = statistics.median(o / t for o, t in zip(times["twinpipe"], times["torch"]))
            print(f"{name:>16} {hidden:>6} {rows:>7} {t_torch * 1e3:>9.2f} {t_ours * 1e3:>11.2f} {ratio:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
