"""twinpipe's DualPipeV against PyTorch's ScheduleDualPipeV: same model, same micro-batches.

2 CPU ranks (gloo process group, one thread each). twinpipe uses its default transport, which sends
messages between CPU ranks on one host through shared memory (``--transport process-group`` makes
it use gloo for them too); PyTorch sends them with gloo. Timed blocks of BLOCK back-to-back steps of the two libraries
alternate, so both see the same machine load; we report the median step time of each and the
median of the paired ratios (each twinpipe block over the torch block beside it), which cancels
the slow drift of a shared machine.

    python bench/bench_vs_torch.py [--steps 30] [--hiddens 32,512]
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


class Stage(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _loss(out, target):
    return F.mse_loss(out, target, reduction="sum")


def _stages(hidden: int, rank: int) -> list[nn.Module]:
    torch.manual_seed(0)
    full = [Stage(hidden) for _ in range(2 * RANKS)]
    return [full[rank], full[2 * RANKS - 1 - rank]]


def _worker(rank, world, hidden, rows, steps, transport):
    import twinpipe
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    device = torch.device("cpu")
    torch.manual_seed(1)
    x = torch.randn(MICROBATCHES * rows, hidden)
    y = torch.randn(MICROBATCHES * rows, hidden)

    ours = twinpipe.DualPipeV([twinpipe.defer_weight_grads(m) for m in _stages(hidden, rank)], transport=transport)
    a, b = _stages(hidden, rank)
    theirs = ScheduleDualPipeV(
        [PipelineStage(a, rank, 2 * RANKS, device), PipelineStage(b, 2 * RANKS - 1 - rank, 2 * RANKS, device)],
        n_microbatches=MICROBATCHES, loss_fn=_loss, scale_grads=False,
    )

    def step_ours():
        if rank == 0:
            ours.step(x, num_chunks=MICROBATCHES, criterion=_loss, labels=(y,))
        else:
            ours.step(num_chunks=MICROBATCHES)
        ours.zero_grad(set_to_none=True)

    def step_theirs():
        if rank == 0:
            theirs.step(x, target=y, losses=[])
        else:
            theirs.step()
        for m in (a, b):
            m.zero_grad(set_to_none=True)

    # Blocks of back-to-back steps (as in training: no barrier between steps), the two libraries
    # alternating block by block; a block's time / its steps is one sample.
    for fn in (step_ours, step_theirs) * 2:  # warm-up: metadata discovery, allocator, first P2P
        fn()
    times = {"twinpipe": [], "torch": []}
    for i in range(steps):
        order = (("torch", step_theirs), ("twinpipe", step_ours)) if i % 2 else (("twinpipe", step_ours), ("torch", step_theirs))
        for name, fn in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(BLOCK):
                fn()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / BLOCK)
    return times


def measure(hidden: int, rows: int, steps: int, transport: str = "auto") -> dict:
    return run_local(RANKS, _worker, hidden, rows, steps, transport, timeout=600)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed blocks per library")
    parser.add_argument("--hiddens", default="32,512")
    parser.add_argument("--rows", type=int, default=0, help="rows per micro-batch (default: 32 for hidden<128, else 256)")
    parser.add_argument("--transport", choices=["auto", "process-group"], default="auto",
                        help="twinpipe's transport (default auto: shared memory between CPU ranks on one host)")
    args = parser.parse_args()
    print(f"DualPipeV, {RANKS} CPU ranks (gloo, 1 thread each; twinpipe transport {args.transport}), {2 * RANKS} stages of Linear-tanh-Linear, "
          f"{MICROBATCHES} micro-batches, {args.steps} blocks of {BLOCK} steps each, medians")
    print(f"{'hidden':>6} {'rows/mb':>7} {'torch ms':>9} {'twinpipe ms':>11} {'ratio':>6}  (ratio: median of paired blocks)")
    for hidden in (int(h) for h in args.hiddens.split(",")):
        rows = args.rows or (32 if hidden < 128 else 256)
        times = measure(hidden, rows, args.steps, args.transport)
        t_torch, t_ours = statistics.median(times["torch"]), statistics.median(times["twinpipe"])
        ratio = statistics.median(o / t for o, t in zip(times["twinpipe"], times["torch"]))
        print(f"{hidden:>6} {rows:>7} {t_torch * 1e3:>9.2f} {t_ours * 1e3:>11.2f} {ratio:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
