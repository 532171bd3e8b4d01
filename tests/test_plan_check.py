"""``twinpipe check``: a parallel plan checked on a small float64 copy of the user's model.

One 2-rank world runs the check's per-rank work (``plan_check.rank_differences``, what the command's
ranks run) for a dense tied Llama, a DeepSeek-V3 unlike the test data's, a Mixtral and a Qwen3-MoE
with its experts spread over 2 ranks: every group within its bound. One run of the command itself,
with a plugin on PYTHONPATH that halves the routed experts' gradients after the trainer scales
them (a wrong expert-gradient scaling, the field's common bug), must exit 1 naming that group only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="twinpipe check needs transformers (pip install twinpipe[hf])")

import hf_models  # noqa: E402
from distributed import run_world  # noqa: E402
from twinpipe.cli import main  # noqa: E402
from twinpipe.hf import plan_check  # noqa: E402
from twinpipe.hf.plan_check import PlanRequest, combine, group_of  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"

# Trainer.step's final scaling (twinpipe.train.step.scale_grads) with the fused routed-expert
# tensors ([experts, ...], the only 3-D parameters) halved once more: every other gradient is right.
WRONG_EXPERT_SCALING = '''
import twinpipe.train.step as trainer_step

_scale = trainer_step.scale_grads


def _halve_experts(params, count):
    params = list(params)
    _scale(params, count)
    for p in params:
        if p.dim() == 3 and p.grad is not None:
            p.grad.div_(2)


trainer_step.scale_grads = _halve_experts
'''


def _deepseek_v3():
    """Unlike tests/hf_models.py's: 2 shared experts, top-3 of 6 in 3 groups (2 kept), 2 dense layers,
    routed_scaling_factor 2.5, no top-k normalisation."""
    import transformers as tf

    common = dict(hf_models.COMMON, num_hidden_layers=4)
    return tf.DeepseekV3Config(**common, intermediate_size=24, moe_intermediate_size=8, num_key_value_heads=4,
                               n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=3, n_group=3, topk_group=2,
                               first_k_dense_replace=2, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
                               qk_nope_head_dim=4, v_head_dim=4, routed_scaling_factor=2.5, norm_topk_prob=False)


# name -> (config, schedule, pp, dp = ep)
PLANS = {
    "llama-tied-dualpipe-pp2": (lambda: hf_models.config("llama", tied=True, layers=2), "dualpipe", 2, 1),
    "deepseek_v3-dualpipe-pp2": (_deepseek_v3, "dualpipe", 2, 1),
    "mixtral-aux-zb-h1-pp2": (lambda: hf_models.config("mixtral", aux=True, layers=2), "zb-h1", 2, 1),
    "qwen3_moe-dualpipev-ep2": (lambda: hf_models.config("qwen3_moe", layers=2), "dualpipev", 1, 2),
}


def _plans_world(rank, world, requests):
    return {name: plan_check.rank_differences(rank, world, request) for name, request in requests.items()}


@pytest.fixture(scope="module")
def plan_rows(tmp_path_factory):
    requests = {}
    for name, (config, schedule, pp, dp) in PLANS.items():
        folder = tmp_path_factory.mktemp(name)
        config().save_pretrained(folder)
        requests[name] = PlanRequest(folder=str(folder), schedule=schedule, pp=pp, dp=dp, ep=dp, microbatches=4, timeout=60)
    per_rank = run_world(2, _plans_world, requests, timeout=600)
    return {name: combine([ranks[name] for ranks in per_rank]) for name in PLANS}


@pytest.mark.parametrize("name", list(PLANS))
def test_each_architecture_and_plan_is_within_the_bounds(plan_rows, name):
    rows = plan_rows[name]
    assert rows[0].group == "loss" and all(row.within for row in rows), rows
    expected = {"loss", "embeddings", "head", "attention", "norms"}
    expected |= {"router", "routed experts"} if "llama" not in name else {"dense MLP"}
    expected |= {"shared experts", "dense MLP"} if "deepseek" in name else {"dense MLP"} if "qwen3" in name else set()
    assert {row.group for row in rows} == expected, rows


def test_a_wrong_expert_gradient_scaling_fails_the_check_naming_the_routed_experts(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(WRONG_EXPERT_SCALING)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "twinpipe", "check", "--model", str(DATA / "tiny-qwen3-moe"),
                           "--pp", "1", "--ep", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = {line.split(" (")[0].split("  ")[0]: line for line in done.stdout.splitlines()}
    assert lines["routed experts"].endswith("EXCEEDED"), done.stdout
    assert float(lines["routed experts"].split()[3]) > 0.1  # half of each value: 0.5 relative
    others = [line for group, line in lines.items() if group in ("loss", "embeddings", "router", "attention", "norms", "head")]
    assert len(others) == 6 and all(line.endswith(" ok") for line in others), done.stdout
    assert done.stdout.splitlines()[-1] == "exceeded: routed experts"


@pytest.mark.parametrize("argv, message", [
    (["--model", "no/such/folder"], "--model='no/such/folder': must be a folder"),
    (["--model", str(DATA / "tiny-llama"), "--ep", "2"], "has no MoE layers to spread"),
    (["--model", str(DATA / "tiny-qwen3-moe"), "--ep", "4", "--dp", "2"], "--ep=4: must divide --dp=2"),
    (["--model", str(DATA / "tiny-qwen3-moe"), "--ep", "3"], "--ep=3: must divide the 4 experts"),
    (["--model", str(DATA / "tiny-llama"), "--schedule", "nope"], "--schedule='nope'"),
    (["--model", str(DATA / "tiny-llama"), "--pp", "0"], "--pp=0: must be"),
    (["--model", str(DATA / "tiny-llama"), "--schedule", "1f1b", "--pp", "8"], "--model="),
])
def test_bad_input_exits_2_with_one_line_naming_the_option(capsys, argv, message):
    assert main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("twinpipe check: error: ") and err.count("\n") == 1 and message in err, err


def test_groups_name_every_parameter_of_the_tested_architectures():
    import torch
    from transformers import AutoModelForCausalLM

    from twinpipe.hf.training import parameter_names

    for arch in ("llama", "qwen3_moe", "mixtral", "deepseek_v3", *hf_models.MORE):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_models.config(arch))
        names = [name for name, _ in parameter_names(model)]
        assert [n for n in names if group_of(n) == "other"] == [], arch
    assert group_of("model.layers.1.mlp.experts.gate_up_proj") == "routed experts"
    assert group_of("model.layers.1.mlp.shared_expert_gate.weight") == "shared experts"
    assert group_of("model.layers.1.mlp.gate.weight") == "router"
    assert group_of("model.layers.1.mlp.gate_proj.weight") == "dense MLP"
    assert group_of("model.layers.1.self_attn.q_norm.weight") == "attention"


def test_a_nan_gradient_is_never_within():
    rows = combine([[("loss", 0.0, 1.0, ()), ("router", float("nan"), 1.0, ("a",))],
                    [("router", 0.0, 1.0, ("b",))]])
    assert [(r.group, r.within, r.parameters) for r in rows] == [("loss", True, 0), ("router", False, 2)]


def test_the_docs_show_the_bounds_the_check_holds():
    """docs/hf.md's table of bounds is ``plan_check.BOUNDS``, row for row."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "hf.md").read_text()
    section = text.split("## Check your own plan", 1)[1].split("\n## ", 1)[0]
    table = dict(re.findall(r"^\| (loss|gradients) \| ([0-9.e+-]+) \|$", section, re.M))
    assert {name: float(value) for name, value in table.items()} == plan_check.BOUNDS
