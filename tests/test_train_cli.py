"""``twinpipe train``: a run that saves and one that resumes, typed as a user types them; every option
checked before any rank starts (one line, exit 2, no traceback); a resume under another schedule."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from twinpipe.checks import DEFAULT_TIMEOUT
from twinpipe.launch import free_port
from twinpipe.train_command import cli
from twinpipe.train_command.cli import add_train_parser, run_train
from typed import run_typed

TINY = ["--layers", "2", "--dim", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--microbatch-size", "2",
        "--corpus-bytes", "65536"]


def test_python_m_twinpipe_train_shows_its_options():
    done = subprocess.run([sys.executable, "-m", "twinpipe.train", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--schedule" in done.stdout and "--resume" in done.stdout


def test_the_command_saves_every_2_steps_and_resumes_from_the_command_line(tmp_path):
    # As typed: the console script, in a fresh folder. The old code died writing train-log.json.
    tiny = " ".join(TINY)
    first = run_typed(f"twinpipe train --pp 2 --steps 4 --save-every 2 --log-every 3 {tiny}", tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    # Not a terminal: a plain line after the first step, every 3 steps and after the last (docs/train.md)
    assert [line.split()[1] for line in first.stdout.splitlines() if line.startswith("step ")] == ["1/4", "3/4", "4/4"]
    out = tmp_path / "twinpipe-train"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-final", "checkpoint-step2", "train-log.json", "train-loss.png"]
    log = json.loads((out / "train-log.json").read_text())
    assert set(log["args"]) == set(vars(_args())) and log["args"]["save_every"] == 2  # the options, nothing else
    assert [e["step"] for e in log["steps"]] == [0, 1, 2, 3]
    assert all(len(e["rank_times"]) == 2 and 0 < min(e["rank_times"]) <= e["total"] for e in log["steps"]), log["steps"]
    # The last step measured, per rank: parts and total, measured and predicted (docs/memory.md).
    assert [e["rank"] for e in log["memory"]] == [0, 1] and "memory, rank 1 (pp 1, dp 0)" in first.stdout
    for entry in log["memory"]:
        for side in ("measured", "predicted"):
            parts = {k: entry[side][k] for k in ("params", "grads", "master", "optimizer", "activations_peak")}
            assert entry[side]["total"] == sum(parts.values()) and parts["params"] > 0, entry
        measured, predicted = entry["measured"]["activations_peak"], entry["predicted"]["activations_peak"]
        assert abs(measured - predicted) <= 0.1 * predicted, entry
    # twinpipe simulate --gpt predicts the same parts from the sizes alone (docs/memory.md; plan --gpt too:
    # test_memory_predict.py); 4 rows in micro-batches of 2: 2 micro-batches.
    assert [e["predicted"] for e in log["memory"]] == _simulated_parts("dualpipev", 2, 2, TINY)
    # The resumed run calls the script's function in this process (the first run covered the script itself).
    from in_process import run_in_process

    resumed = run_in_process(["train", "--pp", "2", "--resume", "twinpipe-train/checkpoint-step2", "--steps", "4", *TINY,
                              "--out", "resumed"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = json.loads((tmp_path / "resumed" / "train-log.json").read_text())["steps"]
    # The same weights, optimizer state and batches: the same losses, bitwise.
    assert [(e["step"], e["loss"]) for e in again] == [(e["step"], e["loss"]) for e in log["steps"][2:]]
    assert (tmp_path / "resumed" / "checkpoint-final" / ".metadata").exists()


def test_a_checkpoint_resumes_under_another_schedule_and_another_model_is_refused(tmp_path, monkeypatch, capfd):
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
    # Another --lr on resume: which one the optimizer keeps is the user's explicit choice, and said.
    with pytest.warns(UserWarning, match=r"lr: 0.003 in the checkpoint, 0.01 in this run's optimizer; this run's are kept"):
        assert run_train(_args(*argv, "--lr", "0.01", "--optimizer-hparams", "current")) == 0
    written = json.loads((tmp_path / "b" / "train-log.json").read_text())
    # What twinpipe simulate --gpt predicts is what each run predicted (DualPipeV on 2 ranks, 1F1B on 1).
    assert [e["predicted"] for e in json.loads((tmp_path / "a" / "train-log.json").read_text())["memory"]] == \
        _simulated_parts("dualpipev", 2, 2, TINY)
    assert [e["predicted"] for e in written["memory"]] == _simulated_parts("1f1b", 1, 2, TINY + ["--no-overlap-dp"])
    resumed = written["steps"]
    assert written["skipped_steps"] == 0 and [e["skipped"] for e in resumed] == [False]
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


def test_the_timeout_default_is_the_one_default():
    assert _args().timeout == DEFAULT_TIMEOUT
    assert f"(default: {DEFAULT_TIMEOUT:g})" in " ".join(_parser().format_help().split())


def _simulated_parts(schedule: str, pp: int, microbatches: int, options: list[str]) -> list[dict]:
    """``twinpipe simulate --gpt --json``'s memory per rank for the train run ``options`` describe."""
    import contextlib
    import io

    from twinpipe.cli import main

    dropped = {i + k for i, o in enumerate(options) if o in ("--batch-size", "--corpus-bytes") for k in (0, 1)}  # train's only
    model = [o for i, o in enumerate(options) if i not in dropped]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["simulate", schedule, "--pp", str(pp), "--microbatches", str(microbatches), "--gpt", *model, "--json"]) == 0
    ranks = json.loads(out.getvalue())["memory"]
    return [{k: v for k, v in r.items() if k not in ("pp_rank", "dp_rank")} for r in ranks]


