"""Measured vs predicted: time a schedule with the op costs a real run measured, and compare."""

from __future__ import annotations

from pathlib import Path

from twinpipe.schedule.ops import Schedule
from twinpipe.sim import CostModel, simulate
from twinpipe.timeline import Timeline
from twinpipe.trace.chrome import write_chrome_trace
from twinpipe.trace.costs import estimate_costs

__all__ = ["predict", "compare_numbers", "write_run_report"]


def predict(measured: Timeline, schedule: Schedule, costs: CostModel | None = None) -> Timeline:
    """Simulate ``schedule`` with ``costs`` (default: ``estimate_costs(measured)``), in seconds."""
    costs = estimate_costs(measured) if costs is None else costs
    predicted = simulate(schedule, costs)
    predicted.meta["time_unit"] = "s"
    predicted.name = f"{schedule.name} (predicted)"
    return predicted


def _shares(timeline: Timeline) -> tuple[float, float]:
    """Shares of the rank-summed spans (first op start to last op end) in ops and in waits."""
    stats = timeline.per_rank()
    spans = sum(st.span for st in stats)
    if spans <= 0:
        return 0.0, 0.0
    busy = sum(st.busy for st in stats)
    # Only the part of a wait inside its rank's span counts (not the final "drain sends").
    waited = sum(max(0.0, min(s.end, stats[s.rank].end) - max(s.start, stats[s.rank].start)) for s in timeline.slices if s.op is None)
    return busy / spans, waited / spans


def compare_numbers(measured: Timeline, predicted: Timeline, costs: CostModel) -> dict:
    """Bubble rates, makespans and the cost model, as plain numbers (times in seconds).

    ``measured_overhead`` is the share of the ranks' spans that is neither an op nor a receive
    wait (Python and send bookkeeping between ops); the simulator has no such time, so it is
    the first place to look when the measured bubble exceeds the predicted one.
    """
    busy, waited = _shares(measured)
    return {
        "schedule": measured.name,
        "ranks": measured.num_ranks,
        "microbatches": measured.num_microbatches,
        "measured_bubble_rate": measured.bubble_rate,
        "predicted_bubble_rate": predicted.bubble_rate,
        "measured_makespan_s": measured.makespan,
        "predicted_makespan_s": predicted.makespan,
        "measured_wait_share": waited,
        "measured_overhead": max(0.0, 1.0 - busy - waited),
        "clock_error_s": max(measured.meta.get("clock_error_s", [0.0]), default=0.0),
        "costs": {name: getattr(costs, name) for name in ("t_f", "t_b", "t_w", "t_fb", "t_comm")},
    }


def write_run_report(out_dir: str | Path, measured: Timeline, schedule: Schedule) -> dict:
    """Write ``trace.json`` (Chrome trace of the run), ``measured.png``, ``predicted.png`` and
    ``compare.png`` (both on one time axis) into ``out_dir``; return ``compare_numbers`` plus the
    file paths under ``"files"``.
    """
    from twinpipe.viz import draw_timeline, draw_timelines

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    costs = estimate_costs(measured)
    predicted = predict(measured, schedule, costs)
    numbers = compare_numbers(measured, predicted, costs)
    files = {
        "trace": write_chrome_trace(measured, out / "trace.json"),
        "measured": out / "measured.png",
        "predicted": out / "predicted.png",
        "compare": out / "compare.png",
    }
    draw_timeline(measured, files["measured"])
    draw_timeline(predicted, files["predicted"])
    draw_timelines([measured, predicted], files["compare"])
    numbers["files"] = {k: str(v) for k, v in files.items()}
    return numbers
