"""Simulator: closed forms for bubble and peak memory, consistency with the planners, clear errors,
and the ``twinpipe simulate`` command."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinpipe.schedule import registry
from twinpipe.schedule.check import ScheduleError, validate
from twinpipe.schedule.ops import BW, F, FB
from twinpipe.sim import CostModel, simulate, summarize
from twinpipe.sim.cli import add_simulate_parser, run_simulate

TIMES = [0.5, 1.0, 1.5, 2.0, 3.0]


def run(name: str, p: int, m: int, costs: CostModel | None = None, **options):
    schedule = registry.build(name, p, m, **options)
    validate(schedule)
    return simulate(schedule, costs)


def bubble(timeline) -> float:
    """The paper's bubble: largest per-rank span minus the compute of one rank."""
    return timeline.cost - max(s.busy for s in timeline.per_rank())


def max_idle(timeline) -> float:
    return max(s.idle for s in timeline.per_rank())


def approx(x):
    return pytest.approx(x, abs=1e-9)


# --- bubble closed forms (T_comm = 0, uniform per-stage times) ------------------------------

PM = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in (p, 2 * p - 1, 2 * p, 3 * p + 1) if m >= 1]


@pytest.mark.parametrize("p,m", PM)
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_1f1b_and_gpipe_idle_is_p_minus_1_times_f_plus_b_plus_w(name, p, m):
    for t_f, t_b, t_w in itertools.product(TIMES[:3], repeat=3):
        tl = run(name, p, m, CostModel(t_f=t_f, t_b=t_b, t_w=t_w))
        expected = (p - 1) * (t_f + t_b + t_w)
        assert bubble(tl) == approx(expected)
        assert tl.per_rank()[0].idle == approx(expected)  # rank 0 starts first and ends last
        assert max_idle(tl) == approx(expected)


@pytest.mark.parametrize("p,m", PM)
def test_zb_h1_idle_paper_form(p, m):
    # Paper Table 2: (p-1)(T_F + T_B - T_W), for T_W <= T_F.
    for t_f, t_b, t_w in itertools.product(TIMES, repeat=3):
        if t_w <= t_f:
            tl = run("zb-h1", p, m, CostModel(t_f=t_f, t_b=t_b, t_w=t_w))
            assert bubble(tl) == approx((p - 1) * (t_f + t_b - t_w))
            assert max_idle(tl) == approx((p - 1) * (t_f + t_b - t_w))


@pytest.mark.parametrize("p,m", [(2, 2), (3, 7), (5, 5), (6, 13)])
def test_zb_h1_idle_general_form(p, m):
    # Finding: a W fills at most a T_F-long gap, so in general the bubble is (p-1)(T_F+T_B-min(T_W,T_F)).
    for t_f, t_b, t_w in itertools.product(TIMES, repeat=3):
        tl = run("zb-h1", p, m, CostModel(t_f=t_f, t_b=t_b, t_w=t_w))
        assert bubble(tl) == approx((p - 1) * (t_f + t_b - min(t_w, t_f)))


ZB_H2_PM = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in (2 * p - 1, 2 * p, 3 * p + 1)]


@pytest.mark.parametrize("p,m", ZB_H2_PM)
def test_zb_h2_idle_paper_form(p, m):
    # Paper Table 2: (p-1)(T_F + T_B - 2T_W), for T_W <= T_F and 2T_W <= T_F + T_B, m >= 2p-1.
    for t_f, t_b, t_w in itertools.product(TIMES, repeat=3):
        if t_w <= t_f and 2 * t_w <= t_f + t_b:
            tl = run("zb-h2", p, m, CostModel(t_f=t_f, t_b=t_b, t_w=t_w))
            assert bubble(tl) == approx((p - 1) * (t_f + t_b - 2 * t_w))


@pytest.mark.parametrize("p,m", [(2, 3), (3, 6), (5, 9), (6, 19)])
def test_zb_h2_idle_general_form(p, m):
    for t_f, t_b, t_w in itertools.product(TIMES, repeat=3):
        tl = run("zb-h2", p, m, CostModel(t_f=t_f, t_b=t_b, t_w=t_w))
        assert bubble(tl) == approx((p - 1) * max(0.0, t_f + t_b - 2 * min(t_w, t_f)))