def _parser() -> argparse.ArgumentParser:
    return add_train_parser(argparse.ArgumentParser().add_subparsers())


def _args(*argv):
    return _parser().parse_args(list(argv))


# Every option with values it refuses and the start of the one-line message. The options that only
# switch something on (--no-overlap-dp) have no bad value; the ones with argparse choices are
# refused by argparse itself (see the next table).
BAD = [
    (["--pp", "0"], "--pp=0: must be >= 1"),
    (["--dp", "-1"], "--dp=-1: must be >= 1"),
    (["--steps", "0"], "--steps=0: must be >= 1"),
    (["--batch-size", "0"], "--batch-size=0: must be >= 1"),
    (["--dp", "2", "--batch-size", "6", "--microbatch-size", "2"],
     "--batch-size=6: must be a multiple of --dp=2 x --microbatch-size=2"),
    (["--microbatch-size", "0"], "--microbatch-size=0: must be >= 1"),
    (["--seq-len", "0"], "--seq-len=0: must be >= 1"),
    (["--dim", "0"], "--dim=0: must be >= 1"),
    (["--heads", "0"], "--heads=0: must be >= 1"),
    (["--dim", "30", "--heads", "4"], "--dim=30: must be a multiple of --heads=4"),
    (["--layers", "0"], "--layers=0: must be >= 1"),
    (["--schedule", "dualpipev", "--pp", "4", "--layers", "2"], "--layers=2: dualpipev on --pp=4 cuts the model into 8 stages"),
    (["--experts", "-1"], "--experts=-1: must be >= 0"),
    (["--experts", "3", "--dp", "2", "--batch-size", "8"], "--experts=3: must be a multiple of --dp=2"),
    (["--top-k", "0"], "--top-k=0: needs --experts"),
    (["--top-k", "2"], "--top-k=2: needs --experts"),
    (["--experts", "2", "--top-k", "3"], "--top-k=3: must be in 1..--experts (2)"),
    (["--experts", "2", "--top-k", "0"], "--top-k=0: must be in 1..--experts (2)"),
    (["--lr", "nan"], "--lr=nan: must be a finite number > 0"),
    (["--lr", "inf"], "--lr=inf: must be a finite number > 0"),
    (["--lr", "-1"], "--lr=-1.0: must be a finite number > 0"),
    (["--lr", "0"], "--lr=0.0: must be a finite number > 0"),
    (["--max-norm", "nan"], "--max-norm=nan: must be a finite number >= 0"),
    (["--max-norm", "-1"], "--max-norm=-1.0: must be a finite number >= 0"),
    (["--max-norm", "inf"], "--max-norm=inf: must be a finite number >= 0"),
    (["--seed", "-1"], "--seed=-1: must be >= 0 and <= 4294967295"),
    (["--seed", str(2**32)], "--seed=4294967296: must be >= 0 and <= 4294967295"),
    (["--corpus-bytes", "0"], "--corpus-bytes=0: must be >= 1"),
    (["--corpus-bytes", "1000"], "--corpus-bytes=1000: must be at least --batch-size x (--seq-len + 1) = 1040"),
    (["--out", "{file}"], "--out='{file}': must be a folder; it is a file"),
    (["--out", "{file}/sub"], "--out='{file}/sub': must be a folder this user can write to"),
    (["--save-every", "-1"], "--save-every=-1: must be >= 0"),
    (["--keep-last", "-1"], "--keep-last=-1: must be >= 0"),
    (["--save-minutes", "-1"], "--save-minutes=-1.0: must be a finite number >= 0"),
    (["--save-minutes", "nan"], "--save-minutes=nan: must be a finite number >= 0"),
    (["--grace-period", "0"], "--grace-period=0.0: must be a finite number > 0"),
    (["--grace-period", "inf"], "--grace-period=inf: must be a finite number > 0"),
    (["--grace-period", "nan"], "--grace-period=nan: must be a finite number > 0"),
    (["--log-every", "0"], "--log-every=0: must be >= 1"),
    (["--save-hf-every", "0"], "--save-hf-every=0: must be >= 1"),
    (["--overlap", "--schedule", "dualpipe", "--pp", "2"], "--overlap=True: not with --schedule dualpipe (it overlaps its F&B"),
    (["--overlap", "--schedule", "gpipe"], "--overlap=True: not with --schedule gpipe; the schedules that take it: 1f1b"),
    (["--overlap-warmup", "1", "--schedule", "1f1b"], "--overlap-warmup=1: only with --overlap"),
    (["--overlap-warmup", "-1", "--schedule", "1f1b", "--overlap"], "--overlap-warmup=-1: must be >= 0"),
    (["--save-hf-every", "2"], "--save-hf-every=2: only with --model"),
    (["--resume", "/nonexistent/ckpt"], "--resume=/nonexistent/ckpt: not a checkpoint directory"),
    (["--timeout", "0"], "--timeout=0.0: must be a finite number >= 0.001"),
    (["--timeout", "1e300"], "--timeout=1e+300: must be a finite number >= 0.001 and <= 2.592e+06"),
    (["--timeout", "nan"], "--timeout=nan: must be a finite number"),
    (["--device", "cuda"], "--device='cuda': must be cpu on this machine: torch sees no CUDA GPU"),
    (["--precision", "bf16-mixed", "--dtype", "bfloat16"], "--dtype='bfloat16': must be float32 with --precision=bf16-mixed"),
    (["--precision", "bf16-mixed", "--dtype", "float64"], "--dtype='float64': must be float32 with --precision=bf16-mixed"),
    (["--schedule", "zigzag"], "--schedule='zigzag': allowed are 1f1b, bitpipe, chimera, dualpipe, dualpipev"),
    (["--schedule", "dualpipe", "--pp", "1"], "--pp=1: must be >= 2 and even for --schedule dualpipe"),
    (["--schedule", "chimera", "--pp", "3"], "--pp=3: must be >= 2 and even for --schedule chimera"),
    (["--schedule", "dualpipe", "--pp", "2", "--dp", "2", "--batch-size", "4"],
     "--batch-size=4 / (--dp=2 x --microbatch-size=2) = 1 micro-batch(es) per pipeline: --schedule dualpipe needs a number "
     "of micro-batches that is >= 2 and even"),
    (["--schedule", "interleaved-1f1b", "--pp", "4", "--batch-size", "6"],
     "--batch-size=6 / (--dp=1 x --microbatch-size=2) = 3 micro-batch(es) per pipeline: --schedule interleaved-1f1b needs "
     "a number of micro-batches that is >= 4 and a multiple of 4"),
    # DeepSeek-V3's options (docs/deepseek-v3.md)
    (["--bias-update-speed", "0.01"], "--bias-update-speed=0.01: needs --experts"),
    (["--bias-update-speed", "nan", "--experts", "4"], "--bias-update-speed=nan: must be a finite number >= 0"),
    (["--balance-alpha", "nan", "--experts", "4"], "--balance-alpha=nan: must be a finite number >= 0"),
    (["--balance-alpha", "-1", "--experts", "4"], "--balance-alpha=-1.0: must be a finite number >= 0"),
    (["--mtp-depth", "16", "--seq-len", "16"], "--mtp-depth=16: must be >= 0 and <= 15"),
    (["--mtp-weight", "nan", "--mtp-depth", "1"], "--mtp-weight=nan: must be a finite number >= 0"),
    # --data, --model (tests/test_train_data.py has the rest)
    (["--data", "{file}"], "--data='{file}': the file is empty"),
    (["--vocab", "0"], "--vocab=0: must be >= 1"),
    (["--model", "{file}"], "--model='{file}': must be a folder holding a transformers config.json"),
    (["--layout", "E|t,L"], "--layout='E|t,L': only with --model"),
    (["--ep", "0"], "--ep=0: must be >= 1"),
    # EPLB in the loop (tests/test_train_eplb.py has the rest)
    (["--eplb-every", "-1"], "--eplb-every=-1: must be >= 0"),
    (["--eplb-every", "2"], "--eplb-every=2: only with --model"),
    (["--redundant-experts", "2"], "--redundant-experts=2: only with --eplb-every N >= 1"),
    (["--eplb-window", "0", "--eplb-every", "1"], "--eplb-window=0: must be >= 1"),
    (["--eplb-threshold", "nan", "--eplb-every", "1"], "--eplb-threshold=nan: must be a finite number >= 1"),
    # --eval-* (tests/test_model_preflight.py has the rest)
    (["--eval-data", "{file}"], "--eval-data='{file}': the file is empty"),
    (["--eval-every", "2"], "--eval-every=2: needs --eval-data"),
    (["--eval-batches", "2"], "--eval-batches=2: needs --eval-data"),
]
# Refused by argparse (exit 2, its usage line and one error line).
BAD_CHOICE = [["--dtype", "float16"], ["--device", "tpu"], ["--balance", "flops"], ["--dp-reduce", "sum"], ["--pp", "two"],
              ["--on-nonfinite", "ignore"], ["--optimizer-hparams", "mine"], ["--score", "cosine"], ["--precision", "fp16"],
              ["--zero", "2"], ["--data-dtype", "int8"]]
