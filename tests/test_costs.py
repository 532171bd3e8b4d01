"""Op cost in one module (``schedule/costs.py``): the time of each op kind, the F&B pair's time,
the memory each op kind adds or frees, and every user of them agreeing (simulator, trace
estimates, planner, generators). Pure Python: no torch."""

from __future__ import annotations

import pytest

from twinpipe.schedule import registry
from twinpipe.schedule.costs import (
    CostModel, memory_delta, memory_steps, microbatch_peak, op_costs, op_time, pair_time,
)
from twinpipe.schedule.ops import B, BW, F, FB, W, OpKind, Schedule
from twinpipe.schedule.placement import linear
from twinpipe.sim import simulate, summarize
from twinpipe.sim.costs import CostModel as SimCostModel
from twinpipe.sim.costs import for_model

STAGES = 8
T_F = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 2.5]  # the last stage computes the loss: slower
T_B = [2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6, 4.0]
T_W = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.5]


def test_cost_model_is_one_class_under_both_names():
    assert SimCostModel is CostModel


def test_time_of_each_kind_at_its_own_stage():
    costs = CostModel(t_f=T_F, t_b=T_B, t_w=T_W)
    assert op_time(F(3, 0), costs) == T_F[3]
    assert op_time(B(3, 0), costs) == T_B[3]
    assert op_time(W(3, 0), costs) == T_W[3]
    assert op_time(BW(7, 0), costs) == T_B[7] + T_W[7]


def test_an_fb_pair_is_its_halves_back_to_back_each_at_its_own_stage():
    """Rank 0 of DualPipeV pairs stage 0's forward with stage 7's (the loss stage's) backward: the
    pair costs T_F(0) + T_B(7) + T_W(7), not stage 0's T_F + T_B + T_W."""
    costs = CostModel(t_f=T_F, t_b=T_B, t_w=T_W)
    pair = FB(F(0, 3), BW(7, 1))
    assert op_time(pair, costs) == T_F[0] + (T_B[7] + T_W[7])
    assert op_time(pair, costs) != T_F[0] + T_B[0] + T_W[0]
    assert op_time(pair, costs) == op_time(F(0, 3), costs) + op_time(BW(7, 1), costs)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_an_fb_pairs_a_forward_with_the_other_stage_of_its_rank(name):
    """Why T_FB keyed by the forward's stage is enough: on the built-in schedules that stage fixes
    the backward half's stage (the other one its rank holds)."""
    for p, m in ((2, 8), (4, 12), (6, 20)):
        schedule = registry.build(name, p, m)
        placement = schedule.placement
        for ops in schedule.ops:
            for op in ops:
                if op.backward is not None:
                    (other,) = [s for s in placement.stages_of(placement.rank_of(op.stage)) if s != op.stage]
                    assert op.backward.stage == other


def test_a_given_t_fb_is_keyed_by_the_forward_stage_and_none_means_not_given():
    given = [2.0] * STAGES
    given[0] = None  # not measured for stage 0: the halves back to back
    costs = CostModel(t_f=T_F, t_b=T_B, t_w=T_W, t_fb=given)
    assert op_time(FB(F(7, 0), BW(0, 1)), costs) == 2.0
    assert op_time(FB(F(0, 0), BW(7, 1)), costs) == T_F[0] + (T_B[7] + T_W[7])
    assert op_time(FB(F(0, 0), BW(7, 1)), CostModel(t_fb=1.5)) == 1.5
    assert pair_time(1.0, 2.0) == 3.0 and pair_time(1.0, 2.0, 2.5) == 2.5
    with pytest.raises(ValueError, match=r"t_f\[1\]=None: must be a finite number >= 0"):
        CostModel(t_f=[1.0, None])  # None is allowed for t_fb entries only