def test_zb_h2_needs_2p_minus_1_microbatches_for_its_formula():
    # With m < 2p-1 the warm-up cannot fill: p=4, m=4 leaves a bubble although T_F+T_B = 2T_W.
    assert bubble(run("zb-h2", 4, 4)) > 0
    assert bubble(run("zb-h2", 4, 7)) == 0


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 2), (4, 3), (5, 4)])
def test_interleaved_idle_is_1f1b_form_in_stage_times(p, v):
    # Each stage is 1/v of a 1F1B stage, so this is Megatron's (p-1)(t_f+t_b)/v in rank times.
    for m in (p, 2 * p, 3 * p):
        for t_f, t_b, t_w in [(1, 1, 1), (1, 2, 0.5), (2, 1, 1)]:
            tl = run("interleaved-1f1b", p, m, CostModel(t_f=t_f, t_b=t_b, t_w=t_w), stages_per_rank=v)
            assert bubble(tl) == approx((p - 1) * (t_f + t_b + t_w))


def test_closed_forms_assume_no_comm():
    # With T_comm > 0 even 1F1B's steady state stalls: more than (p-1)(T_F+T_B+T_W+2 T_comm).
    tl = run("1f1b", 4, 8, CostModel(t_comm=0.5))
    assert bubble(tl) == approx(17.0)
    assert bubble(tl) > 3 * (3 + 2 * 0.5)


# DualPipe README: (PP/2 - 1)(F&B + B - 3W) with B the full backward and PP the number of stages
# of one model copy: 2p for DualPipeV (V placement), p for DualPipe (two mirrored copies).
DUAL_PM = [("dualpipev", p, m) for p in (1, 2, 3, 4, 5, 6) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p + 2)]
DUAL_PM += [("dualpipe", p, m) for p in (2, 4, 6, 8) for m in (2 * p, 2 * p + 2, 3 * p, 4 * p)]


@pytest.mark.parametrize("name,p,m", DUAL_PM)
def test_dualpipe_idle_matches_readme_for_uniform_costs(name, p, m):
    half_stages = p if name == "dualpipev" else p // 2  # PP/2
    for t in (0.5, 1.0, 2.0):
        tl = run(name, p, m, CostModel(t_f=t, t_b=t, t_w=t))  # T_FB = T_F + T_B + T_W
        f_and_b, b_full, w = 3 * t, 2 * t, t
        expected = (half_stages - 1) * (f_and_b + b_full - 3 * w)
        assert max_idle(tl) == approx(expected)
        assert bubble(tl) == approx(expected)


@pytest.mark.parametrize(
    "costs,measured,readme",
    [
        # Finding: outside uniform, non-overlapped costs the README formula is not exact.
        (dict(t_fb=2.5), 3.5, 4.5),  # overlap: idle falls by 2(PP/2-1) per unit of T_FB, not (PP/2-1)
        (dict(t_f=2.0), 12.0, 9.0),  # T_F > T_B
        (dict(t_w=2.0), 6.0, 3.0),  # T_W > T_B
    ],
)
def test_dualpipev_readme_formula_outside_its_regime(costs, measured, readme):
    tl = run("dualpipev", 4, 16, CostModel(**costs))
    model = CostModel(**costs)
    t_fb = model.t_fb if model.t_fb is not None else model.t_f + model.t_b + model.t_w
    assert (4 - 1) * (t_fb + model.t_b + model.t_w - 3 * model.t_w) == approx(readme)
    assert max_idle(tl) == approx(measured)


@pytest.mark.parametrize("p,m", [(p, m) for p in range(1, 9) for m in (2 * p, 2 * p + 3, 4 * p)])
def test_zbv_reaches_zero_bubble_at_1f1b_memory(p, m):
    tl = run("zbv", p, m)
    assert max_idle(tl) == 0
    assert max(tl.peak_activation) <= 2 * p  # 2p half-size stages = p M_B of a 1F1B stage


# --- peak activation memory -----------------------------------------------------------------


