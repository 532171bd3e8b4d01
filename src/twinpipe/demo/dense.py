"""``twinpipe demo``: train a small transformer with a pipeline schedule and check every step
against a single-process reference.

Launches its own ranks (CPU processes with gloo by default), or runs under torchrun:
``torchrun --nproc-per-node 4 -m twinpipe.demo --schedule dualpipe``. Its blocks are the trainer's
(``twinpipe.train.model.block`` of a ``GPTConfig``), on random hidden states.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import MappingProxyType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import twinpipe.cli_options as cli_options
from twinpipe.checks import DEFAULT_TIMEOUT, bad
from twinpipe.folders import writable_folder
from twinpipe.demo.failure import failure_message
from twinpipe.launch import RankFailedError, init_torchrun_group, run_local

__all__ = ["add_options", "run", "grad_tolerance", "exactness_line", "cpu_cores", "oversubscription_warning",
           "model_config", "GRAD_TOLERANCE", "TRACE_FILES", "DESCRIPTION"]

DESCRIPTION = ("Train a small transformer on a pipeline schedule and check every step against a single "
               "process: losses bitwise, gradients within a tolerance per dtype. Launches its own ranks "
               "(CPU processes with gloo by default), or runs under torchrun.")


def model_config(args, num_model_stages: int = 1):
    """The ``GPTConfig`` the options describe: ``--blocks-per-stage`` blocks in each model stage."""
    from twinpipe.train.model import GPTConfig

    return GPTConfig(seq_len=args.seq_len, dim=args.dim, heads=args.heads, layers=args.blocks_per_stage * num_model_stages)


def _stage(index: int, args, device) -> nn.Module:
    from twinpipe.train.model import block

    cfg = model_config(args)
    torch.manual_seed(1000 + index)  # every rank builds identical model stages
    blocks = nn.Sequential(*[block(cfg) for _ in range(args.blocks_per_stage)])  # weight gradients deferred to W
    return blocks.to(device=device, dtype=_dtype(args))


def _dtype(args) -> torch.dtype:
    return {"float64": torch.float64, "float32": torch.float32}[args.dtype]


def _criterion(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target).clone()


def _grad_error(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return 0.0 if denom == 0 else float(1 - 2 * (x * y).sum() / denom)


def _run_rank(args) -> None:
    from twinpipe.runtime.collectives import cpu_group, release_cpu_group

    group = cpu_group(dist.group.WORLD, args.timeout)  # the demo's agreements: a few bytes on the CPU
    try:
        _run_steps(args, group)
    finally:
        release_cpu_group(group)


def _run_steps(args, group) -> None:
    """The demo on this rank; its own collectives (on ``group``, gloo) each bounded by ``--timeout``."""
    import twinpipe
    from twinpipe.runtime.batches import batch_layout
    from twinpipe.runtime.collectives import barrier, gather_objects
    from twinpipe.schedule import resolve

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    schedule = resolve(args.schedule, world, **_schedule_options(args))  # once: the stages, pipeline and layout share it
    placement = schedule.placement
    modules = [_stage(placement.model_stage(s), args, device) for s in placement.stages_of(rank)]
    if args.schedule == "dualpipe":
        pipe = twinpipe.DualPipe(modules, timeout=args.timeout)
    else:
        pipe = twinpipe.Pipeline(modules, schedule, timeout=args.timeout)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    chunks = args.microbatches or 2 * world
    gen = torch.Generator().manual_seed(0)
    shape = (chunks * args.microbatch_size, args.seq_len, args.dim)
    layout = batch_layout(schedule, world, rank, chunks)
    _say_setup(args, pipe, placement, chunks, group)
    all_exact = True
    for step in range(args.steps):
        x = torch.randn(shape, generator=gen, dtype=_dtype(args)).to(device)
        target = torch.randn(shape, generator=gen, dtype=_dtype(args)).to(device)
        reference = _reference_model(pipe, placement, args, device)
        ref_losses = _reference_losses(reference, placement, x, target, chunks)

        inputs, labels = layout.inputs(x), layout.labels(target)
        barrier(group, args.timeout, f"demo: rank {rank}: step {step + 1}: waiting for every rank to start it")
        start = time.perf_counter()
        loss, _ = pipe.step(*inputs, num_chunks=chunks, criterion=_criterion, labels=labels,
                            trace=bool(args.trace) and step == args.steps - 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        barrier(group, args.timeout, f"demo: rank {rank}: step {step + 1}: waiting for every rank to finish it")
        elapsed = time.perf_counter() - start
        if len(placement.chains) > 1:
            pipe.sync_mirrored_grads()  # both copies of a stage now hold its full gradient
        exact = _matches(pipe, placement, loss, [ref_losses[j] for j in layout.label_microbatches], reference)
        exact = all(gather_objects(group, exact, args.timeout, f"demo: rank {rank}: step {step + 1}: comparing with one process"))
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
        print(exactness_line(all_exact, _dtype(args)), flush=True)
    if not all_exact:
        raise SystemExit(1)


def _say_setup(args, pipe, placement, chunks: int, group) -> None:
    """Rank 0's first line: the schedule, the ranks and how their messages go (collective), the model."""
    from twinpipe.runtime.collectives import gather_objects

    rank, world = dist.get_rank(), dist.get_world_size()
    piped = any(gather_objects(group, bool(pipe.shared_memory_peers), args.timeout, f"demo: rank {rank}: telling how messages go"))
    via = dist.get_backend() + (", messages through shared memory" if piped else "")
    if rank == 0:
        copies = " (two copies)" if len(placement.chains) > 1 else ""
        print(f"twinpipe demo: {args.schedule} on {world} {args.device} rank(s) ({via}), "
              f"{placement.num_model_stages} model stages{copies} x {args.blocks_per_stage} block(s), dim {args.dim}, "
              f"{chunks} micro-batches of {args.microbatch_size}x{args.seq_len}, {args.dtype}", flush=True)


