"""``twinpipe demo --moe``: MoE blocks on pipeline x expert-parallel ranks (CPU processes, gloo)
under DualPipeV, its F&B ops overlapped part by part, and how much all-to-all time the overlap hid.

Each step runs twice, overlap off then on, on the same weights; the demo prints the step times,
whether the two gave the same losses (they must: the overlap only reorders independent work),
and, for the overlapped F&B ops, how long all-to-alls were in flight and how much of that time a
compute part of the other micro-batch ran alongside. With --eplb every token prefers the last
expert and twinpipe.eplb.Balancer re-places the experts while the model trains. The blocks are the
trainer's (``twinpipe.train.model.block`` of a ``GPTConfig`` with experts), on random hidden states.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import twinpipe.cli_options as cli_options
from twinpipe.checks import bad, check_int
from twinpipe.folders import writable_folder
from twinpipe.demo.dense import add_timeout
from twinpipe.demo.failure import failure_message
from twinpipe.launch import RankFailedError, run_local

__all__ = ["add_options", "run", "model_config", "DESCRIPTION"]

DESCRIPTION = " ".join(__doc__.replace("``", "").split())


def add_options(p: argparse.ArgumentParser) -> None:
    """The MoE demo's options (``twinpipe demo --moe``; ``--moe`` is added by the command)."""
    add = lambda name, **kw: cli_options.add(p, name, **kw)  # noqa: E731
    add("pp", default=2, more="DualPipeV runs on them")
    add("ep", default=2, more="per pipeline rank")
    add("steps", default=3, more="each run with overlap off, then on")
    add("microbatches", default=8)
    add("microbatch_size", default=16, more="per EP rank")
    add("seq_len", default=16)
    add("dim", default=64)
    add("heads", default=4)
    add("experts", default=8, more="a multiple of --ep")
    add("top_k", default=2)
    add("expert_ffn", default=128, more="0: 4 x --dim, as the trainer's GPT")
    add("blocks_per_stage", default=2)
    add("trace", default=None, default_text="no trace",
        more="write its overlapped F&B ops as Chrome/Perfetto DIR/trace.json (a name ending in .json: that file)")
    add_timeout(p)
    p.add_argument("--eplb", action="store_true",
                   help="send every token to the last expert (and top-k - 1 others); twinpipe.eplb.Balancer re-places "
                        "experts live")
    p.add_argument("--redundant", type=int, default=None,
                   help="with --eplb: redundant expert slots, a multiple of --ep (default: as many as --ep)")
    p.add_argument("--interval", type=int, default=2, help="with --eplb: steps between rebalances (default: 2)")
    # The old unit of the micro-batch: tokens per micro-batch per EP rank (--microbatch-size x --seq-len).
    p.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)


def model_config(args):
    """The ``GPTConfig`` the options describe: one pipeline stage's blocks, with experts."""
    from twinpipe.train.model import GPTConfig

    return GPTConfig(seq_len=args.seq_len, dim=args.dim, heads=args.heads, layers=args.blocks_per_stage,
                     experts=args.experts, top_k=args.top_k)


def _check(args) -> None:
    """ValueError ``--flag=value: must be ...`` for options that make no run; sets --tokens' micro-batch size."""
    parser = argparse.ArgumentParser()
    add_options(parser)
    cli_options.check(args, parser)
    if args.tokens is not None:
        check_int(args.tokens, "--tokens", low=1)
        if args.tokens % args.seq_len:
            raise bad("--tokens", args.tokens, f"must be a multiple of --seq-len={args.seq_len} (tokens per micro-batch "
                      "per EP rank; --microbatch-size says it in sequences)")
        args.microbatch_size = args.tokens // args.seq_len
    if args.experts < 1 or args.experts % args.ep:
        raise bad("--experts", args.experts, f"must be a multiple of --ep={args.ep} (each EP rank holds experts/ep)")
    if args.top_k > args.experts:
        raise bad("--top-k", args.top_k, f"must be <= --experts={args.experts}")
    check_int(args.interval, "--interval", low=1)
    if args.redundant is not None and (args.redundant < 0 or args.redundant % args.ep):
        raise bad("--redundant", args.redundant, f"must be a multiple of --ep={args.ep} (0 included)")
    if args.dim % args.heads:
        raise bad("--dim", args.dim, f"must be a multiple of --heads={args.heads}")
    if args.trace is not None:  # last: it makes the folder
        if Path(args.trace).is_file() and Path(args.trace).suffix != ".json":
            raise bad("--trace", args.trace, "must be a folder (or a file name ending in .json); it is a file")
        writable_folder(_trace_path(args.trace).parent, "--trace")


