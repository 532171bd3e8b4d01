"""A trained ``transformers`` model you can use: ``twinpipe train --model`` writes ``hf-final/`` (and with
``--save-hf-every N`` ``hf-stepK/`` beside the checkpoints), ``twinpipe export-hf`` converts any
checkpoint, and ``train-log.json`` records the model that ran.

Three runs of ``twinpipe train`` (its function in this process, its ranks processes), 2 steps each,
``--save-hf-every 1``: a tied Llama on PP=2 (float32, its tokenizer copied), the tiny Qwen3-MoE with
``--dp 2 --ep 2 --precision bf16-mixed`` and the tiny DeepSeek-V3 with ``--mtp-depth 1`` (``--mtp-weight 0``:
its logged loss is the main model's, which ``from_pretrained`` computes). For each:
``from_pretrained(hf-final)`` holds every tensor of ``checkpoint-final`` bit for bit (bf16-mixed: the
FP32 masters rounded to bfloat16), and ``from_pretrained(hf-step1)``'s loss on batch 1 is the loss the
log states for step 1 (the weights that step computed with). Then the Qwen3-MoE checkpoint, loaded
and saved again on another mesh (one process, no expert parallelism), exported by ``twinpipe
export-hf``: the same files as the run's ``hf-final``. Bad input: one line, exit 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from distributed import run_world
from in_process import run_in_process

pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data"
TINY_LLAMA, TINY_MOE, TINY_DS = DATA / "tiny-llama", DATA / "tiny-qwen3-moe", DATA / "tiny-deepseek-v3"
SEQ, BATCH = 8, 4
STEPS = 2
SHAPE = ["--data", "t.npy", "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--microbatch-size", "1", "--steps", str(STEPS),
         "--save-hf-every", "1", "--schedule", "1f1b"]
F32_LOSS = 1e-5  # the pipeline's loss against the unsplit model's, float32 (other summation order)
BF16_LOSS = 2e-3  # bf16 weights and activations on both sides, other kernels (as tests/test_train_mixed_models.py)
RUNS = {
    "llama-tied": ["--pp", "2"],
    "qwen3-moe-ep2": ["--model", str(TINY_MOE), "--pp", "1", "--dp", "2", "--ep", "2", "--precision", "bf16-mixed"],
    "deepseek-v3-mtp": ["--model", str(TINY_DS), "--pp", "1", "--mtp-depth", "1", "--mtp-weight", "0"],
}


def _command(args, cwd) -> subprocess.CompletedProcess:
    """``twinpipe ARGS`` in ``cwd``, in this process (``in_process.run_in_process``)."""
    return run_in_process(args, cwd)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three runs' folders, by name (each run's result checked by the tests)."""
    import numpy as np

    root = tmp_path_factory.mktemp("export-hf")
    np.save(root / "t.npy", np.random.default_rng(0).integers(0, 128, 3000).astype(np.uint16))
    tied = root / "tied-llama"  # tests/data/tiny-llama with tie_word_embeddings, and its tokenizer
    shutil.copytree(TINY_LLAMA, tied)
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    done = {}
    for name, options in RUNS.items():
        model = [] if "--model" in options else ["--model", str(tied)]
        run = _command(["train", *model, *options, *SHAPE, "--out", name], root)
        done[name] = (root / name, run)
    return root, done


