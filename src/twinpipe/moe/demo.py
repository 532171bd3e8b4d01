"""``twinpipe demo --moe``: a small MoE model on PP x EP (CPU processes, gloo) with DualPipeV, its
F&B ops overlapped part by part, and how much all-to-all time the overlap hid.

Each step runs twice, overlap off then on, on the same weights; the demo prints the step times,
whether the two gave the same losses (they must: the overlap only reorders independent work),
and, for the overlapped F&B ops, how long all-to-alls were in flight and how much of that time a
compute part of the other micro-batch ran alongside.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from twinpipe.checks import DEFAULT_TIMEOUT
from twinpipe.launch import run_local

__all__ = ["main", "add_arguments"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (DualPipeV)")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel ranks per pipeline rank")
    parser.add_argument("--steps", type=int, default=3, help="training steps, each run with overlap off then on")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per micro-batch per EP rank")
    parser.add_argument("--hidden", type=int, default=64, help="model width")
    parser.add_argument("--experts", type=int, default=8, help="routed experts per MoE block (a multiple of --ep)")
    parser.add_argument("--top-k", type=int, default=2, help="experts each token is routed to")
    parser.add_argument("--expert-hidden", type=int, default=128, help="hidden width of each expert")
    parser.add_argument("--blocks", type=int, default=2, help="MoE blocks per stage")
    parser.add_argument("--trace", metavar="PATH", help="write the last step's overlapped F&B ops as Chrome trace JSON")
    parser.add_argument("--eplb", action="store_true",
                        help="send every token to the last expert (and top-k - 1 others); twinpipe.eplb.Balancer re-places experts live")
    parser.add_argument("--redundant", type=int, default=None, help="with --eplb: redundant expert slots (None: as many as --ep)")
    parser.add_argument("--interval", type=int, default=2, help="with --eplb: steps between rebalances")
    return parser


def _check(args) -> None:
    for name in ("pp", "ep", "steps", "chunks", "tokens", "hidden", "experts", "top_k", "expert_hidden", "blocks"):
        value = getattr(args, name)
        if value < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={value}: must be >= 1")
    if args.experts % args.ep:
        raise SystemExit(f"--ep={args.ep} must divide --experts={args.experts}")
    if args.interval < 1:
        raise SystemExit(f"--interval={args.interval}: must be >= 1")
    if args.redundant is not None and (args.redundant < 0 or args.redundant % args.ep):
        raise SystemExit(f"--redundant={args.redundant}: must be a multiple of --ep={args.ep} (0 included)")
    if args.tokens % 16:
        raise SystemExit(f"--tokens={args.tokens}: must be a multiple of the sequence length 16")


def _rank(rank: int, world: int, args) -> dict:
    import twinpipe
    from torch.distributed.device_mesh import init_device_mesh
    from twinpipe.moe import MoEBlock, MoEStage, pp_ep_groups
    from twinpipe.overlap import comm_hidden

    mesh = init_device_mesh("cpu", (args.pp, args.ep), mesh_dim_names=("pp", "ep"))
    pp_group, ep_group = pp_ep_groups(mesh)
    pp_rank = mesh.get_local_rank("pp")
    stages = twinpipe.stages_of_rank("dualpipev", args.pp, pp_rank)
    modules = []
    for s in stages:
        torch.manual_seed(100 + s)  # same dense weights on every EP rank of a stage
        modules.append(MoEStage([MoEBlock(args.hidden, 4 if args.hidden % 4 == 0 else 1, args.experts, args.top_k,
                                          args.expert_hidden, shared_hidden=args.expert_hidden, score="sigmoid",
                                          ep_group=None if args.eplb else ep_group) for _ in range(args.blocks)]))
    balancer = _skewed_and_balanced(modules, ep_group, args) if args.eplb else None
    pipe = twinpipe.DualPipeV(modules, process_group=pp_group)
    torch.manual_seed(7 + mesh.get_local_rank("ep"))
    x = torch.randn(args.chunks * args.tokens // 16, 16, args.hidden)
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
            dist.barrier()
            t0 = time.perf_counter()
            loss, _ = pipe.step(*((x,) if first else ()), num_chunks=args.chunks,
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
    return Balancer(modules, interval=args.interval, window=1, threshold=1.05)


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


def main(argv=None) -> int:
    args = add_arguments(argparse.ArgumentParser(prog="twinpipe demo --moe", description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)).parse_args(argv)
    _check(args)
    world = args.pp * args.ep
    results = dict(enumerate(run_local(world, _rank, args, timeout=600, group_timeout=DEFAULT_TIMEOUT)))
    m = statistics.median
    off = max(m(r["times"][False]) for r in results.values())
    on = max(m(r["times"][True]) for r in results.values())
    flying = sum(r["in_flight"] for r in results.values())
    hidden = sum(r["hidden"] for r in results.values())
    print(f"MoE on PP={args.pp} x EP={args.ep} ({world} CPU processes, gloo), DualPipeV, {args.chunks} micro-batches "
          f"of {args.tokens} tokens, {args.blocks} blocks per stage, {args.experts} experts (top-{args.top_k})")
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
        import json

        from twinpipe.overlap import fb_chrome_trace

        with open(args.trace, "w") as f:
            json.dump(fb_chrome_trace({r: results[r]["events"] for r in results}), f)
        print(f"wrote {args.trace}: the overlapped F&B ops of the last step, per rank (open in https://ui.perfetto.dev)")
    print(f"this machine has {os.cpu_count()} cores for {world} ranks: gloo's all-to-all is copying done by the same "
          "cores, so it hides only where cores are to spare")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