def _rank(rank: int, world: int, args) -> dict:
    import twinpipe
    from torch.distributed.device_mesh import init_device_mesh
    from twinpipe.moe import MoEStage, pp_ep_groups
    from twinpipe.overlap import comm_hidden
    from twinpipe.runtime.collectives import barrier
    from twinpipe.train.model import block

    mesh = init_device_mesh("cpu", (args.pp, args.ep), mesh_dim_names=("pp", "ep"))
    pp_group, ep_group = pp_ep_groups(mesh)
    pp_rank = mesh.get_local_rank("pp")
    stages = twinpipe.stages_of_rank("dualpipev", args.pp, pp_rank)
    cfg = model_config(args)
    modules = []
    for s in stages:
        torch.manual_seed(100 + s)  # same dense weights on every EP rank of a stage
        modules.append(MoEStage([block(cfg, expert_ffn=args.expert_ffn, ep_group=None if args.eplb else ep_group)
                                 for _ in range(args.blocks_per_stage)]))
    balancer = _skewed_and_balanced(modules, ep_group, args) if args.eplb else None
    pipe = twinpipe.DualPipeV(modules, process_group=pp_group, timeout=args.timeout)
    torch.manual_seed(7 + mesh.get_local_rank("ep"))
    x = torch.randn(args.microbatches * args.microbatch_size, args.seq_len, args.dim)
    label = torch.randn_like(x)
    first = 0 in pipe.stages
    out = {"times": {False: [], True: []}, "same_loss": True, "in_flight": 0.0, "hidden": 0.0, "events": [], "eplb": []}
    for step in range(args.steps):
        losses = {}
        for overlap in (False, True):
            for m in modules:
                m.overlap = overlap
                m.fb_events.clear()
                m.zero_grad(set_to_none=True)
            barrier(None, args.timeout, f"demo --moe: rank {rank}: step {step + 1}: waiting for every rank to start it")
            t0 = time.perf_counter()
            loss, _ = pipe.step(*((x,) if first else ()), num_chunks=args.microbatches,
                                criterion=(lambda o, y: torch.nn.functional.mse_loss(o, y)) if first else None,
                                labels=(label,) if first else ())
            out["times"][overlap].append(time.perf_counter() - t0)
            losses[overlap] = loss
        if first and not torch.equal(losses[False], losses[True]):
            out["same_loss"] = False
        if balancer is not None:
            out["eplb"].append(_balance_line(step, balancer, balancer.step()))
        if step == args.steps - 1:
            for m in modules:
                for events in m.fb_events:
                    out["events"].append(events)
                    flying, hid = comm_hidden(events)
                    out["in_flight"] += flying
                    out["hidden"] += hid
    return out


def _skewed_and_balanced(modules, ep_group, args):
    """--eplb: every token goes to the last expert, and to top_k - 1 others (router bias); the redundant slots
    start as EPLB places them for uniform loads; a Balancer over the rank's stages."""
    from twinpipe.eplb import Balancer, rebalance_experts

    redundant = args.ep if args.redundant is None else args.redundant
    slots = args.experts + redundant
    start = rebalance_experts(torch.ones(1, args.experts), slots, 1, 1, args.ep)[0][0]
    for m in modules:
        for block in m.blocks:
            block.router.bias[-1] = 0.5
            block.shard_experts_(ep_group, start)
    return Balancer(modules, interval=args.interval, window=1, threshold=1.05, timeout=args.timeout)


