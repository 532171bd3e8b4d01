"""How much all-to-all time the part-level F&B overlap hides: CPU, gloo, 2 processes (EP=2).

For each point of a sweep (tokens per micro-batch, hidden size, expert width, top-k) one F&B op
of a 2-block MoE stage runs with the overlap and as F then B (alternating, same run), and prints
the medians: T_seq, T_overlap, T_comm (the same all-to-alls run alone, each after an untimed
barrier: the communication there is to hide), comm/cmp (T_comm over the sequential run's
compute), the fraction of T_comm hidden, (T_seq - T_overlap) / T_comm, the step-time ratio
T_overlap / T_seq, "in-run" (the comm parts' time inside the sequential run, waits for the
slower peer included) and the F&B time ``twinpipe.sim.overlap.predict_fb`` predicts from the
sequential run's compute part times with, for the comm parts, their in-run times or their times
alone. ``--e2e`` adds a DualPipeV step on PP=2 x EP=2 (4 processes), overlap on vs off.
``--draw PATH`` draws rank 0's steps of one overlapped F&B op (matplotlib).

    python bench/bench_overlap.py [--reps 9] [--e2e] [--draw docs/img/moe-overlap-pair.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from twinpipe.launch import run_local

# (tokens per micro-batch, hidden, expert width, top-k): communication grows with
# tokens*hidden*top_k, expert compute with tokens*hidden*width*top_k, attention with tokens*hidden^2.
# The last two points send 8 copies of each token to 4-wide experts: as comm-heavy as this model gets.
POINTS = [(4096, 32, 16, 2), (2048, 64, 32, 2), (1024, 64, 128, 2), (1024, 128, 512, 2), (2048, 128, 512, 2),
          (1024, 256, 4, 8), (2048, 256, 4, 8)]
SEQ, EXPERTS, HEADS, BLOCKS = 16, 8, 4, 2


def _stage(hidden: int, width: int, top_k: int, group):
    from twinpipe.moe import MoEBlock, MoEStage

    return MoEStage([MoEBlock(hidden, HEADS, EXPERTS, top_k, width, shared_hidden=width, ep_group=group) for _ in range(BLOCKS)])


def _comm_time(events) -> float:
    starts = {(s, n): t0 for a, s, n, t0, _ in events if a == "start"}
    return sum(t1 - starts[(s, n)] for a, s, n, _, t1 in events if a == "wait")


def _part_times(events):
    """(kind, seconds) per F part and per B part, and the W times, from a sequential run."""
    f, b, w, started = [], [], {}, {}
    for a, s, n, t0, t1 in events:
        if a == "start":
            started[(s, n)] = t0
        elif a == "wait":
            (f if s == "F" else b).append(("comm", t1 - started[(s, n)]))
        elif s == "W":
            w[len(b) - 1] = t1 - t0
        else:
            (f if s == "F" else b).append(("compute", t1 - t0))
    return f, b, [w.get(i, 0.0) for i in range(len(b))]


def _a2a_alone(tokens: int, hidden: int, top_k: int, group) -> tuple[list[float], list[float]]:
    """The all-to-alls of one F&B op run alone (same sizes, even splits), each after a barrier
    that is not timed: the communication there is to hide, without waits for a slower peer.
    Seconds per call, in the order of the F stream's comm parts (per block: counts, dispatch,
    combine) and of the B stream's (per block: combine, dispatch)."""
    payload, counts = torch.randn(tokens * top_k, hidden), torch.zeros(EXPERTS, dtype=torch.long)
    calls = {"counts": (torch.empty_like(counts), counts), "rows": (torch.empty_like(payload), payload)}

    def timed(what: str) -> float:
        dist.barrier(group)
        t0 = time.perf_counter()
        dist.all_to_all_single(*calls[what], group=group)
        return time.perf_counter() - t0

    f_comm, b_comm = [], []
    for _ in range(BLOCKS):
        f_comm += [timed("counts"), timed("rows"), timed("rows")]
        b_comm += [timed("rows"), timed("rows")]
    return f_comm, b_comm


def _with_comm(parts, comm_times):
    """``parts`` with its comm parts' times replaced, in order, by ``comm_times``."""
    it = iter(comm_times)
    return [(k, next(it) if k == "comm" else t) for k, t in parts]


def _fb_once(stages, x0, x1, g1, overlap: bool, group):
    from twinpipe.overlap import forward_backward

    out1 = stages[1](x1.clone().requires_grad_())
    dist.barrier(group)
    t0 = time.perf_counter()
    _, _, events = forward_backward(stages[0], [x0], None, [], stages[1], None, [out1], [g1], overlap=overlap)
    return time.perf_counter() - t0, events


