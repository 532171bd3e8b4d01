"""The time of an F&B op whose backward half is a B (its W deferred to a W op: ZB-H1/H2, ZB-V with
``overlap``): one cost model with the F&B of a full backward (issue 32). The planner predicts both
pair times from ``sim.overlap.predict_fb``'s part order (``t_fb``, ``t_fb_b``); where ``t_fb_b`` is
not given a B half's pair takes its halves back to back. Pure Python: no process group."""

from __future__ import annotations

from dataclasses import replace

import pytest

from twinpipe.cli import main
from twinpipe.plan import Cluster, Model
from twinpipe.plan.costs import layer_times, layout, stage_costs
from twinpipe.schedule.costs import CostModel, op_costs, op_time
from twinpipe.schedule.ops import B, BW, F, FB, OpKind
from twinpipe.schedule.spec import resolve
from twinpipe.sim import predict_fb, simulate, summarize
from twinpipe.sim.costs import for_model

MOE = Model(layers=16, hidden=1024, seq=1024, experts=16, top_k=2, expert_ffn=2048, ep=8, vocab=512)
CLUSTER = Cluster(gpus=64)


def _planned(pp: int = 4) -> tuple[CostModel, object]:
    lay = layout(MOE, CLUSTER, pp)
    costs, _, _ = stage_costs(MOE, CLUSTER, lay)
    return costs, layer_times(MOE, CLUSTER, lay)


def test_a_b_halfs_pair_is_the_part_order_prediction_without_the_w_parts():
    costs, per = _planned()
    assert per.a2a > 0
    forward = [("compute", per.attn_f), ("comm", per.a2a), ("compute", per.mlp_f), ("comm", per.a2a)]
    backward = [("comm", per.a2a), ("compute", per.mlp_b), ("comm", per.a2a), ("compute", per.attn_b)]
    layers = MOE.layers / 4
    table = op_costs(costs, 2)
    pair = table.pair(0, 1, OpKind.B)
    assert pair == pytest.approx(layers * predict_fb(forward, backward))
    assert pair < table.t_f[0] + table.t_b[1]  # the all-to-alls hide behind the other half's compute
    # the same prediction as a full backward's pair, less the W parts
    assert table.pair(0, 1, OpKind.BW) == pytest.approx(layers * predict_fb(forward, backward, weight=[0, per.mlp_w, 0, per.attn_w]))
    assert op_time(FB(F(0, 1), B(1, 0)), costs) == pytest.approx(pair)


def test_each_pair_time_answers_for_its_own_backward_kind_keyed_by_the_forward_stage():
    costs = CostModel(t_f=[1.0, 2.0], t_b=[2.0, 3.0], t_w=0.5, t_fb=[2.5, None], t_fb_b=[None, 1.5])
    assert op_time(FB(F(0, 1), BW(1, 0)), costs) == 2.5
    assert op_time(FB(F(0, 1), B(1, 0)), costs) == 1.0 + 3.0  # not given for stage 0: back to back, not t_fb
    assert op_time(FB(F(1, 1), B(0, 0)), costs) == 1.5
    assert op_time(FB(F(1, 1), BW(0, 0)), costs) == 2.0 + 2.5
    with pytest.raises(ValueError, match=r"t_fb_b\[1\]"):
        CostModel(t_fb_b=[1.0, -1.0])


def test_without_t_fb_b_a_b_halfs_pair_takes_its_halves_back_to_back():
    costs = CostModel(t_f=1.0, t_b=2.0, t_w=0.5, t_fb=2.0)
    timeline = simulate(resolve("zb-h1", 2, overlap=True).build(4), costs)
    fb = [s for s in timeline.slices if s.op is not None and s.op.kind is OpKind.FB]
    assert fb and all(s.end - s.start == pytest.approx(3.0) for s in fb)


def test_t_fb_b_scales_with_a_stage_like_the_other_times():
    spec = resolve("zbv", 4)
    scaled = for_model(CostModel(t_fb_b=3.0), spec.placement)
    assert scaled.t_fb_b == pytest.approx(1.5)  # a V's stage is half a 1F1B stage


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zbv"])
def test_overlapped_zero_bubble_schedules_gain_from_the_predicted_b_pair(name):
    """With the planner's costs each B-half pair is shorter than its halves, so the overlapped
    schedule is faster than with its pairs back to back. Against the schedule without overlap
    (docs/schedules.md, "How to choose"): ZB-H2 (its warm-up leaves room) is faster; ZB-H1's and
    ZB-V's pairs couple neighbour ranks ("Time") and leave them slower."""
    costs, _ = _planned()
    spec = resolve(name, 4, overlap=True, warmup_extra=1)
    scaled = for_model(costs, spec.placement)
    over = summarize(spec.build(16), scaled).makespan
    back_to_back = summarize(spec.build(16), replace(scaled, t_fb_b=None)).makespan
    assert over < 0.9 * back_to_back, (over, back_to_back)
    plain = summarize(resolve(name, 4).build(16), scaled).makespan
    assert (over < 0.9 * plain) if name == "zb-h2" else (over > plain), (over, plain)


def test_simulate_takes_fb_b_and_checks_it(capsys):
    args = ["simulate", "zb-h2", "--pp", "4", "--microbatches", "16", "--overlap", "--overlap-warmup", "1", "--json"]
    assert main(args) == 0
    back_to_back = capsys.readouterr().out
    assert main(args + ["--fb-b", "1.5"]) == 0
    given = capsys.readouterr().out
    import json

    assert json.loads(given)["makespan"] < json.loads(back_to_back)["makespan"]
    assert main(args + ["--fb-b", "-1"]) == 2
    assert "--fb-b" in capsys.readouterr().err


def test_a_traced_run_gives_each_pair_kind_its_own_time():
    """Measured F&B ops with a B half are T_FB_B, not T_FB (a pair with a full backward): the
    planner fed a traced ZB-H1 run must not time DualPipe's pairs by them."""
    from twinpipe.plan.measured import Traced, traced_costs
    from twinpipe.trace import estimate_costs

    timeline = simulate(resolve("zb-h1", 2, overlap=True).build(6), CostModel(t_f=1.0, t_b=2.0, t_w=0.5, t_fb_b=2.2))
    measured = estimate_costs(timeline, comm=False)
    assert measured.t_fb is None
    assert measured.t_fb_b[0] == pytest.approx(2.2)  # keyed by the forward's stage, None where no pair ran
    one_stage, _ = traced_costs(timeline)
    assert one_stage.t_fb is None and one_stage.t_fb_b == pytest.approx(2.2)
    # at twice the pipeline size a stage is half as large: its pair too
    assert Traced(timeline, "zb-h1", 2, 6, one_stage).costs_at(4).t_fb_b == pytest.approx(1.1)


def test_zbv_at_pipeline_2_forms_a_single_pair_on_rank_1():
    """Why bench/bench_overlap_all.py's ZB-V rows show no hidden share (docs/plan.md): rank 0 has no F&B op."""
    schedule = resolve("zbv", 2, overlap=True).build(8)
    assert [sum(op.kind is OpKind.FB for op in ops) for ops in schedule.ops] == [0, 1]