def _balance_line(step: int, balancer, report) -> str:
    """One step: max/mean EP-rank load of its routed loads per block, and a rebalance if one ran."""
    if report is None:
        return f"step {step}: max/mean rank load " + ", ".join(f"{r:.2f}" for r in balancer.imbalance())
    moved = [layer for layer in report.layers if layer.move]
    sent = sum(layer.move.transfers for layer in moved)
    return (f"step {step}: max/mean rank load " + ", ".join(f"{layer.before:.2f}" for layer in report.layers)
            + f" -> rebalanced {len(moved)} of {len(report.layers)} blocks (predicted "
            + ", ".join(f"{layer.after:.2f}" for layer in report.layers)
            + f"; {sent} experts sent, {report.bytes_sent / 1e3:.0f} of {report.bytes_all / 1e3:.0f} kB)")


def _trace_path(trace: str) -> Path:
    """--trace DIR writes DIR/trace.json; a name ending in .json is the file itself."""
    path = Path(trace)
    return path if path.suffix == ".json" else path / "trace.json"


def run(args) -> int:
    """Run the MoE demo; 0 on success, 2 (message on stderr) on bad options, 1 (one line on stderr) when a rank fails."""
    try:
        _check(args)
    except ValueError as error:
        print(f"twinpipe demo --moe: error: {error}", flush=True, file=sys.stderr)
        return 2
    world = args.pp * args.ep
    try:
        results = dict(enumerate(run_local(world, _rank, args, timeout=600, group_timeout=args.timeout)))
    except RankFailedError as error:
        print(f"twinpipe demo --moe: {failure_message(error, args.timeout, lambda r: f'pp={r // args.ep} ep={r % args.ep}')}",
              file=sys.stderr)
        return 1
    except TimeoutError as error:  # the whole run's own limit
        print(f"twinpipe demo --moe: {error}", file=sys.stderr)
        return 1
    m = statistics.median
    off = max(m(r["times"][False]) for r in results.values())
    on = max(m(r["times"][True]) for r in results.values())
    flying = sum(r["in_flight"] for r in results.values())
    hidden = sum(r["hidden"] for r in results.values())
    print(f"MoE on PP={args.pp} x EP={args.ep} ({world} CPU processes, gloo), DualPipeV, {args.microbatches} micro-batches "
          f"of {args.microbatch_size * args.seq_len} tokens, {args.blocks_per_stage} blocks per stage, {args.experts} experts "
          f"(top-{args.top_k})")
    print(f"step time (median of {args.steps}, slowest rank): overlap off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms "
          f"(on/off {on / off:.2f}); losses {'identical' if all(r['same_loss'] for r in results.values()) else 'DIFFER'}")
    if flying:
        print(f"overlapped F&B ops of the last step: all-to-alls in flight {flying * 1e3:.1f} ms (all ranks), "
              f"{hidden * 1e3:.1f} ms of it ({100 * hidden / flying:.0f}%) with a compute part of the other micro-batch running")
    for rank in sorted(results)[:: args.ep]:  # one rank per EP group: the others print the same
        if results[rank]["eplb"]:
            print(f"EPLB, pipeline rank {rank // args.ep}'s blocks (max/mean EP-rank load per block):")
            for line in results[rank]["eplb"]:
                print("  " + line)
    if args.trace:
        from twinpipe.overlap import fb_chrome_trace
        from twinpipe.trace.chrome import write_trace

        path = write_trace(fb_chrome_trace({r: results[r]["events"] for r in results}), _trace_path(args.trace))
        print(f"wrote {path}: the overlapped F&B ops of the last step, per rank (open in https://ui.perfetto.dev)")
    print(f"this machine has {os.cpu_count()} cores for {world} ranks: gloo's all-to-all is copying done by the same "
          "cores, so it hides only where cores are to spare")
    return 0
