"""EPLB in ``twinpipe train`` (``--eplb-every N --redundant-experts R``, docs/eplb.md): three runs of the
tiny Qwen3-MoE, float64, ``--dp 2 --ep 2``; ``live`` through the installed command, the other two through
the command's function in this process (``in_process.run_in_process``: no second interpreter importing
torch and transformers before the ranks start):

- ``plain``: 3 steps, no EPLB, a checkpoint and a transformers folder after step 2;
- ``live``: 2 steps, ``--eplb-every 1 --redundant-experts 2``: experts move after each step (the log says so);
- ``into-live``: ``plain``'s step-2 checkpoint (one slot per expert, as every checkpoint before EPLB)
  resumed by a run with 4 redundant slots.

Re-placing experts does not change the math: a token goes to the same logical expert, replicas split
its tokens. The losses are bitwise those of the run without EPLB; weights may differ in the last bits
only where a replicated expert's gradient is a sum over replicas (float64 reorders it), bounded here.
Checkpoints and transformers folders hold one tensor per expert by logical id, whatever the placement,
so ``live``'s equal ``plain``'s and any run loads them (a run without EPLB reads them as it reads any).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from in_process import run_in_process
from typed import typed_env

pytest.importorskip("transformers")

TINY_MOE = Path(__file__).parent / "data" / "tiny-qwen3-moe"
COMMON = ["--model", str(TINY_MOE), "--pp", "1", "--dp", "2", "--ep", "2", "--schedule", "1f1b", "--data", "t.npy",
          "--seq-len", "8", "--batch-size", "4", "--microbatch-size", "1", "--dtype", "float64", "--log-every", "1"]
RUNS = {
    "plain": ["--steps", "3", "--save-every", "2", "--save-hf-every", "2"],
    "live": ["--steps", "2", "--eplb-every", "1", "--redundant-experts", "2"],
    "into-live": ["--steps", "3", "--resume", "plain/checkpoint-step2", "--eplb-every", "1", "--redundant-experts", "4"],
}
INSTALLED = {"live"}  # the runs that go through the console script (its stdout is checked below)
# float64 weights after 3 Adam steps: a replica sum in another order moves the last bits only
WEIGHTS = 1e-13


def _command(args, cwd, installed: bool) -> subprocess.CompletedProcess:
    """``twinpipe train ARGS`` in ``cwd``: the installed script, or its function in this process."""
    if not installed:
        return run_in_process(["train", *args], cwd)
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), **typed_env()}
    return subprocess.run([shutil.which("twinpipe", path=env["PATH"]), "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import numpy as np

    root = tmp_path_factory.mktemp("eplb")
    np.save(root / "t.npy", np.random.default_rng(0).integers(0, 128, 3000).astype(np.uint16))
    done = {}
    for name, options in RUNS.items():
        done[name] = _command([*COMMON, *options, "--out", name], root, name in INSTALLED)
        assert done[name].returncode == 0, f"{name}: {done[name].stderr[-3000:]}"
    return root, done


def _steps(root: Path, name: str) -> dict[int, dict]:
    return {e["step"]: e for e in json.loads((root / name / "train-log.json").read_text())["steps"]}


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _checkpoint_models(folder: Path) -> dict:
    """The ``model.*`` tensors of a twinpipe checkpoint, read in this process alone."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    keys = {k for k in FileSystemReader(str(folder)).read_metadata().state_dict_metadata if k.startswith("model.")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is (disabled|unavailable)", UserWarning)
        return _load_state_dict_from_keys(keys, checkpoint_id=str(folder))


