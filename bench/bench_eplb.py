"""Benchmark twinpipe.eplb against a straightforward per-layer greedy EPLB.

The baseline below is the reference algorithm written the plain way, structured like the reference:
the greedy packing loops in Python over layers and items with one small torch op per step;
replication loops over rounds with all layers at once; items are ordered by torch's default sort,
as in the reference. For each load pattern and layout it checks that the fast version gives
identical phy2log, log2phy and logcnt, reports median times and the speedup, and the balance (GPU
max/mean averaged over layers, worst layer in brackets) without EPLB, with the greedy, and with
refine=True.

    PYTHONPATH=src python bench/bench_eplb.py            # 58 x 256, R=288, P=32
    PYTHONPATH=src python bench/bench_eplb.py --quick    # fewer repeats
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from twinpipe.eplb import balance_report, rebalance_experts, replicas_to_move

# --------------------------------------------------------------------------- baseline


def baseline_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy largest-first packing, one layer at a time, one item at a time (as the reference)."""
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return torch.arange(n).repeat(rows, 1), torch.zeros(rows, n, dtype=torch.int64)
    pack_index = torch.full((rows, n), -1, dtype=torch.int64)
    rank_in_pack = torch.full((rows, n), -1, dtype=torch.int64)
    order = weight.sort(dim=-1, descending=True).indices  # the reference's sort, ties in its order
    for r in range(rows):
        loads = [0] * num_packs  # becomes float32 0-d tensors, as in the reference
        counts = [0] * num_packs
        for item in order[r]:
            open_packs = (p for p in range(num_packs) if counts[p] < per_pack)
            pack = min(open_packs, key=loads.__getitem__)  # first minimum
            pack_index[r, item] = pack
            rank_in_pack[r, item] = counts[pack]
            loads[pack] += weight[r, item]
            counts[pack] += 1
    return pack_index, rank_in_pack


def baseline_replicate(weight: torch.Tensor, num_replicas: int):
    """One copy per round to the largest load per copy; rows at once, as in the reference."""
    rows, n = weight.shape
    phy2log = torch.arange(num_replicas).repeat(rows, 1)
    rank = torch.zeros(rows, num_replicas, dtype=torch.int64)
    count = torch.ones(rows, n, dtype=torch.int64)
    ar = torch.arange(rows)
    for i in range(n, num_replicas):
        best = (weight / count).max(dim=-1).indices
        phy2log[:, i] = best
        rank[:, i] = count[ar, best]
        count[ar, best] += 1
    return phy2log, rank, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    return inv.scatter_(1, perm, torch.arange(perm.size(1)).expand_as(perm))