@pytest.mark.parametrize("mw", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_peak_activation_formulas(p, mw):
    costs = CostModel(mw=mw)
    for m in (p, 2 * p, 3 * p + 1):
        one_f_one_b = run("1f1b", p, m, costs).peak_activation
        h1 = run("zb-h1", p, m, costs).peak_activation
        assert one_f_one_b == approx(tuple(p - r for r in range(p)))
        # ZB-H1, worker i (1-indexed): (p-i+1) M_B + (i-1) M_W.
        assert h1 == approx(tuple((p - i + 1) + (i - 1) * mw for i in range(1, p + 1)))
        assert run("gpipe", p, m, costs).peak_activation == approx((m,) * p)
    for m in (2 * p - 1, 2 * p, 3 * p + 1):
        h2 = run("zb-h2", p, m, costs).peak_activation
        # ZB-H2, worker i: (2p-2i+1) M_B + (2i-2) M_W.
        assert h2 == approx(tuple((2 * p - 2 * i + 1) + (2 * i - 2) * mw for i in range(1, p + 1)))


def test_peak_activation_matches_reference_note():
    assert run("zb-h1", 4, 8).peak_activation == (4.0, 3.5, 3.0, 2.5)
    assert run("zb-h2", 4, 8).peak_activation == (7.0, 6.0, 5.0, 4.0)


@pytest.mark.parametrize("name,p", [("dualpipev", 2), ("dualpipev", 4), ("dualpipev", 5), ("dualpipe", 4), ("dualpipe", 8)])
def test_dualpipe_peak_is_pp_plus_1(name, p):
    stages = 2 * p if name == "dualpipev" else p
    for m in (2 * p, 4 * p):
        assert run(name, p, m).peak_activation == (stages + 1,) * p


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (4, 3, 8), (2, 4, 6), (3, 2, 12)])
def test_interleaved_peak(p, v, m):
    # Warm-up forwards plus one, in units of one (1/v-size) stage.
    expected = tuple(min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v) for r in range(p))
    assert run("interleaved-1f1b", p, m, stages_per_rank=v).peak_activation == expected


# --- planners agree with the simulator -----------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(["zb-auto", "zbv"]),
    p=st.integers(1, 6),
    m=st.integers(1, 16),
    t_f=st.sampled_from([0.5, 1.0, 1.3, 2.0]),
    t_b=st.sampled_from([0.5, 1.0, 1.7, 2.0]),
    t_w=st.sampled_from([0.25, 1.0, 2.0]),
    t_comm=st.sampled_from([0.0, 0.1, 1.0]),
    mw=st.sampled_from([0.0, 0.5, 1.0]),
    extra_memory=st.sampled_from([None, 0.0, 1.0, 1.5]),
)
def test_planned_cost_equals_simulated_cost_and_memory_holds(name, p, m, t_f, t_b, t_w, t_comm, mw, extra_memory):
    times = dict(t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm, mw=mw)
    base = p if name == "zb-auto" else 2 * p
    limit = None if extra_memory is None else base * extra_memory + 2
    schedule = registry.build(name, p, m, mem_limit=limit, **times)
    validate(schedule)
    tl = simulate(schedule, CostModel(**times))
    assert tl.cost == pytest.approx(schedule.options["cost"])
    assert max(tl.peak_activation) <= schedule.options["mem_limit"] + 1e-9


def test_zb_2p_is_zero_bubble_for_unit_times():
    for p, m in [(2, 4), (4, 8), (4, 12), (6, 12), (8, 24)]:
        assert bubble(run("zb-auto", p, m, mem_limit=2 * p)) == 0


# --- the cost model and the engine ---------------------------------------------------------


def test_comm_only_between_ranks():
    # GPipe, p=2, m=1: F, send, F, BW, send, BW.
    tl = run("gpipe", 2, 1, CostModel(t_comm=0.25))
    assert tl.makespan == approx(1 + 0.25 + 1 + 2 + 0.25 + 2)
    # One rank holding both legs of the V: the turn costs nothing.
    assert run("zbv", 1, 3, CostModel(t_comm=5.0)).makespan == approx(18.0)
    assert run("dualpipev", 1, 3, CostModel(t_comm=5.0)).makespan == approx(18.0)


def test_per_stage_costs_and_fb_time():
    tl = run("1f1b", 3, 4, CostModel(t_f=[1, 2, 1], t_b=[1, 1, 1], t_w=0))
    assert [s.busy for s in tl.per_rank()] == [8.0, 12.0, 8.0]
    default = run("dualpipev", 2, 4)
    overlapped = run("dualpipev", 2, 4, CostModel(t_fb=2.0))
    assert overlapped.per_rank()[0].busy < default.per_rank()[0].busy