def _far(a: dict, b: dict, bound: float) -> list[str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [f"{k}: {(a[k] - b[k]).abs().max():.3g}" for k in a if a[k].shape != b[k].shape or (a[k] - b[k]).abs().max() > bound]


def test_live_rebalancing_moves_experts_and_changes_no_loss(runs):
    root, done = runs
    live, plain = _steps(root, "live"), _steps(root, "plain")
    moved = [(s, b["name"]) for s, e in live.items() for b in e.get("eplb", {}).get("blocks", []) if b["moved"]]
    assert moved, [e.get("eplb") for e in live.values()]  # the loads were uneven enough to move experts
    assert "rebalance after step" in done["live"].stdout and "experts sent; max/mean EP-rank load" in done["live"].stdout
    final = json.loads((root / "live" / "train-log.json").read_text())["eplb_placements"]
    assert all(len(p) == 4 + 2 and sorted(set(p)) == [0, 1, 2, 3] for p in final.values()), final
    # Every step's loss bitwise that of the run without EPLB; the norm counts each expert once.
    assert [live[s]["loss"] for s in range(2)] == [plain[s]["loss"] for s in range(2)]
    assert all(abs(live[s]["grad_norm"] - plain[s]["grad_norm"]) <= 1e-12 * plain[s]["grad_norm"] for s in range(2))
    # By logical expert, one tensor each: the checkpoint and the transformers folder, against the run without EPLB.
    ours, theirs = _checkpoint_models(root / "live" / "checkpoint-final"), _checkpoint_models(root / "plain" / "checkpoint-step2")
    assert not _far(ours, theirs, WEIGHTS)
    marker = json.loads((root / "live" / "checkpoint-final" / "twinpipe-checkpoint.json").read_text())
    assert marker["expert_placements"] == {f"model.layers.{i}.mlp": final[f"0.layers.{i}.mlp"] for i in range(2)}, marker
    assert not _far(_tensors(root / "live" / "hf-final"), _tensors(root / "plain" / "hf-step2"), WEIGHTS)


def test_a_checkpoint_of_one_slot_per_expert_loads_into_redundant_slots(runs):
    root, _ = runs
    # Today's and older checkpoints into 4 redundant slots: the same weights, so the same loss, bitwise;
    # and the run's own checkpoint, by logical expert, within the replica-sum bound of the run without EPLB.
    assert _steps(root, "into-live")[2]["loss"] == _steps(root, "plain")[2]["loss"]
    assert "eplb" in _steps(root, "into-live")[2]
    assert not _far(_checkpoint_models(root / "into-live" / "checkpoint-final"),
                    _checkpoint_models(root / "plain" / "checkpoint-final"), WEIGHTS)


BAD = [
    (["--eplb-every", "1", "--ep", "2", "--eplb-threshold", "0.5"], "--eplb-threshold=0.5: must be a finite number >= 1"),
    (["--eplb-every", "1"], "--eplb-every=1: needs the experts spread over EP ranks (--ep >= 2; it is 1)"),
    (["--eplb-every", "1", "--ep", "2", "--redundant-experts", "1"], "--redundant-experts=1: must be a multiple of --ep=2"),
    (["--eplb-every", "1", "--ep", "2", "--dp", "4", "--batch-size", "8"], "--eplb-every=1: needs --ep = --dp (2 != 4)"),
    (["--eplb-every", "1", "--ep", "2", "--precision", "bf16-mixed"], "--eplb-every=1: is not supported with --precision='bf16-mixed'"),
    (["--eplb-every", "1", "--ep", "2", "--zero", "1"], "--eplb-every=1: is not supported with --zero=1"),
    (["--eplb-every", "1", "--ep", "2", "--schedule", "dualpipe", "--pp", "2"],
     "--eplb-every=1: is not supported with a schedule with mirrored stage copies"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_eplb_settings_are_refused_before_any_rank_starts(argv, message, tmp_path):
    from twinpipe.train_command import cli

    parser = cli.add_train_parser(__import__("argparse").ArgumentParser().add_subparsers())
    args = parser.parse_args(["--model", str(TINY_MOE), "--dp", "2", "--pp", "1", "--schedule", "1f1b", "--seq-len", "8",
                              "--batch-size", "4", "--microbatch-size", "1", "--out", str(tmp_path / "out"), *argv])
    with pytest.raises(ValueError) as error:
        cli._check(args)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)