def _run(runs, name) -> Path:
    out, run = runs[1][name]
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def _checkpoint(folder: Path) -> dict:
    """Every tensor of a twinpipe checkpoint, by key (``model.<name>``, ``buffer.<name>``, ``optim...``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    keys = {k for k in FileSystemReader(str(folder)).read_metadata().state_dict_metadata if not k.startswith("optim.")}
    with warnings.catch_warnings():  # read in this process alone, on purpose
        warnings.filterwarnings("ignore", "torch.distributed is (disabled|unavailable)", UserWarning)
        return _load_state_dict_from_keys(keys, checkpoint_id=str(folder))


def _differences(hf_folder: Path, checkpoint: Path, dtype) -> list[str]:
    """Every tensor ``from_pretrained(hf_folder)`` holds against the checkpoint's (in ``dtype``: the
    compute weights), bitwise; and the folder's MTP keys against the checkpoint's MTP layers."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    saved = _checkpoint(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(str(hf_folder))
    tied = model.config.tie_word_embeddings
    problems = []
    for name, got in model.state_dict().items():
        key = next((k for k in (f"model.{name}", f"buffer.{name}") if k in saved), None)
        if key is None and tied and name == "lm_head.weight":
            key = "model.model.embed_tokens.weight"
        if key is None:
            problems.append(f"{name}: not in the checkpoint")
            continue
        want = saved[key].to(dtype)
        if not torch.equal(got.to(dtype), want):
            problems.append(f"{name}: differs from {key} ({(got.float() - want.float()).abs().max():.3g})")
        elif name.endswith(".weight") and got.dtype != dtype:
            problems.append(f"{name}: {got.dtype}, not {dtype}")
    n = model.config.num_hidden_layers
    copies = {"embed_tokens.weight": "model.model.embed_tokens.weight", "shared_head.head.weight": "model.lm_head.weight"}
    with safe_open(str(hf_folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        if tied and "lm_head.weight" in keys:
            problems.append("lm_head.weight stored beside its tied embedding")
        mtp = sorted(k for k in keys if k.startswith(f"model.layers.{n}."))
        for key in mtp:
            want = _mtp_tensor(saved, key, copies.get(key.split(".", 3)[3]))
            if not torch.equal(f.get_tensor(key), want.to(dtype)):
                problems.append(f"MTP {key}: differs from the checkpoint's")
    if model.config.model_type == "deepseek_v3" and len(mtp) < 20:
        problems.append(f"the MTP layer is missing: {mtp}")
    return problems


def _mtp_tensor(saved: dict, key: str, copy: str | None):
    """The checkpoint's value of an MTP key as DeepSeek-V3 stores it: a copy of the embedding or head,
    one expert's ``gate_proj``/``up_proj`` (halves of the fused ``gate_up_proj`` row) or ``down_proj``,
    or the parameter (routing bias) itself."""
    if copy is not None:
        return saved[copy]
    parts = key.split(".")
    if parts[3:5] == ["mlp", "experts"] and parts[5].isdigit():
        expert, proj = int(parts[5]), parts[6]
        prefix = "model." + ".".join(parts[:5])
        if proj == "down_proj":
            return saved[f"{prefix}.down_proj"][expert]
        gate, up = saved[f"{prefix}.gate_up_proj"][expert].chunk(2, dim=0)
        return gate if proj == "gate_proj" else up
    return saved[f"model.{key}" if f"model.{key}" in saved else f"buffer.{key}"]


def _loss(hf_folder: Path, root: Path, step: int) -> float:
    """``from_pretrained(hf_folder)``'s mean next-token loss on batch ``step`` (the run's data and seed)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from twinpipe.train.data import BatchSampler

    model = AutoModelForCausalLM.from_pretrained(str(hf_folder))
    x, y = BatchSampler(np.load(root / "t.npy"), SEQ, seed=0).batch(step, BATCH)
    with torch.no_grad():
        logits = model(x).logits
    return float(torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)))


CASES = [("llama-tied", "float32", F32_LOSS), ("qwen3-moe-ep2", "bfloat16", BF16_LOSS), ("deepseek-v3-mtp", "float32", F32_LOSS)]


@pytest.mark.parametrize("name,dtype,rel", CASES, ids=[c[0] for c in CASES])
def test_hf_final_is_the_checkpoint_bit_for_bit(runs, name, dtype, rel):
    import torch

    out = _run(runs, name)
    assert (out / "hf-final" / "model.safetensors").is_file() and (out / "hf-step1" / "config.json").is_file()
    assert not _differences(out / "hf-final", out / "checkpoint-final", getattr(torch, dtype))


@pytest.mark.parametrize("name,dtype,rel", CASES, ids=[c[0] for c in CASES])
def test_hf_step_gives_the_logged_loss(runs, name, dtype, rel):
    out = _run(runs, name)
    logged = json.loads((out / "train-log.json").read_text())["steps"][1]["loss"]
    assert _loss(out / "hf-step1", runs[0], 1) == pytest.approx(logged, rel=rel)


def test_tokenizer_and_config_are_copied(runs):
    out = _run(runs, "llama-tied")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / "hf-final" / name).read_bytes() == (TINY_LLAMA / name).read_bytes()
    config = json.loads((out / "hf-final" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["architectures"] == ["LlamaForCausalLM"]
    ds = json.loads((_run(runs, "deepseek-v3-mtp") / "hf-final" / "config.json").read_text())
    assert ds["num_nextn_predict_layers"] == 1 and ds["architectures"] == ["DeepseekV3ForCausalLM"]


def test_the_log_records_the_model_that_ran(runs):
    llama = json.loads((_run(runs, "llama-tied") / "train-log.json").read_text())
    assert not {"dim", "heads", "layers", "experts", "top_k", "vocab"} & set(llama["args"])  # the GPT's sizes did not apply
    assert llama["args"]["save_hf_every"] == 1
    model = llama["model"]
    assert (model["model_type"], model["ep"], model["mtp_depth"]) == ("llama", 1, 0)
    assert model["layout"].count("|") == 1 and model["config"]["hidden_size"] == 32 and model["config"]["tie_word_embeddings"]
    moe = json.loads((_run(runs, "qwen3-moe-ep2") / "train-log.json").read_text())["model"]
    assert (moe["model_type"], moe["ep"], moe["config"]["num_local_experts"], moe["layout"].count("|")) == ("qwen3_moe", 2, 4, 0)
    ds = json.loads((_run(runs, "deepseek-v3-mtp") / "train-log.json").read_text())["model"]
    assert (ds["mtp_depth"], ds["config"]["n_routed_experts"], ds["layout"]) == (1, 4, "E,t*2,L")


def _save_on_one_rank(rank: int, world: int, checkpoint: str, again: str) -> int:
    """The Qwen3-MoE checkpoint loaded by a one-rank bf16-mixed trainer (no expert parallelism) and saved again."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from twinpipe.hf import HFSource, TokenLoss
    from twinpipe.train.checkpoint import load_checkpoint, save_checkpoint
    from twinpipe.train.data import BatchSampler
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import TrainConfig, Trainer

    config = AutoConfig.from_pretrained(str(TINY_MOE), local_files_only=True)
    trainer = Trainer(lambda: AutoModelForCausalLM.from_config(config), BatchSampler(torch.zeros(100, dtype=torch.long), SEQ),
                      TokenLoss(), lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01), build_mesh(1, 1),
                      TrainConfig(schedule="1f1b", batch_size=BATCH, microbatch_size=1, precision="bf16-mixed"),
                      stages=HFSource(str(TINY_MOE)))
    step = load_checkpoint(trainer, checkpoint)
    save_checkpoint(trainer, again, step)
    trainer.pipe.close()
    return step


def test_export_hf_of_a_checkpoint_from_another_mesh_gives_the_same_files(runs):
    out = _run(runs, "qwen3-moe-ep2")
    again = runs[0] / "moe-one-rank"
    assert run_world(1, _save_on_one_rank, str(out / "checkpoint-final"), str(again), timeout=240) == [STEPS]
    run = _command(["export-hf", str(again), "--model", str(TINY_MOE), "--out", "moe-exported"], runs[0])
    assert run.returncode == 0, run.stderr[-3000:]
    exported, final = runs[0] / "moe-exported", out / "hf-final"
    assert sorted(p.name for p in exported.iterdir()) == sorted(p.name for p in final.iterdir())
    for path in final.iterdir():
        assert (exported / path.name).read_bytes() == path.read_bytes(), path.name


BAD = {
    "not-a-checkpoint": (lambda root: ["export-hf", str(TINY_MOE), "--model", str(TINY_MOE), "--out", str(root / "x")],
                         r"checkpoint '.*tiny-qwen3-moe': not a checkpoint directory"),
    "another-model": (lambda root: ["export-hf", str(root / "llama-tied" / "checkpoint-final"), "--model", str(TINY_MOE),
                                    "--out", str(root / "y")], r"holds another model than '.*tiny-qwen3-moe' \(qwen3_moe\)"),
    "out-not-empty": (lambda root: ["export-hf", str(root / "llama-tied" / "checkpoint-final"), "--model",
                                    str(root / "tied-llama"), "--out", str(root / "llama-tied")], r"--out='.*': must be absent or empty"),
    "save-hf-every-0": (lambda root: ["train", "--model", str(TINY_MOE), "--save-hf-every", "0"], r"--save-hf-every=0: must be >= 1"),
    "save-hf-every-gpt": (lambda root: ["train", "--save-hf-every", "5"], r"--save-hf-every=5: only with --model"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_exit_2(runs, case, capsys):
    """In this process (``twinpipe.cli.main``, the console script's function): nothing starts."""
    import re

    from twinpipe.cli import main

    _run(runs, "llama-tied")  # its checkpoint is the other model's
    argv, message = BAD[case]
    assert main(argv(runs[0])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (runs[0] / "x").exists() and not (runs[0] / "y").exists()
