"""twinpipe plan: the same engine as `twinpipe simulate`, exact extrapolation to large m, the step's
collectives and memory, impossible cases as "does not fit: why", the traced-run path, the CLI.
"""

from __future__ import annotations

import json

import pytest

from twinpipe.cli import main
from twinpipe.plan import Cluster, Model, plan, predict_one
from twinpipe.plan.costs import all_reduce_time, layout, stage_costs
from twinpipe.plan.measured import load_traced
from twinpipe.plan.predict import PLANNED_CAP
from twinpipe.schedule import registry
from twinpipe.sim import CostModel, simulate
from twinpipe.sim.costs import for_model
from twinpipe.trace import write_chrome_trace

SMALL_DENSE = Model(layers=24, hidden=2048, seq=2048)
LARGE_MOE = Model(layers=48, hidden=5120, seq=4096, experts=128, top_k=8, expert_ffn=1536, ep=8)
COSTS = CostModel(t_f=1.0, t_b=1.2, t_w=0.8, t_comm=0.05)


def _engine_makespan(name: str, p: int, m: int, costs: CostModel) -> float:
    """What `twinpipe simulate --hold model` times: the schedule under the costs scaled to its placement."""
    placement = registry.placement_for(name, p)
    scaled = for_model(costs, placement)
    options = {k: getattr(scaled, k) for k in ("t_f", "t_b", "t_w", "t_comm", "mw") if k in (registry.get(name).options or ())}
    return simulate(registry.build(name, p, m, **options), scaled).makespan


@pytest.mark.parametrize("name", registry.names())
def test_pipeline_time_is_the_simulators(name):
    pred = predict_one(name, None, Cluster(gpus=4), 4, 8, costs=COSTS)
    assert pred.fits, pred.why
    assert pred.extrapolated_from is None
    assert pred.pipeline == pytest.approx(_engine_makespan(name, 4, 8, COSTS), rel=1e-12)
    assert pred.step_time == pred.pipeline  # no model: no all-reduce counted


@pytest.mark.parametrize("name", registry.names())
def test_every_large_m_answer_matches_a_whole_simulation(name):
    # Extended from a linear triple, or (not linear yet, and small enough) simulated whole: never a guess here.
    costs = CostModel(t_f=1.0, t_b=1.2, t_w=0.8, t_comm=0.05, t_fb=2.5)
    pred = predict_one(name, None, Cluster(gpus=4), 4, 48, costs=costs)
    assert pred.fits, pred.why
    assert pred.extrapolated_from is None or len(pred.extrapolated_from) == 2
    assert pred.pipeline == pytest.approx(_engine_makespan(name, 4, 48, costs), rel=1e-9)


@pytest.mark.parametrize("name", ["1f1b", "zb-h2", "interleaved-1f1b", "dualpipe", "dualpipev", "gpipe"])
def test_large_m_extends_exact_simulations_linearly(name):
    pred = predict_one(name, None, Cluster(gpus=4), 4, 64, costs=COSTS)
    assert pred.extrapolated_from is not None and len(pred.extrapolated_from) == 2  # exact, not approximate
    assert pred.pipeline == pytest.approx(_engine_makespan(name, 4, 64, COSTS), rel=1e-9)


def test_gpipe_memory_grows_with_m_and_1f1b_does_not():
    cluster = Cluster(gpus=4, memory=1e15)
    act = {(n, m): predict_one(n, SMALL_DENSE, cluster, 4, m).memory["activations"] for n in ("gpipe", "1f1b") for m in (32, 64)}
    assert act[("gpipe", 64)] == pytest.approx(2 * act[("gpipe", 32)])
    assert act[("1f1b", 64)] == act[("1f1b", 32)]
    _, _, m_b = stage_costs(SMALL_DENSE, cluster, layout(SMALL_DENSE, cluster, 4))
    assert act[("1f1b", 32)] == pytest.approx(4 * m_b)  # 1F1B's first rank holds p micro-batches