def _matches(pipe, placement, loss, ref_losses: list, reference: list[nn.Module]) -> bool:
    """Whether this rank's losses (``loss``, None on a rank ending no micro-batch) equal the one-process
    ``ref_losses`` exactly and its stages' gradients ``reference``'s within ``grad_tolerance``."""
    exact = True
    if loss is not None:
        exact &= torch.equal(loss.cpu(), torch.stack(ref_losses).cpu())
    for s, module in zip(placement.stages_of(dist.get_rank()), pipe.module):
        for p, q in zip(module.parameters(), reference[placement.model_stage(s)].parameters()):
            exact &= _grad_error(p.grad, q.grad) <= grad_tolerance(p.dtype)
    return bool(exact)


def _reference_model(pipe, placement, args, device) -> list[nn.Module]:
    """Every rank rebuilds the whole model from the pipeline's current weights: each model stage's
    tensors broadcast by the rank holding its first copy, each broadcast bounded by ``--timeout``."""
    from twinpipe.runtime.collectives import collective

    rank = dist.get_rank()
    held = {placement.model_stage(s): module for s, module in zip(pipe.stages, pipe.module) if placement.chain_of_stage(s) == 0}
    owners = {placement.model_stage(s): r for r in range(dist.get_world_size()) for s in placement.stages_of(r)
              if placement.chain_of_stage(s) == 0}
    model = []
    for k in range(placement.num_model_stages):
        stage = _stage(k, args, device)
        if k in held:
            stage.load_state_dict(held[k].state_dict())
        for name, tensor in stage.state_dict().items():
            collective(dist.broadcast, tensor, src=owners[k], group=None, timeout=args.timeout,
                       what=f"demo: rank {rank}: model stage {k}'s {name} from rank {owners[k]}")
        model.append(stage)
    return model


def _reference_losses(model, placement, x, target, chunks) -> dict[int, torch.Tensor]:
    xs, ts = torch.tensor_split(x, chunks), torch.tensor_split(target, chunks)
    losses = {}
    for c, chain in enumerate(placement.chains):
        for j in placement.microbatches_of_chain(c, chunks):
            out = xs[j]
            for s in chain:
                out = model[placement.model_stage(s)](out)
            loss = _criterion(out, ts[j])
            loss.backward()
            losses[j] = loss.detach()
    return losses


def _schedule_options(args) -> dict:
    options = {"stages_per_rank": args.stages_per_rank} if getattr(args, "stages_per_rank", None) else {}
    if getattr(args, "overlap", False):
        options["overlap"] = True
    if getattr(args, "warmup_extra", None) is not None:
        options["warmup_extra"] = args.warmup_extra
    return options


def _write_trace(pipe, chunks, args, rank) -> None:
    from twinpipe.trace import gather_timeline, write_run_report

    timeline = gather_timeline(pipe, chunks, name=args.schedule)
    if rank == 0:
        report = write_run_report(args.trace, timeline, pipe.schedule_for(chunks))
        print(f"trace: {', '.join(report['files'].values())} (open trace.json in https://ui.perfetto.dev); "
              f"bubble rate measured {report['measured_bubble_rate']:.3f}, predicted {report['predicted_bubble_rate']:.3f}",
              flush=True)


# --------------------------------------------------------------------------- launching
def _worker(rank: int, world: int, args) -> None:
    _run_rank(args)


TRACE_FILES = MappingProxyType({
    "trace.json": "Chrome/Perfetto trace of the last step",
    "measured.png": "its timeline",
    "predicted.png": "the simulator's timeline from the measured op times",
    "compare.png": "both on one time axis",
})

# Gradient check: relative squared error |a-b|^2 / (|a|^2+|b|^2) against one process, per dtype.
GRAD_TOLERANCE = MappingProxyType({"float64": 1e-13, "float32": 1e-6})


