"""bf16-mixed against pure bf16 (and FP32): the loss curve of the same run in each precision.

One world of ``pp x dp`` gloo processes builds three trainers of the same byte-level GPT on Python's
standard library (the same seed, data, AdamW and clipping): ``precision="pure"`` in float32 (the
baseline), ``precision="pure"`` in bfloat16 (weights, gradients and AdamW state in bf16: today's
``--dtype bfloat16``) and ``precision="bf16-mixed"`` (bf16 compute, FP32 masters, gradients and
state). They step in turns. It writes the three curves (bits per byte, a running mean) to
``--out`` and prints the mean loss of the last ``--tail`` steps of each.

    python bench/bench_precision.py [--steps 600] [--lr 3e-4] [--out docs/img/precision-loss.png]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

import torch

from twinpipe.launch import run_local

RUNS = (("float32", "pure", torch.float32), ("bf16 (pure)", "pure", torch.bfloat16), ("bf16-mixed", "bf16-mixed", None))


def _worker(rank: int, world: int, args) -> dict:
    from twinpipe.train import GPT, GPTConfig, TrainConfig, Trainer, build_mesh, lm_loss
    from twinpipe.train.data import BatchSampler, stdlib_corpus

    cfg = GPTConfig(seq_len=args.seq_len, dim=args.dim, heads=4, layers=args.layers)
    sampler = BatchSampler(stdlib_corpus(4 << 20), cfg.seq_len, seed=args.seed)
    mesh = build_mesh(args.dp, args.pp)
    trainers = {}
    for label, mode, dtype in RUNS:
        config = TrainConfig(schedule=args.schedule, batch_size=args.batch_size, microbatch_size=args.microbatch_size, max_norm=1.0,
                             precision=mode, seed=args.seed)
        trainers[label] = Trainer(lambda: GPT(cfg), sampler, lm_loss,
                                  lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.01), mesh, config, dtype=dtype)
    losses = {label: [] for label in trainers}
    for step in range(args.steps):
        for label, trainer in trainers.items():
            losses[label].append(trainer.step(step).loss)
    return losses


def _plot(losses: dict, path: str, title: str, window: int) -> None:
    """Top: each run's loss (a running mean); bottom: each run's loss minus float32's (the same steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values):
        bpb = [v / math.log(2) for v in values]
        return [statistics.fmean(bpb[max(0, i - window + 1) : i + 1]) for i in range(len(bpb))]

    curves = {label: smooth(values) for label, values in losses.items()}
    base = curves[RUNS[0][0]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), dpi=120, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for (label, curve), color in zip(curves.items(), ("#555555", "#d62728", "#1f77b4")):
        top.plot(range(len(curve)), curve, color=color, linewidth=2 if label == "bf16-mixed" else 1.5, label=label)
        if label != RUNS[0][0]:
            bottom.plot(range(len(curve)), [c - b for c, b in zip(curve, base)], color=color, linewidth=1.5, label=label)
    bottom.axhline(0.0, color="#555555", linewidth=1)
    top.set_ylabel(f"loss, bits per byte\n({window}-step mean)")
    bottom.set_ylabel("minus float32's")
    bottom.set_xlabel("step")
    top.set_title(title, fontsize=9)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="dualpipev")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tail", type=int, default=50, help="steps at the end whose mean loss is printed")
    parser.add_argument("--out", default="precision-loss.png")
    args = parser.parse_args()
    losses = run_local(args.pp * args.dp, _worker, args, timeout=7200)[0]
    title = (f"{args.schedule} PP={args.pp} x DP={args.dp}, GPT dim={args.dim} layers={args.layers}, AdamW lr={args.lr:g}, "
             f"{args.batch_size}x{args.seq_len} bytes/step")
    _plot(losses, args.out, title, window=20)
    print(f"{title}; {os.cpu_count()} CPU cores")
    print(f"mean loss of the last {args.tail} of {args.steps} steps (bits per byte):")
    for label, values in losses.items():
        print(f"  {label:<12} {statistics.fmean(values[-args.tail:]) / math.log(2):.4f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