def test_copies_of_the_weights_pay_their_all_reduce_and_memory():
    cluster = Cluster(gpus=32)
    one = predict_one("1f1b", SMALL_DENSE, cluster, 4, 32)
    two = predict_one("dualpipe", SMALL_DENSE, cluster, 4, 32)
    assert one.copies == 1 and one.mirror_all_reduce == 0
    assert two.copies == 2 and two.mirror_all_reduce > 0
    assert two.memory["params"] == pytest.approx(2 * one.memory["params"], rel=0.02)  # embedding and head shift a little
    assert len(two.memory_per_rank) == 4 and max(two.memory_per_rank) == two.memory["total"]
    assert one.memory_per_rank[0] > one.memory_per_rank[1]  # 1F1B's first rank holds the most activations
    grad_bytes = two.memory["grads"]
    assert two.mirror_all_reduce == pytest.approx(all_reduce_time(grad_bytes, 2, cluster.inter_bw, cluster.latency))
    for name in registry.names():
        chains = len(registry.placement_for(name, 4).chains)
        pred = predict_one(name, SMALL_DENSE, cluster, 4, 32)
        assert (pred.mirror_all_reduce > 0) == (chains > 1) or not pred.fits, name
    four = predict_one("chimera", SMALL_DENSE, cluster, 4, 32, options={"pairs": 2})  # 2k = 4 copies of every stage
    assert four.label == "chimera pairs=2" and four.copies == 4
    assert 3.5 < four.memory["params"] / one.memory["params"] < 4.0  # four copies of the layers; the embedding and head spread
    assert four.mirror_all_reduce == pytest.approx(all_reduce_time(four.memory["grads"], 4, cluster.inter_bw, cluster.latency))


def test_the_seed_observation_dualpipe_behind_1f1b_small_dense_ahead_large_moe():
    small = {n: predict_one(n, SMALL_DENSE, Cluster(gpus=32), 4, 32) for n in ("1f1b", "dualpipe")}
    assert small["dualpipe"].pipeline < small["1f1b"].pipeline  # smaller bubble ...
    assert small["dualpipe"].step_time > small["1f1b"].step_time  # ... lost to the all-reduce between copies
    assert small["dualpipe"].limit.startswith("all-reduce between its 2 weight copies")
    large = {n: predict_one(n, LARGE_MOE, Cluster(gpus=256), 16, 64) for n in ("1f1b", "dualpipe")}
    assert all(p.fits for p in large.values())
    assert large["dualpipe"].step_time < large["1f1b"].step_time
    hidden = large["dualpipe"].a2a_hidden / (large["dualpipe"].a2a_hidden + large["dualpipe"].a2a_exposed)
    assert 0.5 < hidden < 0.8 and large["1f1b"].a2a_hidden == 0  # F&B hides most of DualPipe's all-to-all
    assert large["1f1b"].limit.startswith("pipeline bubble") or "all-to-all" in large["1f1b"].limit


def test_impossible_cases_are_reported_per_schedule_never_raised():
    tiny = Cluster(gpus=8, memory=2**30)
    results = plan(SMALL_DENSE, tiny, 3, pp_sizes=[2, 3, 4, 64])
    assert len(results) == sum(len(registry.variants(n, p)) for p in (2, 3, 4, 64) for n in registry.names())
    by = {(r.schedule, r.pp): r for r in results}
    assert all(not r.fits and r.why for r in results)
    assert by[("1f1b", 2)].why.startswith("does not fit: needs") and "GiB available" in by[("1f1b", 2)].why
    assert "pipeline size 3 does not divide the 8 GPUs" in by[("1f1b", 3)].why
    assert "before any activation" in by[("dualpipe", 2)].why  # the weights alone are too large: not simulated
    assert "num_chunks=3" in predict_one("dualpipe", SMALL_DENSE, Cluster(gpus=8), 2, 3).why  # an odd count: two directions
    assert "does not divide" in by[("1f1b", 64)].why


def test_expert_parallelism_defaults_to_what_divides_the_replicas():
    moe = Model(layers=4, hidden=64, seq=64, experts=8, top_k=2)
    assert [layout(moe, Cluster(gpus=g), p).ep for g, p in ((8, 2), (64, 4), (24, 2), (8, 8))] == [4, 8, 4, 1]
    assert predict_one("1f1b", moe, Cluster(gpus=8), 2, 8).fits
    fixed = Model(layers=4, hidden=64, seq=64, experts=8, top_k=2, ep=8)
    assert "expert parallelism ep=8 does not divide the data-parallel size 4" in predict_one("1f1b", fixed, Cluster(gpus=8), 2, 8).why


def test_too_few_microbatches_and_uneven_layers_say_why():
    cluster = Cluster(gpus=8)
    assert "num_microbatches=6" in predict_one("interleaved-1f1b", SMALL_DENSE, cluster, 4, 6).why
    odd = Model(layers=6, hidden=512, seq=512)
    assert predict_one("dualpipev", odd, cluster, 4, 8).why == "does not fit: 6 layers do not split evenly into its 8-stage chain(s) on 4 ranks"


