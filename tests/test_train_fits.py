"""``twinpipe train`` refuses, before any rank starts, a run the machine cannot hold: one line with
what the fullest rank needs and what a rank has here (exit 2). The estimate behind it: each GPT
stage's activations against the stage measured alone (``measure_stage``)."""

from __future__ import annotations

import pytest

from typed import run_typed


@pytest.mark.parametrize("options", ["--dim 1000000",
                                     "--batch-size 1000000000 --microbatch-size 1000000 --corpus-bytes 70000000000"])
def test_a_run_too_big_is_refused_before_any_rank_starts(tmp_path, options):
    done = run_typed(f"twinpipe train {options} --steps 1 --out big", tmp_path, timeout=120)
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
