"""Recording real runs and exporting traces: a 2-rank gloo world runs several schedules with
``trace=True``; the gathered Timeline keeps each rank's schedule order, exports to valid Chrome
trace JSON, and feeds a measured-vs-predicted report.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

import models
from distributed import run_world
from twinpipe.schedule.registry import build
from twinpipe.sim import CostModel, simulate
from twinpipe.trace import chrome_trace, estimate_costs, predict, write_chrome_trace, write_run_report

WORLD = 2
CASES = [("dualpipev", 8), ("dualpipe", 8), ("1f1b", 6), ("zb-h1", 6)]


def _run_case(rank: int, schedule: str, n: int, trace: bool = True):
    import twinpipe
    from twinpipe.schedule.registry import placement_for
    from twinpipe.trace import gather_timeline

    placement = placement_for(schedule, WORLD)
    torch.manual_seed(rank)
    pipe = twinpipe.Pipeline([models.MLPStage() for _ in placement.stages_of(rank)], schedule)
    first = any(placement.is_first(s) for s in pipe.stages)
    last = any(placement.is_last(s) for s in pipe.stages)
    x, y = torch.randn(4 * n, models.HIDDEN), torch.randn(4 * n, models.HIDDEN)
    kwargs = {"criterion": models.mse, "labels": (y,)} if last else {}
    for step in range(2):  # the first step discovers message shapes: trace the second
        pipe.step(*((x,) if first else ()), num_chunks=n, trace=trace and step == 1, **kwargs)
    return gather_timeline(pipe, n)


def _outcome(fn) -> str | None:
    try:
        fn()
        return None
    except Exception as error:  # noqa: BLE001 - the test reads the type and message
        return f"{type(error).__name__}: {error}"


def _world(rank: int, world: int) -> dict:
    out = {case: _run_case(rank, *case) for case in CASES}
    out["untraced"] = _outcome(lambda: _run_case(rank, "1f1b", 4, trace=False))
    out["one untraced"] = _outcome(lambda: _run_case(rank, "1f1b", 4, trace=rank == 0))
    out["other num_chunks"] = _outcome(lambda: _run_case(rank, "1f1b", 4 + rank))
    # Last: rank 1 never calls gather_timeline; rank 0 must not wait past its timeout.
    import twinpipe
    from twinpipe.trace import gather_timeline

    pipe = twinpipe.Pipeline([models.MLPStage()], "1f1b")
    if rank == 0:
        pipe.step(torch.randn(8, models.HIDDEN), num_chunks=2, trace=True)
    else:
        pipe.step(num_chunks=2, trace=True, criterion=models.mse, labels=(torch.randn(8, models.HIDDEN),))
    if rank == 0:
        out["absent"] = _outcome(lambda: gather_timeline(pipe, 2, timeout=1.0))
    else:
        import time

        time.sleep(2.0)  # alive, just not calling it
        out["absent"] = None
    return out


@pytest.fixture(scope="module")
def recorded():
    per_rank = run_world(WORLD, _world)
    assert all(per_rank[1][case] is None for case in CASES), "only rank 0 gets the timeline"
    return per_rank[0] | {"per_rank": per_rank}


# --------------------------------------------------------------------------- Chrome trace format


def _check_chrome(trace: dict, timeline, us_per_unit: float) -> None:
    """The trace-event format's rules that Perfetto and chrome://tracing rely on."""
    data = json.loads(json.dumps(trace))  # plain JSON all the way down
    events = data["traceEvents"]
    assert data["displayTimeUnit"] in ("ms", "ns")
    named_pids, named_tracks, tracks = set(), set(), defaultdict(list)
    for e in events:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name") and isinstance(e["args"], dict)
            if e["name"] == "process_name":
                named_pids.add(e["pid"])
            if e["name"] == "thread_name":
                named_tracks.add((e["pid"], e["tid"]))
            continue
        assert e["ph"] == "X"
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0 and e["ts"] >= 0
        tracks[(e["pid"], e["tid"])].append(e)
    assert {pid for pid, _ in tracks} <= named_pids and set(tracks) <= named_tracks
    for track in tracks.values():
        track.sort(key=lambda e: e["ts"])
        for a, b in zip(track, track[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-6, f"overlap on track {a['pid']}/{a['tid']}: {a['name']} and {b['name']}"
    assert sum(len(t) for t in tracks.values()) == len(timeline.slices)
    # Microseconds: every slice's start and duration, scaled.
    by_key = {(s.rank, round(s.start * us_per_unit, 3)): s for s in timeline.slices if s.op is not None}
    for (pid, tid), track in tracks.items():
        for e in track:
            if tid == 0:
                s = by_key[(pid, e["ts"])]
                assert e["name"] == str(s.op) and e["cat"] == s.op.kind.value
                assert e["dur"] == pytest.approx(s.duration * us_per_unit, abs=2e-3)


def test_chrome_trace_of_simulation(tmp_path):
    timeline = simulate(build("dualpipe", 4, 8), CostModel(t_comm=0.5))
    _check_chrome(chrome_trace(timeline), timeline, 1e3)  # default: 1 unit = 1 ms
    _check_chrome(chrome_trace(timeline, us_per_unit=250), timeline, 250)
    path = write_chrome_trace(timeline, tmp_path / "sub" / "t.json")
    assert json.loads(path.read_text())["otherData"]["schedule"] == "dualpipe"
    with pytest.raises(ValueError, match="us_per_unit"):
        chrome_trace(timeline, us_per_unit=0)


def test_chrome_trace_of_recorded_run(recorded):
    timeline = recorded[("dualpipev", 8)]
    trace = chrome_trace(timeline)
    _check_chrome(trace, timeline, 1e6)
    assert trace["otherData"]["source"] == "measured" and "clock_error_s" in trace["otherData"]
    assert any(e.get("args", {}).get("label", "").startswith("recv for") for e in trace["traceEvents"])


# --------------------------------------------------------------------------- recorded runs


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-n{c[1]}")
def test_recorded_order_is_the_schedule(recorded, case):
    name, n = case
    timeline, schedule = recorded[case], build(name, WORLD, n)
    assert timeline.source == "measured" and timeline.num_ranks == WORLD and timeline.num_microbatches == n
    for rank in range(WORLD):
        assert timeline.op_order(rank) == [str(op) for op in schedule.ops[rank]]
        compute = timeline.compute_slices(rank)
        assert all(a.end <= b.start for a, b in zip(compute, compute[1:]))
        assert all(s.label.startswith(("recv for", "drain")) for s in timeline.wait_slices(rank))
    assert min(s.start for s in timeline.slices) == 0.0
    assert len(timeline.meta["clock_error_s"]) == WORLD and timeline.meta["clock_error_s"][0] == 0.0
    assert max(timeline.meta["clock_error_s"]) < 0.05
    assert len(set(timeline.meta["hosts"])) == 1 and timeline.meta["threads"] == [1] * WORLD  # what shared_cores reads
    assert all(c >= 1 for c in timeline.meta["cores"]) and len(timeline.meta["cores"]) == WORLD
    assert timeline.peak_activation is not None and max(timeline.peak_activation) >= 1


def test_gather_without_trace_says_so(recorded):
    assert "trace=True" in recorded["untraced"]


def test_gather_faults_raise_on_every_rank(recorded):
    per_rank = recorded["per_rank"]
    for rank in range(WORLD):
        assert per_rank[rank]["untraced"].startswith("ValueError") and "rank(s) 0, 1 have no trace" in per_rank[rank]["untraced"]
        assert "rank(s) 1 have no trace" in per_rank[rank]["one untraced"]
        assert "ranks disagree on num_chunks (rank 0: 4; rank 1: 5)" in per_rank[rank]["other num_chunks"]
    assert per_rank[0]["absent"].startswith("PipelineTimeoutError") and "rank 0: gather_timeline" in per_rank[0]["absent"]


def test_measured_vs_predicted_report(recorded, tmp_path):
    import matplotlib.image as mpimg

    timeline = recorded[("dualpipev", 8)]
    numbers = write_run_report(tmp_path, timeline, build("dualpipev", WORLD, 8))
    for key in ("measured_bubble_rate", "predicted_bubble_rate"):
        assert 0.0 <= numbers[key] < 1.0
    assert numbers["measured_bubble_rate"] == timeline.bubble_rate
    assert numbers["measured_makespan_s"] > 0 and numbers["predicted_makespan_s"] > 0
    assert len(numbers["costs"]["t_f"]) == 2 * WORLD
    for name in ("trace.json", "measured.png", "predicted.png", "compare.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert mpimg.imread(tmp_path / "predicted.png").shape[0] > 50
    json.loads((tmp_path / "trace.json").read_text())


# --------------------------------------------------------------------------- costs from timelines


@pytest.mark.parametrize("name", ["zb-h1", "1f1b", "dualpipev", "dualpipe", "zbv"])
def test_costs_round_trip_through_simulation(name):
    """Costs read off a simulated timeline are the costs it was simulated with."""
    costs = CostModel(t_f=1.0, t_b=2.0, t_w=0.5, t_comm=0.25)
    schedule = build(name, 4, 8)
    timeline = simulate(schedule, costs)
    got = estimate_costs(timeline)
    assert got.t_comm == pytest.approx(0.25)
    assert got.t_f == pytest.approx([1.0] * schedule.placement.num_stages)
    full = [b + w for b, w in zip(got.t_b, got.t_w)]
    assert full == pytest.approx([2.5] * schedule.placement.num_stages)
    assert predict(timeline, schedule).bubble_rate == pytest.approx(timeline.bubble_rate)


def test_fb_parts_get_lanes_of_their_own_in_the_chrome_trace():
    """Parts an overlapped stage reports ("part:LANE" events) stay out of the op slices and become
    one Chrome thread per lane."""
    from twinpipe.trace.chrome import PART_TID
    from twinpipe.trace.record import build_timeline

    schedule = build("dualpipev", 1, 1)
    ops = [str(op) for op in schedule.ops[0]]
    events = [("compute", label, float(i), i + 0.9) for i, label in enumerate(ops)]
    events += [("part:parts", "attn(F)", 0.1, 0.3), ("part:comm F", "dispatch(F)", 0.2, 0.6)]
    timeline = build_timeline({0: events}, schedule)
    assert len(timeline.compute_slices(0)) == len(ops) and len(timeline.meta["parts"]) == 2
    trace = chrome_trace(timeline)["traceEvents"]
    names = {e["args"]["name"] for e in trace if e["name"] == "thread_name" and e["tid"] >= PART_TID}
    assert names == {"F&B parts", "F&B comm F"}
    assert {e["tid"] for e in trace if e.get("cat") == "part"} == {PART_TID, PART_TID + 1}


@pytest.mark.parametrize("meta,expected", [
    (dict(hosts=["a"] * 4, cores=[2] * 4, threads=[1] * 4), 2),  # four ranks on two cores
    (dict(hosts=["a"] * 4, cores=[8] * 4, threads=[4] * 4), 2),  # four threads each: two ranks fit at once
    (dict(hosts=["a"] * 4, cores=[4] * 4, threads=[1] * 4), None),  # a core each
    (dict(hosts=["a", "a", "b", "b"], cores=[1] * 4, threads=[1] * 4), None),  # several hosts: not modelled
    (dict(hosts=["a"] * 4, cores=[2] * 3, threads=[1] * 4), None),  # incomplete
    ({}, None),  # an older trace
])
def test_shared_cores_reads_where_the_ranks_ran(meta, expected):
    from twinpipe.timeline import Timeline
    from twinpipe.trace.costs import shared_cores

    assert shared_cores(Timeline("1f1b", 4, 4, [], source="measured", meta=meta)) == expected


def test_alone_durations_undo_the_sharing():
    # On one core: 0F0 alone for 1 s, then 0F1 and 1F0 side by side for 2 s (1 s of work each).
    from twinpipe.schedule.ops import F
    from twinpipe.timeline import Slice, Timeline
    from twinpipe.trace.costs import alone_durations

    slices = [Slice(0, 0.0, 1.0, F(0, 0)), Slice(0, 1.0, 3.0, F(0, 1)), Slice(1, 1.0, 3.0, F(1, 0)), Slice(1, 3.0, 3.5, None, "wait")]
    timeline = Timeline("gpipe", 2, 2, slices, source="measured")
    assert alone_durations(timeline, 1) == pytest.approx([1.0, 1.0, 1.0])
    assert alone_durations(timeline, 2) == pytest.approx([1.0, 2.0, 2.0])
    assert alone_durations(timeline, None) == [1.0, 2.0, 2.0]
