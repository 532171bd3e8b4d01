"""Tokens/s of training per schedule on the same model and machine, in one run.

One world of ``pp x dp`` processes builds a trainer per schedule (the same byte-level GPT, the same
data, AdamW, clipping on) and runs them in turns: ``--rounds`` rounds of ``--steps`` steps each,
so a busy machine slows every schedule alike. It prints, per schedule, the median step time and
tokens/s, the ratio to the first schedule (the baseline, measured in the same run), and the median
time inside the pipeline step, in DualPipe's mirrored-gradient exchange, in the data-parallel
all-reduce and in the update (norms, losses, clipping, optimizer).

With ``--overlap-compare`` each schedule runs twice in the same turns, with the data-parallel
reduction started inside the pipeline step (``overlap_dp=True``, "+ov") and after it ("-ov"), and a
second table gives the tokens/s ratio on/off per schedule (mirrored-copy schedules never overlap:
their ratio shows the noise).

    python bench/bench_train.py [--pp 2 --dp 2] [--schedules 1f1b,zb-h1,dualpipev,dualpipe] [--rounds 4 --steps 8] [--overlap-compare]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from twinpipe.launch import run_local


def _worker(rank: int, world: int, args) -> dict:
    from twinpipe.train import GPT, GPTConfig, TrainConfig, Trainer, build_mesh, lm_loss
    from twinpipe.train.data import BatchSampler, stdlib_corpus

    cfg = GPTConfig(seq_len=args.seq_len, dim=args.dim, heads=4, layers=args.layers)
    sampler = BatchSampler(stdlib_corpus(1 << 20), cfg.seq_len)
    mesh = build_mesh(args.dp, args.pp)
    trainers = {}
    variants = ((True, "+ov"), (False, "-ov")) if args.overlap_compare else ((True, ""),)
    for name in args.schedules.split(","):
        for overlap, suffix in variants:
            config = TrainConfig(schedule=name, batch_size=args.batch_size, microbatch_size=args.microbatch_size, max_norm=1.0,
                                 overlap_dp=overlap)
            trainers[name + suffix] = Trainer(lambda: GPT(cfg), sampler, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-3), mesh, config)
    times = {name: {} for name in trainers}
    step = 0
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for name, trainer in trainers.items():
            for _ in range(args.steps):
                result = trainer.step(step)
                step += 1
                if rnd:
                    for key, value in result.times.items():
                        times[name].setdefault(key, []).append(value)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="1f1b,zb-h1,dualpipev,dualpipe")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="steps per schedule per round")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--overlap-compare", action="store_true", help="each schedule with overlap_dp on and off; ratio table")
    args = parser.parse_args()
    world = args.pp * args.dp
    times = run_local(world, _worker, args, timeout=1800)[0]
    tokens = args.batch_size * args.seq_len
    print(f"PP={args.pp} x DP={args.dp} on {os.cpu_count()} CPU cores (gloo), GPT dim={args.dim} layers={args.layers}, "
          f"{tokens} tokens/step, {args.rounds} rounds x {args.steps} steps per schedule; medians")
    header = f"{'schedule':<14} {'step ms':>8} {'tokens/s':>9} {'vs base':>8} {'pipeline':>9} {'mirror':>8} {'DP':>8} {'update':>8}"
    print(header)
    base = None
    for name, t in times.items():
        med = {k: statistics.median(v) for k, v in t.items()}
        tps = tokens / med["total"]
        base = base or tps
        print(f"{name:<14} {med['total'] * 1e3:8.1f} {tps:9.0f} {tps / base:8.2f} {med['pipeline'] * 1e3:9.1f} "
              f"{med['mirror'] * 1e3:8.2f} {med['dp'] * 1e3:8.2f} {med['update'] * 1e3:8.2f}")
    print("(ms; 'mirror': the mirrored copies' exchange; 'DP': the bucketed all-reduce across replicas, with +ov only the wait after the pipeline step)")
    if args.overlap_compare:
        print(f"\n{'schedule':<11} {'tokens/s on/off':>16} {'min':>6} {'max':>6}   (per-round medians: min, max of the round ratios)")
        for name in args.schedules.split(","):
            on, off = times[name + "+ov"]["total"], times[name + "-ov"]["total"]
            ratio = statistics.median(off) / statistics.median(on)
            per = args.steps
            rounds = [statistics.median(off[i:i + per]) / statistics.median(on[i:i + per]) for i in range(0, len(on), per)]
            print(f"{name:<11} {ratio:16.3f} {min(rounds):6.3f} {max(rounds):6.3f}")


if __name__ == "__main__":
    main()