NO_BAD_VALUE = {"overlap_dp"}


def _bad(argv, message, tmp_path):
    file = tmp_path / "a-file"
    file.write_text("")
    return [a.format(file=file) for a in argv], message.format(file=file)


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_every_bad_option_is_refused_before_any_rank_starts(argv, message, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same message on a machine with a GPU
    argv, message = _bad(argv, message, tmp_path)
    out = [] if "--out" in argv else ["--out", str(tmp_path / "out")]
    with pytest.raises(ValueError) as error:
        cli._check(_args(*argv, *out))
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)
    assert not (tmp_path / "out").exists()  # nothing made for a run that does not start


@pytest.mark.parametrize("argv", BAD_CHOICE, ids=" ".join)
def test_options_with_choices_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        _args(*argv)
    assert exit_.value.code == 2 and f"argument {argv[0]}: invalid" in capsys.readouterr().err


def test_the_tables_cover_every_option():
    actions = [a for a in _parser()._actions if a.option_strings and a.dest != "help"]
    dest = {flag: a.dest for a in actions for flag in a.option_strings}
    options = {a.dest for a in actions}
    covered = {dest[a[0]] for a, _ in BAD} | {dest[a[0]] for a in BAD_CHOICE}
    assert options - NO_BAD_VALUE <= covered, sorted(options - NO_BAD_VALUE - covered)


