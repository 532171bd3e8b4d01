"""Checkpoints written by an older twinpipe still load: ``twinpipe train --resume`` of the step-2
checkpoints in tests/data/checkpoints-6ce1387 (written by the main of issue 30, before the trainer
was split into parts) continues the old run as if it had never stopped.

Each case's steps 2 and 3 must give the losses and gradient norms that old run logged without a
stop. Step 2 runs on the loaded weights; step 3 on weights the loaded optimizer state updated (the
Adam moments, ZeRO-1's shards, bf16-mixed's FP32 masters, the experts of each EP or data-parallel
rank). The stored values are this CPU's; float64 runs on another CPU's kernels agree to ~1e-15,
hence the 1e-12 bound; bf16-mixed, whose float32 sums another CPU may order otherwise, to 1e-6
(a wrong master or optimizer state moves step 3 by ~1e-3).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from in_process import run_in_process

DATA = Path(__file__).parent / "data"
OLD = DATA / "checkpoints-6ce1387"
CASES = json.loads((OLD / "cases.json").read_text())["cases"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_checkpoint_of_an_older_twinpipe_continues_its_run(tmp_path, name):
    if name.startswith("qwen3"):
        pytest.importorskip("transformers")
    case = CASES[name]
    shutil.copytree(OLD / name / "checkpoint-step2", tmp_path / "old" / "checkpoint-step2")
    shutil.copy(OLD / "tokens.npy", tmp_path / "tokens.npy")
    argv = case["argv"].format(**{"tiny-qwen3-moe": str(DATA / "tiny-qwen3-moe"), "tokens": "tokens.npy"}).split()
    done = run_in_process(argv + ["--resume", "old/checkpoint-step2", "--out", "new"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = {s["step"]: s for s in json.loads((tmp_path / "new" / "train-log.json").read_text())["steps"]}
    assert sorted(steps) == [2, 3]
    rel = 1e-6 if "bf16-mixed" in argv else 1e-12
    for old in case["steps"]:
        new = steps[old["step"]]
        for key in ("loss", "grad_norm"):
            assert new[key] == pytest.approx(old[key], rel=rel, abs=0), (old["step"], key)