def grad_tolerance(dtype: torch.dtype) -> float:
    """The largest gradient error the demo accepts for ``dtype``."""
    name = str(dtype).removeprefix("torch.")
    if name not in GRAD_TOLERANCE:
        raise ValueError(f"dtype={dtype}: the demo checks {', '.join(GRAD_TOLERANCE)}")
    return GRAD_TOLERANCE[name]


def exactness_line(exact: bool, dtype: torch.dtype) -> str:
    """The verdict, naming the tolerance that was checked."""
    return (f"exact: {'yes' if exact else 'no'} (losses bitwise equal to a single process, gradients "
            f"within {grad_tolerance(dtype):g} relative squared error in {str(dtype).removeprefix('torch.')})")


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity where the OS says, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def oversubscription_warning(ranks: int, threads: int, cores: int) -> str | None:
    """A warning when CPU ranks x threads exceed the cores: ranks then wait for a core, not for each other."""
    if ranks * threads <= cores:
        return None
    return (f"warning: {ranks} CPU rank(s) x {threads} thread(s) on {cores} core(s): ranks wait for a core, "
            "so step times and the measured bubble say little about the schedule")


def add_options(p: argparse.ArgumentParser) -> None:
    """The dense demo's options (``twinpipe demo``; ``--moe`` is added by the command)."""
    from twinpipe.schedule import registry

    add = lambda name, **kw: cli_options.add(p, name, **kw)  # noqa: E731
    add("pp", default=4, more="started here; under torchrun, its world size instead")
    add("schedule", default="dualpipev", more=f"one of {', '.join(registry.names())}")
    add("device", choices=["cpu", "cuda"], default="cpu")
    add("steps", default=3)
    add("microbatches", default=None, default_text="2 x --pp")
    add("dim", default=64)
    add("heads", default=4)
    add("seq_len", default=16)
    add("microbatch_size", default=2)
    add("blocks_per_stage", default=1)
    add("stages_per_rank", default=None, default_text="the schedule's own")
    add("overlap", default_text="off")
    add("overlap_warmup", dest="warmup_extra", default_text="0")
    add("dtype", choices=list(GRAD_TOLERANCE), default="float64",
        more="gradients must match one process within " + ", ".join(f"{t:g} ({d})" for d, t in GRAD_TOLERANCE.items()))
    add("lr", default=0.05, more="SGD")
    add("threads", default=1)
    add_timeout(p)
    add("trace", default=None, default_text="no trace",
        more="write " + ", ".join(f"{name} ({what})" for name, what in TRACE_FILES.items()) + " into DIR")


def add_timeout(p: argparse.ArgumentParser) -> None:
    """``--timeout``, as every demo spells it (and ``twinpipe train``)."""
    cli_options.add(p, "timeout", default=DEFAULT_TIMEOUT, default_text=f"{DEFAULT_TIMEOUT:g}",
                    more="the pipeline's messages and the demo's own collectives; a failed wait ends the run with one line "
                         "naming the rank")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _check(args, ranks: int) -> str | None:
    from twinpipe.schedule import resolve

    parser = argparse.ArgumentParser()
    add_options(parser)
    try:
        cli_options.check(args, parser)
        if args.dim % args.heads:
            raise bad("--dim", args.dim, f"must be a multiple of --heads={args.heads}")
        resolve(args.schedule, ranks, **_schedule_options(args)).build(args.microbatches or 2 * ranks)
    except ValueError as exc:
        return str(exc)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            return "--device=cuda: CUDA is not available on this machine; use --device cpu"
        if ranks > torch.cuda.device_count() and not _under_torchrun():
            return f"--pp={args.pp}: NCCL needs one GPU per rank and this machine has {torch.cuda.device_count()}"
    if args.trace:
        try:
            writable_folder(args.trace, "--trace")  # last: it makes the folder
        except ValueError as error:
            return str(error)
    return None


def run(args) -> int:
    """Run the dense demo; 0 when every step was exact, 2 (message on stderr) on bad options."""
    ranks = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else args.pp
    problem = _check(args, ranks)
    if problem:
        print(f"twinpipe demo: error: {problem}", file=sys.stderr)
        return 2
    if args.device == "cpu" and os.environ.get("LOCAL_RANK", "0") == "0":
        warning = oversubscription_warning(int(os.environ.get("LOCAL_WORLD_SIZE", ranks)), args.threads, cpu_cores())
        if warning:
            print(f"twinpipe demo: {warning}", file=sys.stderr, flush=True)
    if _under_torchrun():
        torch.set_num_threads(args.threads)
        init_torchrun_group("nccl" if args.device == "cuda" else "gloo", args.timeout)
        try:
            _run_rank(args)
        finally:
            dist.destroy_process_group()
        return 0
    try:  # the group's timeout bounds its setup; the demo's own collectives wait --timeout each (runtime/collectives.py)
        run_local(args.pp, _worker, args, threads=args.threads, backend="nccl" if args.device == "cuda" else "gloo",
                  group_timeout=args.timeout)
    except RankFailedError as error:
        print(f"twinpipe demo: {failure_message(error, args.timeout)}", file=sys.stderr)
        return 1
    return 0