def baseline_rebalance(weight, num_replicas, num_groups, num_nodes, num_gpus):
    """Reference-semantics EPLB, per layer; returns (phy2log, log2phy, logcnt)."""
    weight = weight.float().cpu()
    if num_groups % num_nodes:
        num_groups = num_nodes = 1
    layers, experts = weight.shape
    group_size = experts // num_groups
    experts_per_node = experts // num_nodes
    slots_per_gpu = num_replicas // num_gpus

    group_load = weight.view(layers, num_groups, group_size).sum(-1)
    node, node_rank = baseline_packing(group_load, num_nodes)
    new_group = node * (num_groups // num_nodes) + node_rank
    log2mlog = (new_group[:, :, None] * group_size + torch.arange(group_size)).flatten(1)
    mlog2log = _inverse(log2mlog)

    node_weight = weight.gather(1, mlog2log).view(-1, experts_per_node)
    phy2mlog, phyrank, mlogcnt = baseline_replicate(node_weight, num_replicas // num_nodes)

    replica_load = (node_weight / mlogcnt).gather(1, phy2mlog)
    gpu, gpu_rank = baseline_packing(replica_load, num_gpus // num_nodes)
    slot2replica = _inverse(gpu * slots_per_gpu + gpu_rank)
    offset = (torch.arange(layers * num_nodes) % num_nodes * experts_per_node)[:, None]
    slot2mlog = (phy2mlog.gather(1, slot2replica) + offset).view(layers, -1)
    phy2log = mlog2log.gather(1, slot2mlog)
    phyrank = phyrank.gather(1, slot2replica).view(layers, -1)
    logcnt = mlogcnt.view(layers, -1).gather(1, log2mlog)

    width = int(logcnt.max())
    log2phy = torch.full((layers, experts * width), -1, dtype=torch.int64)
    log2phy.scatter_(1, phy2log * width + phyrank, torch.arange(num_replicas).expand(layers, -1))
    return phy2log, log2phy.view(layers, experts, width), logcnt


# --------------------------------------------------------------------------- benchmark


def make_loads(kind: str, layers: int, experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        return torch.rand(layers, experts, generator=gen) * 1000
    if kind == "lognormal":
        return torch.randn(layers, experts, generator=gen).exp() * 100
    raise ValueError(kind)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(quick: bool) -> list[dict]:
    layers, experts, replicas, gpus = 58, 256, 288, 32
    layouts = [("hierarchical", 8, 4), ("global", 8, 3)]
    base_repeats, fast_repeats = (1, 5) if quick else (3, 15)
    rows = []
    for kind in ("uniform", "lognormal"):
        weight = make_loads(kind, layers, experts, seed=0)
        for mode, groups, nodes in layouts:
            args = (weight, replicas, groups, nodes, gpus)
            ref = baseline_rebalance(*args)
            fast = rebalance_experts(*args)
            assert torch.equal(ref[0], fast[0]), "phy2log differs from the baseline"
            assert torch.equal(ref[2], fast[2]), "logcnt differs from the baseline"
            assert torch.equal(ref[1], fast[1]), "log2phy differs from the baseline"
            rebalance_experts(*args)  # warm-up
            t_base = median_time(lambda: baseline_rebalance(*args), base_repeats)
            t_fast = median_time(lambda: rebalance_experts(*args), fast_repeats)
            t_refine = median_time(lambda: rebalance_experts(*args, refine=True), max(3, fast_repeats // 3))
            refined = rebalance_experts(*args, refine=True)
            nodes_in_report = nodes if mode == "hierarchical" else 1
            greedy_rep = balance_report(weight, fast[0], gpus, nodes_in_report)
            refine_rep = balance_report(weight, refined[0], gpus, nodes_in_report)
            assert bool((refine_rep.gpu_after.per_layer <= greedy_rep.gpu_after.per_layer).all())
            rows.append(
                dict(
                    loads=kind,
                    mode=f"{mode} G={groups} N={nodes}",
                    t_base=t_base,
                    t_fast=t_fast,
                    t_refine=t_refine,
                    none=greedy_rep.gpu_before,
                    greedy=greedy_rep.gpu_after,
                    refined=refine_rep.gpu_after,
                    node=greedy_rep.node_after,
                    node_refined=refine_rep.node_after,
                )
            )
    return rows


def run_migration() -> list[dict]:
    """Replicas to move between two load windows (loads drift by ~20 %), with and without relabelling."""
    layers, experts, replicas, gpus = 58, 256, 288, 32
    rows = []
    for kind in ("uniform", "lognormal"):
        old = make_loads(kind, layers, experts, seed=1)
        gen = torch.Generator().manual_seed(2)
        new = old * (0.2 * torch.randn(layers, experts, generator=gen)).exp()
        for mode, groups, nodes in (("hierarchical", 8, 4), ("global", 8, 3)):
            layout = (replicas, groups, nodes, gpus)
            previous = rebalance_experts(old, *layout)[0]
            fresh = rebalance_experts(new, *layout)[0]
            start = time.perf_counter()
            aligned = rebalance_experts(new, *layout, previous_phy2log=previous)[0]
            elapsed = time.perf_counter() - start
            rows.append(
                dict(
                    loads=kind,
                    mode=f"{mode} G={groups} N={nodes}",
                    fresh=replicas_to_move(previous, fresh, gpus),
                    aligned=replicas_to_move(previous, aligned, gpus),
                    total=layers * replicas,
                    time=elapsed,
                )
            )
    return rows


def print_migration(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Replicas to move to a new placement (loads drift x exp(0.2 N(0,1)); greedy placement)")
    for col in ("loads", "layout", "plain", "previous_phy2log=", "time"):
        table.add_column(col, justify="left" if col in ("loads", "layout") else "right")
    for r in rows:
        table.add_row(
            r["loads"],
            r["mode"],
            f"{r['fresh']} / {r['total']}",
            f"{r['aligned']} / {r['total']}",
            f"{r['time'] * 1e3:.0f} ms",
        )
    Console(width=200).print(table)


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    def ratio(x):
        return f"{x.mean:.4f} ({x.worst:.3f})"

    table = Table(title="EPLB, 58 layers x 256 experts, R=288, P=32 (median times; GPU max/mean: mean (worst))")
    for col in ("loads", "layout", "baseline", "twinpipe", "speedup", "refine time",
                "no EPLB", "greedy", "refine", "node greedy", "node refine"):
        table.add_column(col, justify="left" if col in ("loads", "layout") else "right")
    for r in rows:
        table.add_row(
            r["loads"],
            r["mode"],
            f"{r['t_base'] * 1e3:.0f} ms",
            f"{r['t_fast'] * 1e3:.1f} ms",
            f"{r['t_base'] / r['t_fast']:.0f}x",
            f"{r['t_refine'] * 1e3:.0f} ms",
            ratio(r["none"]),
            ratio(r["greedy"]),
            ratio(r["refined"]),
            ratio(r["node"]) if r["node"] else "-",
            ratio(r["node_refined"]) if r["node_refined"] else "-",
        )
    Console(width=200).print(table)
    print("phy2log, log2phy and logcnt identical to the baseline in every row.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: steadier timings on a shared machine)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print_table(run(args.quick))
    print_migration(run_migration())
    return 0


if __name__ == "__main__":
    sys.exit(main())
