"""``twinpipe train`` refuses what it cannot run before any rank starts, in one line with exit code 2:
a ``--model`` folder whose safetensors weights do not fit its ``config.json`` (read from the files'
headers: ``twinpipe.hf.preflight``), a ``--resume`` checkpoint of another model, text data without a
tokenizer, and ``--eval-*`` options that cannot run.

A crafted-folder table: tiny Llama and Qwen3-MoE folders written by ``save_pretrained`` (a single
file, shards, per-expert keys), then damaged one way each. Every case runs ``twinpipe train`` in this
process (``twinpipe.cli.main``, the console script's function) with the rank launcher replaced by one
that fails the test, so a case that reached the ranks fails; one case runs through the installed
command as well. One real run (1 process, 2 steps, with held-out evaluation) writes the checkpoint the
``--resume`` cases refuse, and checks the evaluation's log, plot and progress lines end to end.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from in_process import run_in_process
from typed import typed_env

TINY_LLAMA = Path(__file__).parent / "data" / "tiny-llama"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "train.md"
SHAPE = ["--pp", "1", "--dp", "1", "--schedule", "1f1b", "--seq-len", "8", "--batch-size", "2", "--microbatch-size", "1"]
VOCAB = 128


def _save(config, folder: Path, **options) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, **options)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """``llama/`` (one file), ``sharded/``, ``moe/`` (per-expert keys), the data files, and ``run/``:
    a real 2-step run of ``llama/`` with held-out evaluation (its output in ``run.txt``)."""
    from transformers import AutoConfig, Qwen3MoeConfig

    root = tmp_path_factory.mktemp("preflight")
    llama = AutoConfig.from_pretrained(str(TINY_LLAMA), local_files_only=True)
    _save(llama, root / "llama")
    _save(llama, root / "sharded", max_shard_size="40KB")
    _save(Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64), root / "moe")
    gen = torch.Generator().manual_seed(0)
    import numpy as np

    np.save(root / "train.npy", torch.randint(0, VOCAB, (2000,), generator=gen).numpy())
    np.save(root / "eval.npy", torch.randint(0, VOCAB, (200,), generator=gen).numpy())
    (root / "text.txt").write_text("held-out text needs a tokenizer\n" * 20)
    # In this process (the console script's function; test_the_installed_command_says_the_same_line types one).
    done = run_in_process(["train", "--model", "llama", "--data", "train.npy", *SHAPE, "--steps", "2", "--eval-data", "eval.npy",
                           "--eval-every", "1", "--eval-batches", "3", "--save-every", "0", "--out", "run"], root)
    (root / "run.txt").write_text(f"exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    return root


def _installed(args, cwd) -> subprocess.CompletedProcess:
    """``twinpipe train ARGS`` through the console script next to this interpreter."""
    env = typed_env()
    exe = shutil.which("twinpipe", path=env["PATH"])
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), **env}  # this tree, unless told
    return subprocess.run([exe, "train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


# ---- damaging a folder

def _tensors(folder: Path, edit) -> None:
    """Rewrite ``folder/model.safetensors`` with ``edit(tensors)`` applied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _raw(folder: Path, data: bytes) -> None:
    (folder / "model.safetensors").write_bytes(data)


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-64])


def _drop_shard(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / sorted(set(index["weight_map"].values()))[1]).unlink()


def _config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


UP = "model.layers.1.mlp.up_proj.weight"
GATE1 = "model.layers.0.mlp.experts.1.gate_proj.weight"