def test_good_options_pass_and_make_the_out_folder(tmp_path):
    cli._check(_args(*TINY, "--pp", "2", "--out", str(tmp_path / "new" / "out"), "--max-norm", "0", "--experts", "2", "--top-k", "1"))
    assert (tmp_path / "new" / "out").is_dir() and not list((tmp_path / "new" / "out").iterdir())


def test_an_out_folder_that_cannot_be_written_is_refused_and_nothing_is_left_behind(tmp_path, monkeypatch):
    from pathlib import Path

    def refuse(self, data):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_bytes", refuse)
    with pytest.raises(ValueError, match=r"--out='.*/new/out': must be a folder this user can write to \(Permission denied\)"):
        cli._check(_args("--out", str(tmp_path / "new" / "out")))
    assert not (tmp_path / "new").exists()


# A handful typed: exit 2, exactly one line on stderr, no traceback, no folder. The first TYPED_SCRIPT go
# through the console script (a fresh interpreter: nothing else it prints at start-up slips in); the rest
# call its function, ``twinpipe.cli.main``, in this process (``in_process.run_in_process``): the same
# path from the command line to the message without starting python and importing torch once more each.
TYPED = [
    ("--device cuda", "--device='cuda': must be cpu on this machine"),
    ("--out a-file", "--out='a-file': must be a folder; it is a file"),
    ("--timeout 1e300", "--timeout=1e+300: must be a finite number"),
    ("--schedule dualpipe --pp 1", "--pp=1: must be >= 2 and even for --schedule dualpipe"),
    ("--corpus-bytes 0", "--corpus-bytes=0: must be >= 1"),
    ("--lr nan", "--lr=nan: must be a finite number > 0"),
]
TYPED_SCRIPT = 2