def test_simulated_ops_take_op_time():
    """Every slice the simulator lays out lasts what ``op_time`` says (FB pairs on DualPipe and
    DualPipeV included), on per-stage costs where the pairs' two stages differ."""
    for name in ("dualpipev", "dualpipe", "zb-h1", "zbv", "interleaved-1f1b"):
        schedule = registry.build(name, 4, 12)
        n = schedule.placement.num_stages
        costs = CostModel(t_f=T_F[:n] if n == STAGES else 1.3, t_b=T_B[:n] if n == STAGES else 2.1,
                          t_w=T_W[:n] if n == STAGES else 0.7, t_comm=0.1)
        table = op_costs(costs, n)
        timeline = simulate(schedule, costs)
        ops = [s for s in timeline.slices if s.op is not None]
        assert ops and all(s.end - s.start == pytest.approx(table.time(s.op), rel=1e-12) for s in ops)
        assert any(s.op.kind is OpKind.FB for s in ops) == name.startswith("dualpipe")


# --------------------------------------------------------------------------- memory


def test_memory_delta_of_each_kind():
    assert memory_delta(OpKind.F, 2.0, 0.25) == 2.0
    assert memory_delta("B", 2.0, 0.25) == -1.5  # keeps M_W = 0.5 of the 2
    assert memory_delta(OpKind.W, 2.0, 0.25) == -0.5
    assert memory_delta(OpKind.BW, 2.0, 0.25) == -2.0
    assert memory_delta("B", 1.0, 1.5) == 0.5  # M_W > M_B: B adds memory
    with pytest.raises(ValueError, match="FB op changes memory in two steps"):
        memory_delta(OpKind.FB)
    assert memory_steps(FB(F(0, 1), BW(3, 0)), [1.0, 2.0, 3.0, 4.0], 0.5) == (1.0, -4.0)
    assert microbatch_peak(0.5) == 1.0 and microbatch_peak(1.67) == 1.67


def _replayed_peaks(schedule: Schedule, m_b: list[float], mw: float) -> list[float]:
    """Each rank's peak, replaying its ops with the rule spelled out here (independently of src)."""
    change = {OpKind.F: lambda s: m_b[s], OpKind.B: lambda s: (mw - 1.0) * m_b[s],
              OpKind.W: lambda s: -mw * m_b[s], OpKind.BW: lambda s: -m_b[s]}
    peaks = []
    for ops in schedule.ops:
        held = top = 0.0
        for op in ops:
            for part in op.parts():  # an FB: its F, then its BW
                held += change[part.kind](part.stage)
                top = max(top, held)
        peaks.append(top)
    return peaks


@pytest.mark.parametrize("mw", [0.0, 0.5, 1.0, 1.67, 3.0])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "dualpipe", "dualpipev", "interleaved-1f1b"])
def test_simulated_peak_is_the_replayed_peak(name, mw):
    """The simulator's peak is the largest memory after any step, also when M_W > M_B (there a B
    adds memory; the old simulator did not take the peak after it: zb-h1's rank 0 with mw=1.67
    and M_B = 1 peaked at 4, not 4.67)."""
    schedule = registry.build(name, 4, 8)
    n = schedule.placement.num_stages
    m_b = [1.0 + 0.25 * (s % 3) for s in range(n)]
    peak = summarize(schedule, CostModel(m_b=m_b, mw=mw)).peak
    assert list(peak) == pytest.approx(_replayed_peaks(schedule, m_b, mw), rel=1e-12)


def test_peak_after_a_b_that_grows_memory():
    """One stage, one micro-batch, F B W with M_W = 2 M_B: the peak is after B (2), not after F (1)."""
    schedule = Schedule("fbw", linear(1), 1, ((F(0, 0), B(0, 0), W(0, 0)),))
    assert summarize(schedule, CostModel(mw=2.0)).peak == (2.0,)
    assert simulate(schedule, CostModel(mw=2.0)).peak_activation == (2.0,)
    assert summarize(schedule, CostModel(mw=0.5)).peak == (1.0,)


