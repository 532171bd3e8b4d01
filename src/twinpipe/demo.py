"""``twinpipe demo``: train a small transformer-style model with a pipeline schedule and check every
step against a single-process reference.

Launches its own ranks (CPU processes with gloo by default), or runs under torchrun:
``torchrun --nproc-per-node 4 -m twinpipe.demo --schedule dualpipe``.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "add_demo_parser", "run_demo", "main"]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, both residual."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(h // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _stage(index: int, args, device) -> nn.Module:
    import twinpipe

    torch.manual_seed(1000 + index)  # every rank builds identical model stages
    blocks = nn.Sequential(*[Block(args.hidden, args.heads) for _ in range(args.blocks_per_stage)])
    return twinpipe.defer_weight_grads(blocks).to(device=device, dtype=_dtype(args))


def _dtype(args) -> torch.dtype:
    return {"float64": torch.float64, "float32": torch.float32}[args.dtype]


def _criterion(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target).clone()


def _model_stage(placement, stage: int) -> int:
    return stage % placement.num_ranks if placement.kind == "dual" else stage


def _grad_error(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return 0.0 if denom == 0 else float(1 - 2 * (x * y).sum() / denom)


def _run_rank(args) -> None:
    import twinpipe
    from twinpipe.schedule.registry import placement_for

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    placement = placement_for(args.schedule, world, **_schedule_options(args))
    num_model_stages = world if placement.kind == "dual" else placement.num_stages
    mine = placement.stages_of(rank)
    modules = [_stage(_model_stage(placement, s), args, device) for s in mine]
    if args.schedule == "dualpipe":
        pipe = twinpipe.DualPipe(modules)
    else:
        pipe = twinpipe.Pipeline(modules, args.schedule, **_schedule_options(args))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    chunks = args.chunks or 2 * world
    gen = torch.Generator().manual_seed(0)
    shape = (chunks * args.microbatch_size, args.seq, args.hidden)
    piped = torch.tensor([float(bool(pipe.shared_memory_peers))])
    dist.all_reduce(piped)
    via = dist.get_backend() + (", messages through shared memory" if piped.item() else "")
    if rank == 0:
        print(f"twinpipe demo: {args.schedule} on {world} {args.device} rank(s) ({via}), "
              f"{num_model_stages} model stages{' (two copies)' if placement.kind == 'dual' else ''} x {args.blocks_per_stage} block(s), hidden {args.hidden}, "
              f"{chunks} micro-batches of {args.microbatch_size}x{args.seq}, {args.dtype}", flush=True)
    all_exact = True
    for step in range(args.steps):
        x = torch.randn(shape, generator=gen, dtype=_dtype(args)).to(device)
        target = torch.randn(shape, generator=gen, dtype=_dtype(args)).to(device)
        reference = _reference_model(pipe, placement, num_model_stages, args, device)
        ref_losses = _reference_losses(reference, placement, x, target, chunks)

        inputs, labels = (), ()
        for c, chain in enumerate(placement.chains):
            mbs = placement.microbatches_of_chain(c, chunks)
            rows = slice(mbs[0] * args.microbatch_size, (mbs[-1] + 1) * args.microbatch_size)
            if chain[0] in mine:
                inputs = (x[rows],)
            if chain[-1] in mine:
                labels = (target[rows],)
                my_mbs = list(mbs)
        dist.barrier()
        start = time.perf_counter()
        loss, _ = pipe.step(*inputs, num_chunks=chunks, criterion=_criterion, labels=labels,
                            trace=bool(args.trace) and step == args.steps - 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        elapsed = time.perf_counter() - start
        if isinstance(pipe, twinpipe.DualPipe):
            pipe.sync_mirrored_grads()  # both copies of a stage now hold its full gradient
        exact = True
        if loss is not None:
            exact &= torch.equal(loss.cpu(), torch.stack([ref_losses[j] for j in my_mbs]).cpu())
        for s, module in zip(mine, pipe.module):
            for p, q in zip(module.parameters(), reference[_model_stage(placement, s)].parameters()):
                exact &= _grad_error(p.grad, q.grad) <= (1e-13 if p.dtype == torch.float64 else 1e-6)
        flag = torch.tensor([1.0 if exact else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        exact = bool(flag.item())
        all_exact &= exact
        mean_loss = torch.stack(list(ref_losses.values())).mean().item()
        if rank == 0:
            print(f"step {step + 1}: loss {mean_loss:.6f}  step time {elapsed * 1e3:7.1f} ms  "
                  f"exact: {'yes' if exact else 'no'}", flush=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if args.trace:
        _write_trace(pipe, chunks, args, rank)
    if rank == 0:
        print(f"exact: {'yes' if all_exact else 'no'} (losses bitwise equal to a single process, "
              "gradients within 1e-13)", flush=True)
    if not all_exact:
        raise SystemExit(1)


def _reference_model(pipe, placement, num_model_stages, args, device) -> list[nn.Module]:
    """Every rank rebuilds the whole model from the pipeline's current weights."""
    mine = {}
    for s, module in zip(pipe.stages, pipe.module):
        k = _model_stage(placement, s)
        if placement.kind != "dual" or s < placement.num_ranks:
            mine[k] = {n: t.detach().cpu() for n, t in module.state_dict().items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    model = []
    for k in range(num_model_stages):
        state = next(g[k] for g in gathered if k in g)
        stage = _stage(k, args, device)
        stage.load_state_dict(state)
        model.append(stage)
    return model


def _reference_losses(model, placement, x, target, chunks) -> dict[int, torch.Tensor]:
    xs, ts = torch.tensor_split(x, chunks), torch.tensor_split(target, chunks)
    losses = {}
    for c, chain in enumerate(placement.chains):
        for j in placement.microbatches_of_chain(c, chunks):
            out = xs[j]
            for s in chain:
                out = model[_model_stage(placement, s)](out)
            loss = _criterion(out, ts[j])
            loss.backward()
            losses[j] = loss.detach()
    return losses


def _schedule_options(args) -> dict:
    return {"stages_per_rank": args.stages_per_rank} if getattr(args, "stages_per_rank", None) else {}


def _write_trace(pipe, chunks, args, rank) -> None:
    from twinpipe.trace import gather_timeline, write_run_report

    timeline = gather_timeline(pipe, chunks, name=args.schedule)
    if rank == 0:
        report = write_run_report(args.trace, timeline, pipe.schedule_for(chunks))
        print(f"trace: {args.trace}/trace.json (open in https://ui.perfetto.dev), measured.png, predicted.png; "
              f"bubble rate measured {report['measured_bubble_rate']:.3f}, predicted {report['predicted_bubble_rate']:.3f}",
              flush=True)


# --------------------------------------------------------------------------- launching
def _worker(rank: int, world: int, port: int, args) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        _run_rank(args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="train a small model on a pipeline and check it against one process")
    _add_options(p)
    return p


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4, help="pipeline ranks to launch (default 4)")
    p.add_argument("--schedule", default="dualpipev", help="dualpipe, dualpipev or any schedule name (default dualpipev)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--chunks", type=int, default=0, help="micro-batches per step (default 2 x ranks)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--blocks-per-stage", type=int, default=1)
    p.add_argument("--stages-per-rank", type=int, default=None, help="for interleaved-1f1b")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    p.add_argument("--trace", metavar="DIR", default=None, help="write trace.json, measured.png, predicted.png here")


