"""Time drawing a 64-rank x 512-micro-batch DualPipe timeline (target: PNG under 10 s).

Simulation is timed separately: the target is the renderer's. Pictures go to a temporary folder
unless --out is given.

    PYTHONPATH=src python bench/bench_draw.py
    PYTHONPATH=src python bench/bench_draw.py --repeats 3 --out /tmp/draw
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from twinpipe.schedule.registry import build
from twinpipe.sim import simulate
from twinpipe.viz import draw_timeline

TARGET_S = 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="keep the pictures here")
    args = parser.parse_args()

    start = time.perf_counter()
    timeline = simulate(build("dualpipe", 64, 512))
    ops = sum(1 for s in timeline.slices if s.op is not None)
    print(f"dualpipe p=64 m=512: {ops} ops, {len(timeline.slices) - ops} waits; build + simulate {time.perf_counter() - start:.2f} s")
    draw_timeline(simulate(build("1f1b", 2, 2)))  # import matplotlib outside the timed runs
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        for suffix in ("png", "svg"):
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                draw_timeline(timeline, out / f"dualpipe-64x512.{suffix}")
                times.append(time.perf_counter() - start)
            size = (out / f"dualpipe-64x512.{suffix}").stat().st_size
            verdict = ("ok" if statistics.median(times) < TARGET_S else "SLOW") + f" (target {TARGET_S:g} s)" if suffix == "png" else ""
            print(f"  draw {suffix}: median {statistics.median(times):.2f} s of {args.repeats} ({size / 1e6:.1f} MB)  {verdict}")


if __name__ == "__main__":
    main()