# name -> (base folder, damage, extra options, what the one line must say)
CASES = {
    "wrong-shape": ("llama", lambda f: _tensors(f, lambda t: t.__setitem__(UP, torch.zeros(60, 32))), [],
                    [UP, "shape [60, 32] on disk", "[64, 32]"]),
    "wrong-dtype": ("llama", lambda f: _tensors(f, lambda t: t.__setitem__(UP, t[UP].to(torch.int32))), [],
                    [UP, "dtype I32", "floating-point"]),
    "missing-tensor": ("llama", lambda f: _tensors(f, lambda t: t.pop("model.norm.weight")), [],
                       ["'model.norm.weight': missing", "[32]"]),
    "extra-tensor": ("llama", lambda f: _tensors(f, lambda t: t.__setitem__("model.layers.4.mlp.up_proj.weight", t[UP].clone())), [],
                     ["model.layers.4.mlp.up_proj.weight", "has no such tensor"]),
    "truncated": ("llama", _truncate, [], ["model.safetensors", "truncated"]),
    "garbage-header": ("llama", lambda f: _raw(f, (22).to_bytes(8, "little") + b"{this is not json at a" + bytes(64)), [],
                       ["model.safetensors", "not JSON"]),
    "header-longer-than-file": ("llama", lambda f: _raw(f, (1 << 40).to_bytes(8, "little") + b"{}"), [],
                                ["model.safetensors", "header of 1099511627776 bytes"]),
    "index-names-missing-shard": ("sharded", _drop_shard, [], ["model.safetensors.index.json", "names shard(s)"]),
    "missing-expert": ("moe", lambda f: _tensors(f, lambda t: t.pop(GATE1)), [],
                       ["model.layers.0.mlp.experts.gate_up_proj", "expert(s) 1"]),
    "text-data-without-tokenizer": ("llama", None, ["--data", "../text.txt"], ["--data='../text.txt'", "needs a tokenizer"]),
    "text-eval-data-without-tokenizer": ("llama", None, ["--eval-data", "../text.txt"],
                                         ["--eval-data='../text.txt'", "needs a tokenizer"]),
    "resume-other-configuration": ("llama", lambda f: _config(f, rms_norm_eps=1e-3), ["--resume", "../run/checkpoint-final"],
                                   ["--resume=../run/checkpoint-final", "rms_norm_eps: 1e-06 in the checkpoint, 0.001 here"]),
    "resume-other-shapes": ("llama", lambda f: (_config(f, intermediate_size=48), (f / "model.safetensors").unlink()),
                            ["--resume", "../run/checkpoint-final"],
                            ["--resume=../run/checkpoint-final", "holds another model"]),
    "eval-every-without-eval-data": (None, None, ["--eval-every", "2"], ["--eval-every=2: needs --eval-data"]),
    "eval-batches-zero": (None, None, ["--eval-data", "../eval.npy", "--eval-batches", "0"], ["--eval-batches=0", ">= 1"]),
    "eval-data-too-short": (None, None, ["--eval-data", "../eval.npy", "--eval-batches", "20"],
                            ["--eval-data='../eval.npy'", "holds 200 tokens", "321 are needed"]),
    "eval-data-ids-above-vocab": (None, None, ["--vocab", "128", "--data", "../train.npy", "--eval-data", "../big.npy"],
                                  ["--eval-data='../big.npy'", "token id 500"]),
}


def _case_folder(root: Path, name: str) -> tuple[Path, list[str]]:
    base, damage, extra, _ = CASES[name]
    folder = root / name
    if base is None:  # the built-in GPT
        folder.mkdir(parents=True, exist_ok=True)
        import numpy as np

        np.save(root / "big.npy", np.arange(501))
        return folder, ["--data", "../train.npy", *extra] if "--data" not in extra else extra
    shutil.copytree(root / base, folder / "model")
    if damage is not None:
        damage(folder / "model")
    data = [] if "--data" in extra else ["--data", "../train.npy"]
    return folder, ["--model", "model", *data, *extra]


@pytest.mark.parametrize("name", list(CASES))
def test_refused_in_one_line_before_any_rank_starts(root, name, monkeypatch, capsys):
    from twinpipe import launch
    from twinpipe.cli import main

    folder, args = _case_folder(root, name)

    def no_ranks(*_, **__):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "run_local", no_ranks)
    monkeypatch.chdir(folder)
    code = main(["train", *args, *SHAPE, "--steps", "1", "--out", "out"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("twinpipe train: error: "), err
    for part in CASES[name][3]:
        assert part in err, err
    assert not (folder / "out").exists()


@pytest.mark.parametrize("name", ["resume-other-configuration"])
def test_the_installed_command_says_the_same_line(root, name):
    folder, args = _case_folder_copy(root, name)
    done = _installed([*args, *SHAPE, "--steps", "1", "--out", "out"], folder)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and all(part in lines[0] for part in CASES[name][3]), done.stderr
    assert "Traceback" not in done.stderr and "rank" not in done.stderr.replace("--", "")


def _case_folder_copy(root: Path, name: str) -> tuple[Path, list[str]]:
    """The case's folder made afresh under another name (the in-process test may have made it already)."""
    CASES[name + "-installed"] = CASES[name]
    try:
        return _case_folder(root, name + "-installed")
    finally:
        del CASES[name + "-installed"]


def test_a_run_with_held_out_evaluation_logs_and_shows_it(root):
    said = (root / "run.txt").read_text()
    assert said.startswith("exit 0"), said
    log = json.loads((root / "run" / "train-log.json").read_text())
    entries = log["eval"]
    assert [e["step"] for e in entries] == [1, 2], entries  # after every step (--eval-every 1), the last once
    for e in entries:
        assert math.isfinite(e["loss"]) and e["perplexity"] == pytest.approx(math.exp(e["loss"]), rel=1e-12), e
    assert entries[0]["loss"] != entries[1]["loss"]  # the model trained in between
    lines = [line for line in said.splitlines() if line.startswith("eval after step")]
    assert len(lines) == 2, said
    shown = re.search(r"`(eval after step [^`]*)`", " ".join(DOCS.read_text().split()))[1]  # docs/train.md's example
    shape = lambda line: re.sub(r"\d[\d,.]*", "#", " ".join(line.split()))  # noqa: E731
    assert shape(lines[0]) == shape(shown), (lines[0], shown)
    assert (root / "run" / "train-loss.png").stat().st_size > 0