def test_searching_schedules_are_skipped_at_large_sizes_and_say_so():
    big = [n for n in registry.names() if registry.get(n).max_pairs < 2**17]
    assert big, "the registry has searching schedules"
    for name in big:
        pred = predict_one(name, None, Cluster(gpus=64), 64, 1024, costs=COSTS)
        assert pred.why.startswith(f"skipped: {name} searches its order") and str(PLANNED_CAP) in pred.why


def test_traced_run_round_trip_predicts_its_own_makespan(tmp_path):
    # A run recorded as trace.json (here a simulated one, whose costs we know) feeds the plan.
    costs = CostModel(t_f=[1.0, 1.5, 1.5, 1.0], t_b=1.25, t_w=0.5, t_comm=0.125)
    timeline = simulate(registry.build("zb-h1", 4, 12), costs)
    path = write_chrome_trace(timeline, tmp_path / "trace.json")
    traced = load_traced(path)
    assert (traced.schedule, traced.pp, traced.microbatches, traced.split_assumed) == ("zb-h1", 4, 12, False)
    assert traced.costs.t_f == pytest.approx(1.25) and traced.costs.t_w == pytest.approx(0.5)
    assert traced.costs.t_comm == pytest.approx(0.125)
    uniform = simulate(registry.build("zb-h1", 4, 12), CostModel(t_f=1.25, t_b=1.25, t_w=0.5, t_comm=0.125)).makespan
    pred = predict_one("zb-h1", None, Cluster(gpus=4), 4, 12, costs=traced.costs)
    assert pred.pipeline == pytest.approx(uniform, rel=1e-6)
    assert traced.costs_at(2).t_f == pytest.approx(2.5)  # half the ranks: each stage holds twice the model
    # On its own placement a schedule keeps the per-stage times: the traced one comes back exactly.
    by = {(r.schedule, r.pp): r for r in plan(None, Cluster(gpus=4), 12, [4, 2], costs_for=traced.costs_for)}
    assert by[("zb-h1", 4)].pipeline == pytest.approx(timeline.makespan, rel=1e-6)
    assert by[("1f1b", 4)].pipeline == pytest.approx(simulate(registry.build("1f1b", 4, 12), costs).makespan, rel=1e-6)
    assert by[("zb-h1", 2)].pipeline == pytest.approx(predict_one("zb-h1", None, Cluster(gpus=4), 2, 12, traced.costs_at(2)).pipeline)


def test_full_backwards_only_split_in_halves(tmp_path):
    timeline = simulate(registry.build("1f1b", 2, 4), CostModel(t_f=1.0, t_b=2.0, t_w=1.0))
    traced = load_traced(write_chrome_trace(timeline, tmp_path / "trace.json"))
    assert traced.split_assumed and traced.costs.t_b == pytest.approx(1.5) and traced.costs.t_w == pytest.approx(1.5)
    assert traced.per_stage.t_b == pytest.approx([1.5, 1.5]) and traced.per_stage.t_w == pytest.approx([1.5, 1.5])
    by = {r.schedule: r for r in plan(None, Cluster(gpus=2), 4, [2], costs_for=traced.costs_for)}
    assert all(r.fits for r in by.values()), [r.why for r in by.values() if not r.fits]
    assert by["1f1b"].pipeline == pytest.approx(timeline.makespan)


def test_counts_are_checked_before_anything_runs():
    with pytest.raises(ValueError, match=r"microbatches=0: must be >= 1"):
        plan(SMALL_DENSE, Cluster(gpus=8), 0)
    with pytest.raises(ValueError, match=r"pp_sizes=\[2.5\]: must be a non-empty sequence of ints >= 1"):
        plan(SMALL_DENSE, Cluster(gpus=8), 8, pp_sizes=[2.5])
    with pytest.raises(ValueError, match=r"pp=True"):
        predict_one("1f1b", SMALL_DENSE, Cluster(gpus=8), True, 8)
    with pytest.raises(ValueError, match=r"schedule='nope': allowed are "):
        plan(SMALL_DENSE, Cluster(gpus=8), 8, schedules=["nope"])


def test_model_and_cluster_refuse_bad_values():
    with pytest.raises(ValueError, match=r"model.layers=0: must be >= 1"):
        Model(layers=0, hidden=8, seq=8)
    with pytest.raises(ValueError, match=r"model.top_k=9: must be <= experts=8"):
        Model(layers=2, hidden=8, seq=8, experts=8, top_k=9)
    with pytest.raises(ValueError, match=r"cluster.efficiency=1.5"):
        Cluster(gpus=8, efficiency=1.5)
    with pytest.raises(ValueError, match=r"cluster.inter_bw=nan"):
        Cluster(gpus=8, inter_bw=float("nan"))