def test_bad_options_typed_give_one_line_and_exit_2(tmp_path):
    from in_process import run_in_process

    (tmp_path / "a-file").write_text("")
    scripted = TYPED[:TYPED_SCRIPT]
    # Side by side (each starts python and imports torch): each one's stderr and exit code to its own file, then in order.
    runs = " ".join(f'(twinpipe train {argv} 2> err{i}; echo "exit $?" >> err{i}) &' for i, (argv, _) in enumerate(scripted))
    show = " ".join(f"err{i}" for i in range(len(scripted)))
    done = run_typed(f"{runs} wait; cat {show} >&2; rm {show}", tmp_path, timeout=120)
    assert done.stdout == "", done.stdout
    lines = done.stderr.splitlines()
    for argv, _ in TYPED[TYPED_SCRIPT:]:
        called = run_in_process(["train", *argv.split()], tmp_path)
        assert called.stdout == "", (argv, called.stdout)
        lines += [*called.stderr.splitlines(), f"exit {called.returncode}"]
    assert len(lines) == 2 * len(TYPED) and "Traceback" not in "\n".join(lines), lines
    for (argv, message), line, code in zip(TYPED, lines[::2], lines[1::2]):
        assert line.startswith(f"twinpipe train: error: {message}") and code == "exit 2", (argv, line, code)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no twinpipe-train/ left behind


def test_a_torchrun_world_of_another_size_is_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_train(_args("--pp", "2", "--dp", "2", "--out", str(tmp_path / "out"))) == 2
    assert "--pp=2 x --dp=2 = 4 processes, but torchrun started 2: the mesh sizes must multiply to the world size" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_check_is_finite_for_every_float_option():
    # Every float option goes through a check that refuses nan (argparse's float() takes it).
    floats = {a.dest for a in _parser()._actions if a.type is float}
    refused = {a[0][2:].replace("-", "_") for a, _ in BAD if a[1] == "nan"}
    assert floats <= refused, sorted(floats - refused)


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_or_blank_host_id_is_refused_before_any_rank_starts(monkeypatch, capsys, tmp_path, value):
    monkeypatch.setenv("TWINPIPE_HOST_ID", value)
    assert run_train(_args("--pp", "2", "--out", str(tmp_path / "out"))) == 2
    err = capsys.readouterr().err
    assert err == f"twinpipe train: error: TWINPIPE_HOST_ID={value!r}: must be a non-empty name (ranks with the same name " \
                  "may share memory), or unset (the host name and boot decide)\n", err
    assert not (tmp_path / "out").exists()


def test_overlap_trains_bitwise_as_the_same_schedule_without_it(tmp_path):
    """``--overlap`` (ZB-H1's steady forwards paired with B halves, one extra warm-up micro-batch): the
    same losses and gradient norms, bit for bit, as ZB-H1 without it, on a MoE GPT."""
    logs = {}
    for name, more in (("plain", ()), ("overlap", ("--overlap", "--overlap-warmup", "1"))):
        out = tmp_path / name
        assert run_train(_args(*TINY, "--schedule", "zb-h1", "--pp", "2", "--experts", "2", "--batch-size", "8",
                               "--steps", "2", "--out", str(out), *more)) == 0
        logs[name] = [(e["loss"], e["grad_norm"]) for e in json.loads((out / "train-log.json").read_text())["steps"]]
    assert logs["overlap"] == logs["plain"] and len(logs["plain"]) == 2