def _sweep(rank: int, reps: int, draw: str | None):
    from twinpipe.sim.overlap import predict_fb

    group = dist.group.WORLD
    rows = []
    drawn = None
    for tokens, hidden, width, top_k in POINTS:
        torch.manual_seed(rank)
        stages = [_stage(hidden, width, top_k, group) for _ in range(2)]
        x0, x1 = (torch.randn(tokens // SEQ, SEQ, hidden) for _ in range(2))
        g1 = torch.randn(tokens // SEQ, SEQ, hidden)
        seq, ovl, comm, alone, preds = [], [], [], [], []
        for i in range(reps + 1):  # the first round warms up
            t_s, ev_s = _fb_once(stages, x0, x1, g1, False, group)
            t_o, ev_o = _fb_once(stages, x0, x1, g1, True, group)
            for st in stages:
                st.zero_grad(set_to_none=True)
            if i:
                seq.append(t_s)
                ovl.append(t_o)
                comm.append(_comm_time(ev_s))
                f_comm, b_comm = _a2a_alone(tokens, hidden, top_k, group)
                alone.append(sum(f_comm) + sum(b_comm))
                f, b, w = _part_times(ev_s)
                preds.append((predict_fb(f, b, w), predict_fb(_with_comm(f, f_comm), _with_comm(b, b_comm), w)))
                if draw and (tokens, hidden, width, top_k) == POINTS[3]:
                    drawn = ev_o
        m = statistics.median
        rows.append((tokens, hidden, width, top_k, m(seq), m(ovl), m(comm), m(alone), m(p[0] for p in preds), m(p[1] for p in preds)))
    return rows, drawn


def _e2e(rank: int, reps: int):
    """A DualPipeV step on PP=2 x EP=2, overlap on vs off (alternating); medians in seconds."""
    import twinpipe
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    tokens, hidden, width = 1024, 128, 512
    torch.manual_seed(0)
    modules = [_stage(hidden, width, 2, mesh["ep"].get_group()) for _ in range(2)]
    pipe = twinpipe.DualPipeV(modules, process_group=mesh["pp"].get_group())
    chunks = 8
    x = torch.randn(chunks * tokens // SEQ, SEQ, hidden)
    first = pipe.rank == 0
    times = {True: [], False: []}
    for i in range(reps + 1):
        for overlap in (False, True):
            for m in modules:
                m.overlap = overlap
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(*((x,) if first else ()), num_chunks=chunks,
                      criterion=(lambda o, y: torch.nn.functional.mse_loss(o, y)) if first else None,
                      labels=(x,) if first else ())
            if i:
                times[overlap].append(time.perf_counter() - t0)
            for m in modules:
                m.zero_grad(set_to_none=True)
    return statistics.median(times[False]), statistics.median(times[True])


def _worker(rank, world, mode, reps, draw):
    return _sweep(rank, reps, draw) if mode == "sweep" else _e2e(rank, reps)


def _run(world: int, mode: str, reps: int, draw: str | None):
    return dict(enumerate(run_local(world, _worker, mode, reps, draw, timeout=1800)))


def _draw(events, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = events[0][3]
    colors = {"F": "#4c72b0", "B": "#55a868", "W": "#8c8c8c"}
    fig, ax = plt.subplots(figsize=(12, 2.4))
    started = {}
    for action, stream, name, t0, t1 in events:
        a, b = (t0 - origin) * 1e3, (t1 - origin) * 1e3
        if action == "run":
            ax.broken_barh([(a, b - a)], (1, 0.8), color=colors[stream], edgecolor="white")
            if b - a > 0.04 * ((events[-1][4] - origin) * 1e3):
                ax.text((a + b) / 2, 1.4, f"{name.split('.')[-1]}\n({stream})", ha="center", va="center", fontsize=7, color="white")
        elif action == "start":
            started[(stream, name)] = a
        else:
            s = started[(stream, name)]
            y = 0.05 if stream == "F" else 0.5
            ax.broken_barh([(s, b - s)], (y, 0.4), color=colors[stream], alpha=0.6, edgecolor="white")
            ax.text((s + b) / 2, y + 0.2, f"{name.split('.')[-1]}({stream})", ha="center", va="center", fontsize=7)
    ax.set_yticks([0.45, 1.4], ["communication\n(in flight)", "compute"])
    ax.set_xlabel("ms (rank 0 of EP=2, CPU/gloo)")
    ax.set_title("One overlapped F&B op: forward of one micro-batch (F) against the backward (B, W) of another")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--e2e", action="store_true", help="also a DualPipeV step on PP=2 x EP=2 (4 processes)")
    ap.add_argument("--draw", help="PNG of rank 0's steps in one overlapped F&B op (the 1024-token, hidden-128, width-512 point)")
    args = ap.parse_args()
    results = _run(2, "sweep", args.reps, args.draw)
    print(f"F&B op of a {BLOCKS}-block MoE stage, EP=2 on 2 gloo processes, {os.cpu_count()} CPU cores, "
          f"1 compute thread each; medians of {args.reps}; times in ms")
    print(f"{'tokens':>6} {'hidden':>6} {'width':>5} {'k':>3} | {'T_seq':>7} {'T_ovl':>7} {'T_comm':>7} {'comm/cmp':>8} | "
          f"{'hidden%':>7} {'T_ovl/T_seq':>11} | {'in-run':>7} {'pred(in-run)':>12} {'pred(alone)':>11}")
    for rank in sorted(results):
        rows, _ = results[rank]
        for tokens, hidden, width, top_k, seq, ovl, in_run, comm, pred, pred_alone in rows:
            print(f"{tokens:>6} {hidden:>6} {width:>5} {top_k:>3} | {seq * 1e3:7.2f} {ovl * 1e3:7.2f} {comm * 1e3:7.2f} "
                  f"{comm / max(seq - in_run, 1e-9):8.2f} | {100 * (seq - ovl) / comm:6.0f}% {ovl / seq:11.3f} | "
                  f"{in_run * 1e3:7.2f} {pred * 1e3:12.2f} {pred_alone * 1e3:11.2f}   (rank {rank})")
    if args.draw:
        _draw(results[0][1], args.draw)
        print(f"drew {args.draw}")
    if args.e2e:
        e2e = _run(4, "e2e", args.reps, None)
        off, on = max(v[0] for v in e2e.values()), max(v[1] for v in e2e.values())
        print(f"DualPipeV step, PP=2 x EP=2 (4 processes), 8 micro-batches of 1024 tokens, hidden 128: "
              f"overlap off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms, ratio on/off {on / off:.3f} (slowest rank's median)")


if __name__ == "__main__":
    main()