# --------------------------------------------------------------------------- the command


def test_cli_table_json_and_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one line per row
    args = ["plan", "--layers", "8", "--dim", "512", "--seq-len", "512", "--gpus", "8", "--microbatches", "16", "--pp", "2,4"]
    assert main(args + ["--plot", str(tmp_path / "plan.png")]) == 0
    out = capsys.readouterr().out
    assert "what limits it" in out and "dualpipe" in out and (tmp_path / "plan.png").stat().st_size > 1000
    assert main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == sum(len(registry.variants(n, p)) for p in (2, 4) for n in registry.names())
    assert {r["label"] for r in rows if r["schedule"] == "chimera" and r["pp"] == 4} == {"chimera", "chimera pairs=2"}
    fitting = [r for r in rows if r["fits"]]
    assert fitting and [r["tokens_per_s"] for r in fitting] == sorted((r["tokens_per_s"] for r in fitting), reverse=True)


def test_cli_from_trace(tmp_path, capsys):
    path = write_chrome_trace(simulate(registry.build("dualpipev", 2, 4), CostModel(t_f=0.01, t_b=0.01, t_w=0.01)), tmp_path / "trace.json")
    assert main(["plan", "--from-trace", str(path), "--json"]) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(registry.names()) and rows["dualpipev"]["pp"] == 2 and rows["dualpipev"]["microbatches"] == 4


@pytest.mark.parametrize("extra,message", [
    ([], "missing --gpus"),
    (["--gpus", "8"], "missing --microbatches"),
    (["--gpus", "8", "--microbatches", "8", "--pp", "two"], "--pp='two'"),
    (["--gpus", "8", "--microbatches", "0"], "microbatches=0: must be >= 1"),
    (["--gpus", "0", "--microbatches", "8"], "cluster.gpus=0: must be >= 1"),
    (["--gpus", "8", "--microbatches", "8", "--schedules", "nope"], "schedule='nope': allowed are "),
    (["--gpus", "8", "--microbatches", "8", "--experts", "4", "--top-k", "5"], "model.top_k=5"),
])
def test_cli_bad_input_names_the_option(extra, message, capsys):
    assert main(["plan", "--layers", "8", "--dim", "512", "--seq-len", "512", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_trace_says_its_options_and_one_that_does_not_match_is_refused(tmp_path):
    timeline = simulate(registry.build("interleaved-1f1b", 2, 6, stages_per_rank=3))
    path = write_chrome_trace(timeline, tmp_path / "trace.json")
    assert load_traced(path).timeline.placement.num_stages == 6  # 3 stages per rank, as built
    data = json.loads(path.read_text())
    del data["otherData"]["options"]  # read as the default placement: 2 stages per rank
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"does not match interleaved-1f1b's placement on 2 ranks with options \{\}"):
        load_traced(path)


def test_a_traced_chimera_with_pairs_plans_its_own_variant_with_its_stage_times(tmp_path):
    costs = CostModel(t_f=[0.01 * (1 + s % 3) for s in range(16)], t_b=0.01, t_w=0.005)
    timeline = simulate(registry.build("chimera", 4, 8, pairs=2), costs)
    traced = load_traced(write_chrome_trace(timeline, tmp_path / "trace.json"))
    rows = {r.label: r for r in plan(None, Cluster(gpus=4), 8, [4], ["chimera"], costs_for=traced.costs_for)}
    assert set(rows) == {"chimera", "chimera pairs=2"} and all(r.fits for r in rows.values())
    assert rows["chimera pairs=2"].pipeline == pytest.approx(timeline.makespan, rel=1e-9)


def test_cli_missing_model_or_bad_trace(tmp_path, capsys):
    assert main(["plan", "--gpus", "8", "--microbatches", "8"]) == 2
    assert "missing --layers, --dim, --seq-len" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["plan", "--from-trace", str(tmp_path / "bad.json")]) == 2
    assert "not a twinpipe Chrome trace" in capsys.readouterr().err


def test_workers_give_the_same_plan_as_one_process():
    # Predictions made in a process pool come back equal, field by field, and ranked the same.
    args = (LARGE_MOE, Cluster(gpus=64), 48, [4, 8, 16])
    serial = plan(*args, workers=1)
    assert plan(*args, workers=3) == serial
    assert [(r.schedule, r.pp) for r in plan(*args)] == [(r.schedule, r.pp) for r in serial]


