"""``python -m twinpipe.train``: a short run that saves, a resume under another schedule and mesh, bad input."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from twinpipe.launch import free_port
from twinpipe.train.cli import add_train_parser, run_train

TINY = ["--layers", "2", "--dim", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--microbatch-size", "2",
        "--corpus-bytes", "20000"]


def test_python_m_twinpipe_train_shows_its_options():
    done = subprocess.run([sys.executable, "-m", "twinpipe.train", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--schedule" in done.stdout and "--resume" in done.stdout


def test_train_saves_and_resumes_under_another_schedule(tmp_path, monkeypatch, capfd):
    # The command starts its 2 processes itself.
    assert run_train(_args(*TINY, "--schedule", "dualpipev", "--pp", "2", "--steps", "3", "--save-every", "2",
                           "--out", str(tmp_path / "a"))) == 0
    assert "bits per byte" in capfd.readouterr().out and (tmp_path / "a" / "train-loss.png").stat().st_size > 10_000
    log = json.loads((tmp_path / "a" / "train-log.json").read_text())["steps"]
    assert [e["step"] for e in log] == [0, 1, 2] and log[2]["loss"] < log[0]["loss"] + 1
    # Resume in this process, as torchrun would start it (RANK set): one rank, 1F1B.
    port = str(free_port())
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port).items():
        monkeypatch.setenv(key, value)
    argv = [*TINY, "--schedule", "1f1b", "--pp", "1", "--steps", "3", "--resume", str(tmp_path / "a" / "checkpoint-step2"),
            "--out", str(tmp_path / "b"), "--no-overlap-dp"]
    assert run_train(_args(*argv)) == 0
    resumed = json.loads((tmp_path / "b" / "train-log.json").read_text())["steps"]
    assert [e["step"] for e in resumed] == [2]
    assert resumed[0]["loss"] == log[2]["loss"]  # the same weights, optimizer state and batch: the same loss, bitwise
    # Another model than the checkpoint's is refused before any rank starts, naming the options.
    capfd.readouterr()
    other = [*argv, "--dim", "8", "--experts", "2", "--seq-len", "8"]  # the last of a repeated option counts
    assert run_train(_args(*other)) == 2
    err = capfd.readouterr().err
    for option in ("--dim=8 (the checkpoint's model has 16)", "--experts=2 (the checkpoint's model has 0)",
                   "--seq-len=8 (the checkpoint's model has 16)"):
        assert option in err, err


def test_overlap_dp_is_on_unless_turned_off():
    assert _args().overlap_dp is True and _args("--no-overlap-dp").overlap_dp is False


def _args(*argv):
    parser = argparse.ArgumentParser()
    return add_train_parser(parser.add_subparsers()).parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "dualpipev", "--pp", "4", "--layers", "2"], "--layers=2: dualpipev on --pp=4 cuts the model into 8 stages"),
    (["--schedule", "zigzag"], "zigzag"),
    (["--dp", "2", "--batch-size", "6", "--microbatch-size", "2"], "batch_size=6: must be a multiple of dp=2 x microbatch_size=2"),
    (["--dim", "30", "--heads", "4"], "dim=30: must be a multiple of heads=4"),
    (["--resume", "/nonexistent/ckpt"], "--resume=/nonexistent/ckpt: not a checkpoint directory"),
    (["--timeout", "0"], "--timeout=0.0: must be finite and at least"),
])
def test_bad_settings_are_refused_before_any_process_starts(argv, message, capsys):
    assert run_train(_args(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("twinpipe train: error:") and message in err, err


def test_a_torchrun_world_of_another_size_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_train(_args("--pp", "2", "--dp", "2")) == 2
    assert "--pp=2 x --dp=2 = 4 processes, but torchrun started 2: the mesh sizes must multiply to the world size" in capsys.readouterr().err