def _check(args) -> str | None:
    from twinpipe.schedule import registry

    if args.ranks < 1:
        return f"--ranks={args.ranks}: must be >= 1"
    if args.hidden % args.heads:
        return f"--hidden={args.hidden} must be divisible by --heads={args.heads}"
    try:
        registry.build(args.schedule, args.ranks, args.chunks or 2 * args.ranks, **_schedule_options(args))
    except ValueError as exc:
        return str(exc)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            return "--device=cuda: CUDA is not available on this machine; use --device cpu"
        if args.ranks > torch.cuda.device_count() and "RANK" not in os.environ:
            return f"--ranks={args.ranks}: NCCL needs one GPU per rank and this machine has {torch.cuda.device_count()}"
    return None


def run_demo(args) -> int:
    problem = _check(args)
    if problem:
        print(f"twinpipe demo: error: {problem}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        torch.set_num_threads(args.threads)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            _run_rank(args)
        finally:
            dist.destroy_process_group()
        return 0
    import torch.multiprocessing as mp

    try:
        mp.start_processes(_worker, args=(args.ranks, _free_port(), args), nprocs=args.ranks, start_method="spawn")
    except mp.ProcessExitedException as exc:
        print(f"twinpipe demo: a rank failed ({exc})", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twinpipe.demo", description=__doc__.splitlines()[0])
    _add_options(parser)
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