@pytest.mark.parametrize("workers", [0, -2, 1.5, True, "4"])
def test_workers_must_be_a_positive_integer(workers):
    with pytest.raises(ValueError, match=rf"workers={workers!r}: must be (an int )?>= 1$"):
        plan(SMALL_DENSE, Cluster(gpus=8), 8, workers=workers)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "dualpipev"])
def test_a_run_on_fewer_cores_than_ranks_is_predicted_with_them_shared(tmp_path, name):
    # A 4-rank run that shared 2 cores (simulated, so its op times alone are known): the trace says
    # where it ran, the op times come back as times alone, and the plan shares the cores again.
    costs = CostModel(t_f=[1.0, 1.5, 1.5, 1.0] if name != "dualpipev" else 1.0, t_b=1.25, t_w=0.5, t_comm=0.125, cores=2)
    timeline = simulate(registry.build(name, 4, 12), costs)
    timeline.meta.update(hosts=["node0"] * 4, cores=[2] * 4, threads=[1] * 4)
    traced = load_traced(write_chrome_trace(timeline, tmp_path / "trace.json"))
    assert traced.costs.cores == 2 and traced.per_stage.cores == 2
    assert traced.per_stage.t_f == pytest.approx([1.0, 1.5, 1.5, 1.0] if name != "dualpipev" else [1.0] * 8)
    pred = predict_one(name, None, Cluster(gpus=4), 4, 12, costs=traced.costs_for(name, 4))
    assert pred.pipeline == pytest.approx(timeline.makespan, rel=1e-6)
    # Told nothing about its cores, the same trace reads as slower ops on four processors.
    timeline.meta.update(cores=[8] * 4)
    alone = load_traced(write_chrome_trace(timeline, tmp_path / "trace.json"))
    assert alone.costs.cores is None and alone.per_stage.t_f[0] > 1.0


def test_workers_never_run_the_callers_script_again(tmp_path):
    # An unguarded script (no `if __name__ == "__main__"`): workers that re-imported __main__, as
    # spawn and forkserver do, would print its line once more each, or crash.
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("from twinpipe.plan import Cluster, Model, plan\nprint('script ran')\n"
                      "rows = plan(Model(layers=8, hidden=256, seq=256), Cluster(gpus=8), 16, [2, 4], workers=2)\n"
                      "print(len(rows), 'rows')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = sum(len(registry.variants(n, p)) for p in (2, 4) for n in registry.names())
    assert out.stdout.split("\n")[:2] == ["script ran", f"{rows} rows"]


def test_a_registered_schedule_is_checked_on_every_simulation(monkeypatch):
    # Built-in generators are validated by their tests; one a user registers is checked at every use,
    # so a schedule that forgets an op is a row that says so, not a fast wrong makespan.
    def forgetful(p, m):
        schedule = registry.build("1f1b", p, m)
        return schedule.with_ops([list(ops[:-1]) if rank == 0 else list(ops) for rank, ops in enumerate(schedule.ops)])

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register("forgetful-1f1b", forgetful, registry.get("1f1b").placement, "1F1B missing rank 0's last op")
    pred = predict_one("forgetful-1f1b", None, Cluster(gpus=4), 4, 64, costs=COSTS)
    assert not pred.fits and "missing op" in pred.why
    assert predict_one("1f1b", None, Cluster(gpus=4), 4, 64, costs=COSTS).fits


@pytest.mark.parametrize("moe", [{}, {"experts": 8, "top_k": 2}])
def test_the_planner_reads_the_model_the_trainer_builds(moe):
    # Model.from_config reads the trainer's GPTConfig: the same model, counted within 1% (the planner
    # leaves biases, norms and position embeddings out of its count).
    from twinpipe.train.model import GPT, GPTConfig

    cfg = GPTConfig(seq_len=64, dim=256, heads=4, layers=3, **moe)
    model = Model.from_config(cfg, microbatch_size=2)
    assert (model.layers, model.hidden, model.seq, model.vocab, model.experts, model.microbatch_size) == (3, 256, 64, 256, cfg.experts, 2)
    built = sum(p.numel() for p in GPT(cfg).parameters())
    assert model.total_params() == pytest.approx(built, rel=0.01)
    assert Model.from_config(cfg, expert_ffn=64).expert_width == (64 if moe else 1024)
