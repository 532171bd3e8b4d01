"""Time the pure-Python schedule tools on large pipelines and print medians.

Targets (issue 3): the zb-auto grid search at p=32, m=256 and a DualPipe simulation at p=64,
m=512 each under 1 s.

    PYTHONPATH=src python bench/bench_sim.py            # 5 repeats
    PYTHONPATH=src python bench/bench_sim.py --repeats 11

Against another version of the code (e.g. before a change), measured in the same run: child
processes alternate between the two source trees, and each case prints the median of the
per-round ratios this tree / baseline.

    git archive HEAD~3 src | tar -x -C /tmp/base
    PYTHONPATH=src python bench/bench_sim.py --baseline /tmp/base/src --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cases():
    """(label, function, target seconds or None); uses only APIs every version has."""
    from twinpipe.schedule.registry import build
    from twinpipe.sim import simulate, summarize

    dualpipe = build("dualpipe", 64, 512)
    return [
        ("zb-auto p=32 m=256: build (grid over 8 heuristics)", lambda: build("zb-auto", 32, 256), 1.0),
        ("dualpipe p=64 m=512: simulate", lambda: simulate(dualpipe), 1.0),
        ("dualpipe p=64 m=512: summarize (the planner's path)", lambda: summarize(dualpipe, check=False), None),
        ("dualpipe p=64 m=512: build", lambda: build("dualpipe", 64, 512), None),
        ("zbv p=16 m=64: build (grid over 4 settings)", lambda: build("zbv", 16, 64), None),
        ("v-min p=8 m=64: build", lambda: build("v-min", 8, 64), None),
        ("1f1b p=64 m=512: build + simulate", lambda: simulate(build("1f1b", 64, 512)), None),
    ], sum(len(rank_ops) for rank_ops in dualpipe.ops)


def _run_child(case: int, repeats: int) -> None:
    cases, _ = _cases()
    label, fn, _ = cases[case]
    print(json.dumps([label, _median_seconds(fn, repeats)]))


def _compare(baseline: str, rounds: int, repeats: int) -> None:
    """Each round runs every case once per tree, alternating trees case by case (load drifts)."""
    here = str(Path(__file__).resolve().parents[1] / "src")
    trees = {"this": here, "baseline": baseline}
    times: dict[str, dict[str, list[float]]] = {tag: {} for tag in trees}
    num_cases = len(_cases()[0])
    for _ in range(rounds):
        for case in range(num_cases):
            for tag, tree in trees.items():
                env = dict(os.environ, PYTHONPATH=tree)
                out = subprocess.run([sys.executable, __file__, "--child", str(case), "--repeats", str(repeats)], env=env,
                                     capture_output=True, text=True, check=True).stdout
                label, seconds = json.loads(out)
                times[tag].setdefault(label, []).append(seconds)
    print(f"{rounds} rounds alternating the trees case by case, median of {repeats} runs each; baseline {baseline}")
    for label, mine in times["this"].items():
        base = times["baseline"][label]
        ratio = statistics.median(a / b for a, b in zip(mine, base))
        print(f"  {label:55s} {statistics.median(mine) * 1000:8.1f} ms vs {statistics.median(base) * 1000:8.1f} ms   this/baseline {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", metavar="SRC", help="another source tree (its src/ folder) to compare with")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds with --baseline (default 7)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _run_child(args.child, args.repeats)
        return
    if args.baseline:
        _compare(args.baseline, args.rounds, args.repeats)
        return
    cases, ops = _cases()
    print(f"median of {args.repeats} runs (dualpipe p=64 m=512 has {ops} ops)")
    for label, fn, target in cases:
        seconds = _median_seconds(fn, args.repeats)
        verdict = "" if target is None else ("  ok (< %gs)" % target if seconds < target else "  SLOW (target %gs)" % target)
        print(f"  {label:55s} {seconds * 1000:8.1f} ms{verdict}")


if __name__ == "__main__":
    main()
