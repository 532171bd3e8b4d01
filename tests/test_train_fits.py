"""``twinpipe train`` refuses, before any rank starts, a run the machine cannot hold: one line with
what the fullest rank needs and what a rank has here (exit 2). The estimate behind it: each GPT
stage's activations against the stage measured alone (``measure_stage``)."""

from __future__ import annotations

import pytest

from in_process import run_in_process


@pytest.mark.parametrize("options", ["--dim 1000000",
                                     "--batch-size 1000000000 --microbatch-size 1000000 --corpus-bytes 70000000000"])
def test_a_run_too_big_is_refused_before_any_rank_starts(tmp_path, options):
    done = run_in_process(["train", *options.split(), "--steps", "1", "--out", "big"], tmp_path)  # the console script's function
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "needs about" in lines[0] and "per rank" in lines[0] and "this machine has" in lines[0], lines[0]
    assert not (tmp_path / "big").exists()  # nothing started, nothing written


def test_stage_activation_estimate_within_10_percent_of_the_measured_stage():
    import torch

    from twinpipe.runtime.memory import measure_stage
    from twinpipe.train.fits import stage_activation_bytes
    from twinpipe.train.model import GPT, GPTConfig, lm_loss
    from twinpipe.train.stages import split

    cfg = GPTConfig(vocab=256, seq_len=32, dim=64, heads=4, layers=4)
    torch.manual_seed(0)
    embed, blocks, head = split(GPT(cfg), 3, [1, 4, 1])
    ids = torch.randint(0, cfg.vocab, (4, cfg.seq_len))
    with torch.no_grad():
        h = embed(ids)
        out = blocks(h)
    for stage, inputs, extra in ((blocks, (h,), {}), (head, (out,), dict(criterion=lm_loss, labels=(ids,)))):
        measured = measure_stage(stage, inputs, **extra).m_b
        estimate = stage_activation_bytes(stage.names, cfg, 4, 4)
        assert abs(measured - estimate) <= 0.1 * measured, (stage.names, measured, estimate)


def test_zbv_and_zb_auto_are_planned_with_the_measured_mw():
    """The trainer's options for ZB-V and zb-auto carry the M_W/M_B its stages measure (unless given);
    ZB-V's plan then keeps its design limit under that M_W."""
    import dataclasses

    import torch

    from twinpipe.schedule import resolve
    from twinpipe.sim import CostModel, summarize
    from twinpipe.train.memory import measured_mw, planned_options
    from twinpipe.train.model import GPT, GPTConfig, lm_loss
    from twinpipe.train.data import BatchSampler
    from twinpipe.train.config import TrainConfig

    cfg = GPTConfig(vocab=32, seq_len=8, dim=16, heads=2, layers=6)
    torch.manual_seed(0)
    model = GPT(cfg)
    sampler = BatchSampler(torch.randint(0, cfg.vocab, (4096,)), cfg.seq_len, seed=0)
    config = TrainConfig(schedule="zbv", batch_size=16, microbatch_size=2)
    x, y = sampler.batch(0, 2)
    mw = measured_mw(model, 8, (x, y), lm_loss)
    assert 0 < mw
    for name in ("zbv", "zb-auto"):
        options = planned_options(dataclasses.replace(config, schedule=name), model, sampler, lm_loss, 4, "cpu")
        assert options["mw"] == round(mw if name == "zbv" else measured_mw(model, 4, (x, y), lm_loss), 3), options
    assert "mw" not in planned_options(dataclasses.replace(config, schedule="1f1b"), model, sampler, lm_loss, 4, "cpu")
    given = dataclasses.replace(config, schedule_options=(("mw", 0.25),))
    assert planned_options(given, model, sampler, lm_loss, 4, "cpu") == {"mw": 0.25}
    spec = resolve("zbv", 4, mw=round(mw, 3))
    peak = max(summarize(spec.build(16), CostModel(mw=round(mw, 3))).peak)
    assert peak <= 2 * 4, peak


def test_the_planner_names_the_memory_parts_as_the_report_does():
    from twinpipe.plan.spec import Cluster, Model
    from twinpipe.plan.predict import predict_one
    from twinpipe.sim.memory import PARTS

    pred = predict_one("1f1b", Model(layers=4, hidden=256, seq=128), Cluster(gpus=4), 4, 8)
    assert set(PARTS) <= set(pred.memory)
    assert pred.memory["total"] == sum(pred.memory[k] for k in PARTS)
    assert pred.memory["master"] == 4 * pred.memory["params"] / 2  # bf16 weights: FP32 masters apart from the moments
