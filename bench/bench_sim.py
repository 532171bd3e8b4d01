"""Time the pure-Python schedule tools on large pipelines and print medians.

Targets (issue 3): the zb-auto grid search at p=32, m=256 and a DualPipe simulation at p=64,
m=512 each under 1 s.

    PYTHONPATH=src python bench/bench_sim.py            # 5 repeats
    PYTHONPATH=src python bench/bench_sim.py --repeats 11
"""

from __future__ import annotations

import argparse
import statistics
import time

from twinpipe.schedule.registry import build
from twinpipe.sim import simulate


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    dualpipe = build("dualpipe", 64, 512)
    cases = [
        ("zb-auto p=32 m=256: build (grid over 8 heuristics)", lambda: build("zb-auto", 32, 256), 1.0),
        ("dualpipe p=64 m=512: simulate", lambda: simulate(dualpipe), 1.0),
        ("dualpipe p=64 m=512: build", lambda: build("dualpipe", 64, 512), None),
        ("zbv p=16 m=64: build (grid over 4 settings)", lambda: build("zbv", 16, 64), None),
        ("1f1b p=64 m=512: build + simulate", lambda: simulate(build("1f1b", 64, 512)), None),
    ]
    ops = sum(len(rank_ops) for rank_ops in dualpipe.ops)
    print(f"median of {args.repeats} runs (dualpipe p=64 m=512 has {ops} ops)")
    for label, fn, target in cases:
        seconds = _median_seconds(fn, args.repeats)
        verdict = "" if target is None else ("  ok (< %gs)" % target if seconds < target else "  SLOW (target %gs)" % target)
        print(f"  {label:55s} {seconds * 1000:8.1f} ms{verdict}")


if __name__ == "__main__":
    main()