def test_planners_need_room_for_one_microbatch_at_its_peak():
    from twinpipe.schedule.zb_auto import zb_auto
    from twinpipe.schedule.zbv import zbv

    with pytest.raises(ValueError, match=r"must be >= max\(1, mw\) = 1.5"):
        zb_auto(2, 4, mem_limit=1.4, mw=1.5)
    zb_auto(2, 4, mem_limit=1.5, mw=1.5)
    with pytest.raises(ValueError, match=r"must be >= 1 \+ max\(1, mw\) = 2.5"):
        zbv(2, 4, mem_limit=2.4, mw=1.5)


# --------------------------------------------------------------------------- users agree


def _loss_stage_slower(kind: str, p: int = 4) -> CostModel:
    values = [1.0] * (2 * p)
    values[-1] = 3.0
    return CostModel(**{kind: values}, t_w=0.0, t_comm=0.25)


def test_trace_estimate_leaves_unmeasured_fb_stages_to_the_pair_rule():
    """A DualPipeV run of 6 micro-batches on 4 ranks has no FB ops whose forward is on stage 0 or 1.
    Costs read off it time those stages' FB ops as their halves back to back, so a longer run
    predicted from them is the run simulated with the true costs. (The old estimate gave them the
    mean FB of the other stages, which holds the slow loss stage's pair: 60.83 for 60.5 at m=8.)"""
    from twinpipe.trace import estimate_costs

    costs = _loss_stage_slower("t_f")
    traced = simulate(registry.build("dualpipev", 4, 6), costs)
    got = estimate_costs(traced)
    assert got.t_fb[:2] == [None, None] and got.t_fb[7] == 4.0
    for m in (8, 12, 16):
        truth, predicted = (summarize(registry.build("dualpipev", 4, m), c) for c in (costs, got))
        assert predicted.makespan == pytest.approx(truth.makespan) and predicted.busy == pytest.approx(truth.busy)


def test_trace_estimate_of_a_stage_that_ran_only_full_backwards():
    """Stages 3 and 4 of that run ran BW ops and no B: their T_B is their own BW time, not the
    mean B of the other stages (which holds the slow loss stage: the old estimate predicted the
    traced run itself at 43.67 for 43)."""
    from twinpipe.trace import estimate_costs, predict

    costs = _loss_stage_slower("t_b")
    schedule = registry.build("dualpipev", 4, 6)
    traced = simulate(schedule, costs)
    got = estimate_costs(traced)
    assert [b + w for b, w in zip(got.t_b, got.t_w)] == pytest.approx([1.0] * 7 + [3.0])
    assert predict(traced, schedule).makespan == pytest.approx(traced.makespan)


def test_traced_planner_costs_average_only_the_measured_fb_stages():
    from twinpipe.plan.measured import traced_costs

    traced = simulate(registry.build("dualpipev", 4, 6), _loss_stage_slower("t_f"))
    costs, _ = traced_costs(traced)
    measured = [2.0, 2.0, 2.0, 2.0, 2.0, 4.0]  # stages 2..7, each half a 1F1B stage
    assert costs.t_fb == pytest.approx(sum(t / 0.5 for t in measured) / len(measured))


def test_planner_pair_without_all_to_all_is_its_halves():
    from twinpipe.plan.costs import LayerTimes

    layer = LayerTimes(1.0, 2.0, 1.5, 3.0, 2.5, 2.0, a2a=0.0)
    assert layer.fb() == pair_time(layer.f, layer.b + layer.w)
    moe = LayerTimes(1.0, 2.0, 1.5, 3.0, 2.5, 2.0, a2a=0.7)
    assert moe.fb() < moe.f + moe.b + moe.w  # the all-to-alls hide behind the other half's compute


def test_bitpipe_runs_in_the_papers_units():
    """BitPipe's list scheduler times a chunk's forward as 1 and its full backward as 2 (op_time
    with unit T_F, T_B, T_W): one basic unit on 4 ranks spans 28 for 24 of work (the paper's figure)."""
    schedule = registry.build("bitpipe", 4, 4)
    timeline = simulate(schedule, for_model(CostModel(t_f=1, t_b=1, t_w=1), schedule.placement))
    assert timeline.cost / max(st.busy for st in timeline.per_rank()) == pytest.approx(28 / 24)