def test_fb_counts_both_activations_at_once():
    # An FB op holds its forward's activations before its backward frees the other's.
    schedule = registry.build("gpipe", 1, 2).with_ops([[F(0, 0), FB(F(0, 1), BW(0, 0)), BW(0, 1)]])
    assert simulate(schedule).peak_activation == (2.0,)


def test_timeline_numbers_add_up():
    tl = run("zb-h1", 4, 8, CostModel(t_f=1, t_b=2, t_w=0.5, t_comm=0.1))
    for s in tl.per_rank():
        assert s.busy + s.idle == approx(s.span)
        waits = sum(w.duration for w in tl.wait_slices(s.rank))
        assert waits == approx(s.idle)
    assert tl.meta["costs"].t_comm == 0.1


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(t_f=-1), r"t_f=-1: must be a finite number >= 0"),
        (dict(t_f=math.inf), r"t_f=inf: must be a finite number >= 0"),
        (dict(t_fb=math.nan), r"t_fb=nan: must be a finite number >= 0"),
        (dict(t_b=[1, True]), r"t_b\[1\]=True: must be a finite number >= 0"),
        (dict(t_comm=math.inf), r"t_comm=inf"),
        (dict(t_comm=-0.1), r"t_comm=-0.1"),
        (dict(mw="x"), r"mw='x'"),
        (dict(t_b=[]), r"t_b=\[\]"),
    ],
)
def test_cost_model_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostModel(**kwargs)


def test_cost_model_per_stage_length_checked():
    with pytest.raises(ValueError, match=r"t_f=\[1, 1, 1\]: must be one number or 4 \(one per stage of the schedule\)"):
        simulate(registry.build("1f1b", 4, 4), CostModel(t_f=[1, 1, 1]))


# --- schedules that cannot run ------------------------------------------------------------


def test_deadlock_names_stuck_ranks_and_ops():
    good = registry.build("1f1b", 2, 2)
    # Rank 0 runs its first backward before its forward reaches rank 1: both wait forever.
    ops = [[BW(0, 0), F(0, 0), F(0, 1), BW(0, 1)], list(good.ops[1])]
    with pytest.raises(ScheduleError, match=r"deadlock") as err:
        simulate(good.with_ops(ops))
    text = str(err.value)
    assert "rank 0 op 0 (0BW0) waits for 0F0 (rank 0 op 1)" in text
    assert "rank 1 op 0 (1F0) waits for 0F0" in text


def test_missing_op_is_named():
    good = registry.build("1f1b", 2, 2)
    ops = [[op for op in good.ops[0] if str(op) != "0F1"], list(good.ops[1])]
    with pytest.raises(ScheduleError, match=r"rank 0: \[missing op\] no op runs 0F1"):
        simulate(good.with_ops(ops))


@pytest.mark.parametrize("rank", [0, 3])
def test_schedule_missing_a_full_backward_is_refused(rank):
    # Nothing waits on the first rank's last BW, and the last rank's are only waited on by
    # other BWs: without the check the rest simulated as if the work had been done.
    good = registry.build("1f1b", 4, 8)
    last_bw = max(i for i, op in enumerate(good.ops[rank]) if str(op) == f"{rank}BW7")
    ops = [list(r) for r in good.ops]
    del ops[rank][last_bw]
    with pytest.raises(ScheduleError, match=rf"rank {rank}: \[missing op\] no op runs {rank}B7 or {rank}BW7"):
        simulate(good.with_ops(ops))


def test_forward_work_in_the_wrong_chain_is_refused():
    good = registry.build("dualpipe", 2, 4)  # chain 0 carries micro-batches 0, 1; chain 1 carries 2, 3
    ops = [list(r) for r in good.ops]
    ops[0][ops[0].index(F(0, 0))] = F(0, 2)
    with pytest.raises(ScheduleError, match=r"micro-batch 2 does not travel through chain 0"):
        simulate(good.with_ops(ops))


