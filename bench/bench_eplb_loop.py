"""EPLB in the loop on a skewed routing: CPU, gloo, 4 processes (EP=4; ``--ep 2``: 2), 64 experts, top-k routing
drawn from a Zipf popularity (expert ids shuffled, so hot experts fall on any rank).

For 0, 8 and 16 redundant slots (R = 64, 72, 80) one MoE block runs ``--steps`` training steps
(forward, backward, gradient reductions), the Balancer re-places its experts from the loads it
measured; then ``--steps`` more steps run on fresh tokens, alternating with a copy of the block
left on the old placement (same weights, same tokens, same routing). Printed per R: max/mean
EP-rank load (rows the rank's slots ran over those steps) on the old and the new placement, the
balancer's prediction, the median step time of the slowest rank on each (ratio new/old), the
rebalance itself (experts sent, local copies, bytes, time) and its bytes against moving every
slot's expert and against a placement computed without ``previous_phy2log``. With 4 processes on a 2-core machine the ranks share cores, so the rank
loads barely change the step time: ``--ep 2`` gives each rank a core. Before the rebalance the R - 64 redundant slots hold the replicas EPLB gives
for uniform loads (nothing measured yet).

    python bench/bench_eplb_loop.py [--ep 4] [--steps 6] [--tokens 2048] [--width 256] [--zipf 1.0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from twinpipe.launch import run_local

EXPERTS, HIDDEN, TOP_K, SEQ = 64, 64, 4, 16


def _zipf_router(router, popularity: torch.Tensor, seed: int):
    """Replace ``router.forward``: experts sampled from ``popularity`` (without replacement per
    token), weights the router's own softmax scores of them, renormalised."""
    gen = torch.Generator().manual_seed(seed)

    def forward(tokens):
        scores = router.gate(tokens).softmax(-1)
        experts = torch.multinomial(popularity.expand(len(tokens), -1), router.top_k, generator=gen)
        weights = scores.gather(1, experts)
        return experts, weights / weights.sum(-1, keepdim=True)

    router.forward = forward
    return gen


def _rank_rows(block, group) -> torch.Tensor:
    rows = torch.zeros(block.num_slots, dtype=torch.long)
    rows[block.first_slot : block.first_slot + block.local] = block.expert_rows
    dist.all_reduce(rows, group=group)
    block.expert_rows.zero_()
    return rows.view(block.ep, -1).sum(1)


def _train_step(block, group, x) -> float:
    from twinpipe.moe import reduce_dense_grads, reduce_replica_grads

    block.zero_grad(set_to_none=True)
    dist.barrier(group)
    t0 = time.perf_counter()
    block(x).square().mean().backward()
    reduce_dense_grads(block, group)
    reduce_replica_grads(block)
    return time.perf_counter() - t0


def _phase(blocks, group, steps: int, tokens: int, seed: int):
    """``steps`` training steps of each block, alternating, on the same tokens; per block (rows per
    rank, step times). Alternating keeps load changes on this shared machine out of the ratio."""
    gen = torch.Generator().manual_seed(seed)
    times = [[] for _ in blocks]
    for block in blocks:
        block.expert_rows.zero_()
    for _ in range(steps):
        x = torch.randn(tokens // SEQ, SEQ, HIDDEN, generator=gen)
        for block, t in zip(blocks, times):
            t.append(_train_step(block, group, x))
    return [(_rank_rows(block, group), t) for block, t in zip(blocks, times)]


def _rank(rank: int, world: int, args) -> dict:
    from twinpipe.eplb import Balancer, rebalance_experts
    from twinpipe.moe import MoEBlock, plan_moves

    ep = world
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(1)
    zipf = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64) ** args.zipf
    popularity = zipf[torch.randperm(EXPERTS, generator=gen)]
    out = {}
    for extra in (0, 8, 16):
        slots = EXPERTS + extra
        uniform = rebalance_experts(torch.ones(1, EXPERTS), slots, 1, 1, ep)[0][0]
        blocks, gens = [], []
        for _ in range(2):  # kept on the old placement / rebalanced
            torch.manual_seed(0)
            blocks.append(MoEBlock(HIDDEN, 4, EXPERTS, TOP_K, args.width, score="softmax").shard_experts_(group, uniform))
            gens.append(_zipf_router(blocks[-1].router, popularity, seed=100 + rank))
        old, block = blocks
        balancer = Balancer(block, interval=args.steps, window=args.steps, threshold=1.0)
        _phase([block], group, args.steps, args.tokens, seed=10 + rank)  # loads to balance on
        # the routed counters were left by the phase: one record for the whole phase
        balancer.loads.record()
        weight = balancer.loads.window_sum()[0]
        unaware = rebalance_experts(weight[None].double(), slots, 1, 1, ep)[0][0]
        dist.barrier(group)
        start = time.perf_counter()
        report = balancer.rebalance()
        rebalance_s = time.perf_counter() - start
        for g in gens:  # both blocks route the same fresh tokens alike
            g.manual_seed(200 + rank)
        (rows0, t0), (rows1, t1) = _phase([old, block], group, args.steps, args.tokens, seed=20 + rank)
        layer = report.layers[0]
        size = layer.move.bytes_all // slots if layer.move else 0
        out[extra] = dict(rows0=rows0, rows1=rows1, t0=t0, t1=t1, predicted=(layer.before, layer.after),
                          sent=layer.move.bytes_sent if layer.move else 0, all=size * slots,
                          unaware=size * len(plan_moves(uniform, unaware, ep).transfers),
                          transfers=layer.move.transfers if layer.move else 0, rebalance_s=rebalance_s,
                          copies=layer.move.local_copies if layer.move else 0)
    return out


def _ratio(rows: torch.Tensor) -> float:
    rows = rows.double()
    return float(rows.max() / rows.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps before and after the rebalance")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step per EP rank (multiple of 16)")
    parser.add_argument("--ep", type=int, default=4, choices=(2, 4), help="expert-parallel ranks (processes)")
    parser.add_argument("--width", type=int, default=256, help="hidden width of each expert")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of expert popularity")
    args = parser.parse_args()
    results = dict(enumerate(run_local(args.ep, _rank, args, timeout=900)))
    med = statistics.median
    print(f"EPLB in the loop: {EXPERTS} experts, top-{TOP_K}, Zipf {args.zipf:g} popularity, EP={args.ep} "
          f"({args.ep} CPU processes, gloo, {os.cpu_count()} cores), {args.tokens} tokens/rank/step, "
          f"{args.steps} steps before and after; hidden {HIDDEN}, expert width {args.width}")
    print("redundant | max/mean rank load before -> after (predicted) | step ms before -> after (after/before) "
          "| moved: experts sent, local copies, bytes, rebalance time (slowest rank); vs every expert; "
          "vs placement without previous")
    for extra, r in results[0].items():
        before = max(med(results[k][extra]["t0"]) for k in results) * 1e3
        after = max(med(results[k][extra]["t1"]) for k in results) * 1e3
        b, a = r["predicted"]
        moved = f"{r['transfers']} sent, {r['copies']} copies, {r['sent'] / 1e3:.0f} kB in {max(results[k][extra]['rebalance_s'] for k in results) * 1e3:.0f} ms"
        print(f"{extra:9d} | {_ratio(r['rows0']):.3f} -> {_ratio(r['rows1']):.3f} ({b:.3f} -> {a:.3f}) "
              f"| {before:.1f} -> {after:.1f} ({after / before:.2f}) | {moved}; "
              f"{r['sent'] / r['all']:.2f} of {r['all'] / 1e3:.0f} kB; "
              f"{r['unaware'] / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
