"""ZeRO-1 against replicated optimizer state: bytes per rank and step time, DP=2 and DP=4 on CPU ranks.

For each data-parallel size, one world of ``pp x dp`` gloo processes builds two trainers of the same
byte-level GPT (AdamW, clipping on, ``--precision``), ``zero=0`` and ``zero=1``, and runs them in
turns (``--rounds`` rounds of ``--steps`` steps each, round 0 a warm-up), so a busy machine slows
both alike. It prints, per rank, the optimizer state's bytes and (bf16-mixed) the FP32 masters'
(``Trainer.state_bytes``, after the first step: AdamW builds its state then), with ZeRO-1's ratio to
replicated measured in the same run; and the median step time of each, with the time in the
data-parallel reduction (ZeRO-1: the reduce-scatter) and in the update. A third trainer, ZeRO-1 with
the all-gather of the updated weights awaited inside ``step()`` (``Trainer.defer_gather = False``, the
eager order), gives the deferred all-gather's (awaited by each stage's next forward: the default)
ratio to the eager one, measured in the same run.

    python bench/bench_zero.py [--dps 2,4] [--pp 1] [--precision bf16-mixed] [--rounds 3 --steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from twinpipe.launch import run_local


def _worker(rank: int, world: int, args, dp: int) -> dict:
    from twinpipe.train import GPT, GPTConfig, TrainConfig, Trainer, build_mesh, lm_loss
    from twinpipe.train.data import BatchSampler, stdlib_corpus

    cfg = GPTConfig(seq_len=args.seq_len, dim=args.dim, heads=4, layers=args.layers)
    sampler = BatchSampler(stdlib_corpus(1 << 20), cfg.seq_len)
    mesh = build_mesh(dp, args.pp)
    trainers = {}
    for key, zero in ((0, 0), (1, 1), ("eager", 1)):
        config = TrainConfig(schedule=args.schedule, batch_size=args.batch_size, microbatch_size=args.microbatch_size, max_norm=1.0,
                             precision=args.precision, zero=zero)
        trainers[key] = Trainer(lambda: GPT(cfg), sampler, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-3), mesh, config)
    trainers["eager"].defer_gather = False  # ZeRO-1 with the all-gather awaited inside step()
    times = {zero: {} for zero in trainers}
    step = 0
    for rnd in range(args.rounds + 1):  # round 0 warms up (and builds AdamW's state)
        for zero, trainer in trainers.items():
            for _ in range(args.steps):
                result = trainer.step(step)
                step += 1
                if rnd:
                    for key, value in result.times.items():
                        times[zero].setdefault(key, []).append(value)
    return {"bytes": {zero: t.state_bytes() for zero, t in trainers.items()}, "times": times}


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dps", default="2,4", help="data-parallel sizes, one world each (default: 2,4)")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--precision", default="pure", choices=("pure", "bf16-mixed"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per trainer per round")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(f"GPT dim={args.dim} layers={args.layers}, {args.schedule} PP={args.pp}, precision={args.precision}, AdamW; "
          f"{os.cpu_count()} CPU cores (gloo); {args.rounds} rounds x {args.steps} steps per trainer, medians")
    for dp in (int(d) for d in args.dps.split(",")):
        if args.batch_size % (dp * args.microbatch_size):
            raise SystemExit(f"--batch-size={args.batch_size}: must be a multiple of dp={dp} x --microbatch-size={args.microbatch_size}")
        ranks = run_local(dp * args.pp, _worker, args, dp, timeout=3600)
        print(f"\nDP={dp} x PP={args.pp}")
        print(f"{'rank':>4} {'optimizer MiB z0':>17} {'z1':>8} {'z1/z0':>6} {'master MiB z0':>14} {'z1':>8}")
        totals = [0, 0]
        for r, out in enumerate(ranks):
            b0, b1 = out["bytes"][0], out["bytes"][1]
            totals[0] += b0["optimizer"] + b0["master"]
            totals[1] += b1["optimizer"] + b1["master"]
            print(f"{r:>4} {_mib(b0['optimizer']):>17} {_mib(b1['optimizer']):>8} {b1['optimizer'] / b0['optimizer']:6.3f} "
                  f"{_mib(b0['master']):>14} {_mib(b1['master']):>8}")
        print(f"all ranks, optimizer + masters: {_mib(totals[0])} MiB replicated, {_mib(totals[1])} MiB ZeRO-1 "
              f"({totals[1] / totals[0]:.3f}; 1/dp = {1 / dp:.3f})")
        t = ranks[0]["times"]
        med = {z: {k: statistics.median(v) for k, v in t[z].items()} for z in t}
        print(f"rank 0 step ms: replicated {med[0]['total'] * 1e3:.1f} (DP reduction {med[0]['dp'] * 1e3:.1f}, update "
              f"{med[0]['update'] * 1e3:.1f}); ZeRO-1 {med[1]['total'] * 1e3:.1f} (reduce-scatter {med[1]['dp'] * 1e3:.1f}, "
              f"update {med[1]['update'] * 1e3:.1f}); ZeRO-1 / replicated {med[1]['total'] / med[0]['total']:.3f}")
        print(f"{'rank':>4} {'ZeRO-1 eager ms':>16} {'update+gather':>14} {'deferred ms':>12} {'update':>7} {'deferred/eager':>15}")
        for r, out in enumerate(ranks):
            m = {z: {k: statistics.median(v) for k, v in out["times"][z].items()} for z in ("eager", 1)}
            print(f"{r:>4} {m['eager']['total'] * 1e3:>16.1f} {m['eager']['update'] * 1e3:>14.1f} {m[1]['total'] * 1e3:>12.1f} "
                  f"{m[1]['update'] * 1e3:>7.1f} {m[1]['total'] / m['eager']['total']:>15.3f}")


if __name__ == "__main__":
    main()