@pytest.mark.parametrize(
    "ops,message",
    [
        ([[F(1, 0), BW(1, 0)], [F(1, 0), BW(1, 0)]], r"rank 0, op 0: \[wrong rank\] 1F0 runs stage 1, which rank 1 holds"),
        ([[F(0, 0), F(0, 0)], []], r"\[repeated op\] 0F0"),
        ([[F(0, 5)], []], r"\[micro-batch\] 0F5 names micro-batch 5; there are 1"),
        ([[F(0, 0), "0BW0"], [F(1, 0), BW(1, 0)]], r"rank 0, op 1: \[op\] '0BW0' is not an Op"),
    ],
)
def test_bad_ops_are_named(ops, message):
    with pytest.raises(ScheduleError, match=message):
        simulate(registry.build("1f1b", 2, 1).with_ops(ops))


# --- twinpipe simulate --------------------------------------------------------------------


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="twinpipe")
    add_simulate_parser(parser.add_subparsers()).set_defaults(run=run_simulate)
    args = parser.parse_args(["simulate", *argv])
    code = args.run(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_one_schedule(capsys):
    code, out, _ = cli(capsys, "zb-h1", "--ranks", "4", "--microbatches", "8", "--json")
    data = json.loads(out)
    assert code == 0
    assert set(data) == {"schedule", "ranks", "microbatches", "held_equal", "stage_size", "makespan", "bubble_rate", "per_rank"}
    assert (data["schedule"], data["ranks"], data["microbatches"], data["makespan"]) == ("zb-h1", 4, 8, 27.0)
    assert data["bubble_rate"] == pytest.approx(1 / 9)
    assert data["per_rank"][1] == {"rank": 1, "start": 1.0, "end": 27.0, "busy": 24.0, "idle": 2.0, "peak_activation": 3.5}


def test_cli_costs_reach_the_simulator_and_the_planners(capsys):
    _, out, _ = cli(capsys, "1f1b", "-p", "4", "-m", "8", "--f", "2", "--b", "1", "--w", "0.5", "--json")
    assert json.loads(out)["per_rank"][0]["idle"] == pytest.approx(3 * 3.5)
    _, out, _ = cli(capsys, "zb-auto", "-p", "4", "-m", "8", "--mem-limit", "8", "--mw", "1", "--json")
    assert json.loads(out)["bubble_rate"] == 0 and json.loads(out)["per_rank"][0]["peak_activation"] == 8
    _, out, _ = cli(capsys, "interleaved-1f1b", "-p", "2", "-m", "4", "--stages-per-rank", "3", "--hold", "stage", "--json")
    assert json.loads(out)["per_rank"][0]["busy"] == 3 * 4 * 3  # 3 stages of T_F+T_B+T_W = 3 each
    _, out, _ = cli(capsys, "interleaved-1f1b", "-p", "2", "-m", "4", "--stages-per-rank", "3", "--json")
    assert json.loads(out)["per_rank"][0]["busy"] == pytest.approx(3 * 4)  # the same model: 3 stages of a third each
    _, out, _ = cli(capsys, "chimera", "-p", "8", "-m", "16", "--pairs", "2", "--b", "0.5", "--w", "0.5", "--json")
    assert json.loads(out)["makespan"] == 2 * 16 + 8 // 2 - 2  # Chimera's span with k pairs, F = BW: 2m + D/k - 2 slots
    _, out, _ = cli(capsys, "1f1b", "-p", "4", "-m", "8", "--cores", "1", "--json")
    assert json.loads(out)["makespan"] == pytest.approx(4 * 8 * 3)  # every op of every rank on one core


def test_cli_compare_json_and_table(capsys):
    code, out, _ = cli(capsys, "--compare", "1f1b,zb-h1,dualpipe", "-p", "4", "-m", "8", "--mem-limit", "6", "--json")
    data = json.loads(out)
    assert code == 0 and [d["schedule"] for d in data] == ["1f1b", "zb-h1", "dualpipe"]
    code, out, _ = cli(capsys, "--compare", "1f1b,zb-auto", "-p", "4", "-m", "8")
    assert code == 0 and "zb-auto" in out and "27.27%" in out


def test_cli_table(capsys):
    code, out, _ = cli(capsys, "zb-h2", "-p", "4", "-m", "8", "--w", "0.5")
    assert code == 0 and "zb-h2" in out and "bubble rate" in out


SAME_MODEL = "1f1b,zbv,dualpipev,dualpipe,interleaved-1f1b,v-half"


def test_cli_compares_the_same_model_by_default(capsys):
    # Every rank does one model's worth of work per micro-batch, T_F+T_B+T_W of a 1F1B stage, in
    # every schedule (DualPipe: two full-size stages, half the micro-batches each).
    p, m = 4, 8
    _, out, _ = cli(capsys, "--compare", SAME_MODEL, "-p", str(p), "-m", str(m), "--f", "1", "--b", "2", "--w", "0.5", "--json")
    rows = {row["schedule"]: row for row in json.loads(out)}
    for name, row in rows.items():
        assert row["held_equal"] == "model"
        assert [st["busy"] for st in row["per_rank"]] == [pytest.approx(m * 3.5)] * p, name
    assert {name: row["stage_size"] for name, row in rows.items()} == {
        "1f1b": "1", "zbv": "1/2", "dualpipev": "1/2", "dualpipe": "1", "interleaved-1f1b": "1/2", "v-half": "1/2"}
    # ZB-V holds 1F1B's activations (p M_B of 1F1B stages) and has no bubble: it beats 1F1B.
    assert max(st["peak_activation"] for st in rows["zbv"]["per_rank"]) == p
    assert rows["zbv"]["makespan"] < rows["1f1b"]["makespan"]


def test_cli_hold_stage_keeps_the_costs_as_given(capsys):
    _, out, _ = cli(capsys, "--compare", "1f1b,zbv", "-p", "4", "-m", "8", "--hold", "stage", "--json")
    rows = {row["schedule"]: row for row in json.loads(out)}
    assert rows["zbv"]["per_rank"][0]["busy"] == 2 * rows["1f1b"]["per_rank"][0]["busy"]  # two full stages per rank
    assert rows["zbv"]["held_equal"] == "stage" and rows["zbv"]["stage_size"] is None


def test_cli_mem_limit_counts_1f1b_stages(capsys):
    # --mem-limit 3 (1F1B stages) lets ZB-V hold 6 of its half-size stages: 3 M_B, not 1.5.
    _, out, _ = cli(capsys, "zbv", "-p", "4", "-m", "8", "--mem-limit", "3", "--json")
    peak = max(st["peak_activation"] for st in json.loads(out)["per_rank"])
    assert 2.5 < peak <= 3


def test_cli_compare_names_the_failing_schedule_once(capsys):
    code, _, err = cli(capsys, "--compare", "1f1b,dualpipe", "-p", "3", "-m", "4")
    assert code == 2 and err == "twinpipe simulate: error: dualpipe: num_ranks=3: must be >= 2 and even\n"


def test_cli_table_says_what_was_held_equal(capsys):
    code, out, _ = cli(capsys, "--compare", "1f1b,zbv", "-p", "4", "-m", "8")
    text = " ".join(out.split())
    assert code == 0 and "size" in text and "│ 1/2 │" in text and "same model: T_F=1, T_B=1, T_W=1 and M_B per 1F1B stage" in text
    code, out, _ = cli(capsys, "zbv", "-p", "4", "-m", "8", "--hold", "stage")
    assert code == 0 and "same per-stage costs" in " ".join(out.split())


@pytest.mark.parametrize(
    "argv,message",
    [
        (["1f1b", "-p", "4", "-m", "8", "--f", "inf"], "--f=inf: must be a finite number >= 0"),
        (["1f1b", "-p", "4", "-m", "8", "--fb", "nan"], "--fb=nan: must be a finite number >= 0"),
        (["1f1b", "-p", "4", "-m", str(10**6)], "num_microbatches=1000000: must be >= 1 and <= 16384"),
        (["nope", "-p", "4", "-m", "8"], "schedule='nope': allowed are "),
        (["1f1b", "-p", "0", "-m", "8"], "num_ranks=0: must be >= 1"),
        (["1f1b", "-p", "4", "-m", "8", "--mem-limit", "4"], "--mem-limit=4 does not apply to schedule '1f1b'; it applies to: zb-auto, zbv"),
        (["interleaved-1f1b", "-p", "4", "-m", "6"], "num_microbatches=6: must be >= 4 and a multiple of 4"),
        (["zb-auto", "-p", "4", "-m", "8", "--mem-limit", "0.5"], "mem_limit=0.5: must be >= max(1, mw) = 1"),
        (["1f1b", "-p", "4", "-m", "8", "--comm", "-1"], "--comm=-1.0: must be a finite number >= 0"),
        (["-p", "4", "-m", "8"], "missing SCHEDULE"),
        (["1f1b", "--compare", "zb-h1", "-p", "4", "-m", "8"], "not both"),
        (["--compare", ",", "-p", "4", "-m", "8"], "--compare=','"),
    ],
)
def test_cli_errors_exit_2_with_a_message(capsys, argv, message):
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err


@pytest.mark.parametrize("name", registry.names())
def test_summarize_gives_the_timelines_numbers(name):
    # The planner's lean path and the Timeline come from one event loop: the same floats, bitwise.
    costs = CostModel(t_f=1.0, t_b=1.3, t_w=0.7, t_comm=0.11, t_fb=2.2, mw=0.4)
    for p, m in ((2, 4), (4, 12)):
        schedule = registry.build(name, p, m)
        timeline, summary = simulate(schedule, costs), summarize(schedule, costs)
        stats = timeline.per_rank()
        assert summary.makespan == timeline.makespan
        assert summary.peak == timeline.peak_activation
        assert summary.busy == tuple(s.busy for s in stats)
        assert (summary.first, summary.last) == (tuple(s.start for s in stats), tuple(s.end for s in stats))


def test_summarize_checks_like_simulate():
    schedule = registry.build("1f1b", 2, 2)
    broken = schedule.with_ops([list(schedule.ops[0][:-1]), list(schedule.ops[1])])
    with pytest.raises(ScheduleError, match="missing op"):
        summarize(broken)
    with pytest.raises(TypeError, match="costs must be a CostModel"):
        summarize(schedule, {"t_f": 1})


def test_shared_cores_with_enough_cores_change_nothing():
    costs = CostModel(t_f=1.0, t_b=1.3, t_w=0.7, t_comm=0.1)
    schedule = registry.build("zb-h1", 4, 8)
    assert summarize(schedule, CostModel(t_f=1.0, t_b=1.3, t_w=0.7, t_comm=0.1, cores=4)) == summarize(schedule, costs)
    # One micro-batch through 1F1B: never two ranks at once, so one core is enough.
    chain = registry.build("1f1b", 4, 1)
    assert simulate(chain, CostModel(t_comm=0.1, cores=1)).makespan == pytest.approx(simulate(chain, CostModel(t_comm=0.1)).makespan)


@pytest.mark.parametrize("name", registry.names())
def test_one_shared_core_runs_all_the_work_back_to_back(name):
    # With no message delay some rank can always run: one core is never idle, and never doubled.
    costs = CostModel(t_f=1.0, t_b=1.3, t_w=0.7, t_fb=2.5, cores=1)
    schedule = registry.build(name, 4, 8)
    alone = summarize(schedule, replace(costs, cores=None))
    shared = simulate(schedule, costs)
    assert shared.makespan == pytest.approx(sum(alone.busy), rel=1e-12)
    assert shared.peak_activation == alone.peak
    assert shared.op_order(0) == simulate(schedule, replace(costs, cores=None)).op_order(0)


def test_two_ranks_on_one_core_share_it_evenly():
    # GPipe, 2 ranks, 2 micro-batches, T_F = 1: rank 0 runs 0F0 alone, then 0F1 beside 1F0 at half speed.
    schedule = registry.build("gpipe", 2, 2)
    timeline = simulate(schedule, CostModel(t_f=1.0, t_b=1.0, t_w=0.0, cores=1))
    starts = {str(s.op): (s.start, s.end) for s in timeline.slices if s.op is not None}
    assert starts["0F0"] == (0.0, 1.0) and starts["0F1"] == (1.0, 3.0) and starts["1F0"] == (1.0, 3.0)
    assert timeline.makespan == pytest.approx(8.0)


@pytest.mark.parametrize("cores", [0, -1, 1.5, True, "2"])
def test_cores_must_be_a_positive_integer(cores):
    with pytest.raises(ValueError, match=rf"cores={cores!r}: must be (an int )?>= 1 \(or None"):
        CostModel(cores=cores)
