"""``twinpipe demo``: every option explained with its default, one tolerance per dtype printed as
checked, a warning when ranks outnumber cores, and the trace files its help names."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from twinpipe import demo


def _demo_parser() -> argparse.ArgumentParser:
    return demo.add_demo_parser(argparse.ArgumentParser().add_subparsers())


def test_every_option_has_help_and_its_default():
    import argparse

    options = [a for a in _demo_parser()._actions if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS]
    assert len(options) >= 15
    for action in options:
        assert action.help and "(default: " in action.help, action.option_strings
    text = " ".join(_demo_parser().format_help().split())
    assert "(default: dualpipev)" in text and "(default: 2 x --pp)" in text and "(default: 0.05)" in text


def test_both_entry_points_show_the_same_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--help"])
    assert exit_.value.code == 0
    own = capsys.readouterr().out
    assert own.split("options:", 1)[1] == _demo_parser().format_help().split("options:", 1)[1]
    for name in demo.TRACE_FILES:
        assert name in own


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_verdict_names_the_tolerance_checked(dtype):
    tolerance = demo.grad_tolerance(dtype)
    assert tolerance == demo.GRAD_TOLERANCE[str(dtype).removeprefix("torch.")]
    line = demo.exactness_line(True, dtype)
    assert line.startswith("exact: yes") and f"within {tolerance:g} " in line and str(dtype)[6:] in line
    others = [t for d, t in demo.GRAD_TOLERANCE.items() if t != tolerance]
    assert others and not any(f"{t:g}" in line for t in others)
    assert demo.exactness_line(False, dtype).startswith("exact: no")


def test_float32_is_checked_looser_than_float64_and_other_dtypes_are_refused():
    assert demo.grad_tolerance(torch.float32) > demo.grad_tolerance(torch.float64)
    with pytest.raises(ValueError, match=r"dtype=torch.float16: the demo checks float64, float32"):
        demo.grad_tolerance(torch.float16)


def test_oversubscription_warning():
    assert demo.oversubscription_warning(ranks=2, threads=1, cores=2) is None
    assert demo.oversubscription_warning(ranks=1, threads=4, cores=4) is None
    warning = demo.oversubscription_warning(ranks=4, threads=1, cores=2)
    assert "4 CPU rank(s) x 1 thread(s) on 2 core(s)" in warning and "bubble" in warning
    assert demo.oversubscription_warning(ranks=2, threads=2, cores=2) is not None
    assert 1 <= demo.cpu_cores() <= (os.cpu_count() or 1)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps=0: must be >= 1"),
    (["--microbatches", "-2"], "--microbatches=-2: must be >= 1"),
    (["--chunks", "-2"], "--microbatches=-2: must be >= 1"),  # the old spelling, checked as the new one
    (["--pp", "0"], "--pp=0: must be >= 1"),
    (["--dim", "30"], "--dim=30: must be a multiple of --heads=4"),
    (["--lr", "nan"], "--lr=nan: must be a finite number > 0"),
    (["--lr", "-1"], "--lr=-1.0: must be a finite number > 0"),  # was SGD's error in every rank
    (["--lr", "0"], "--lr=0.0: must be a finite number > 0"),
    (["--trace", "{file}"], "--trace='{file}': must be a folder; it is a file"),  # was FileExistsError after the run
    (["--timeout", "0"], "--timeout=0.0: must be a finite number >= 0.001 and <= 2.592e+06"),
    (["--timeout", "nan"], "--timeout=nan: must be a finite number >= 0.001 and <= 2.592e+06"),
])
def test_bad_values_fail_before_launching(argv, message, tmp_path, capsys):
    file = tmp_path / "a-file"
    file.write_text("")
    argv = [a.format(file=file) for a in argv]
    assert demo.main(argv) == 2
    assert capsys.readouterr().err == f"twinpipe demo: error: {message.format(file=file)}\n"


def test_float32_run_warns_checks_its_tolerance_and_writes_the_trace_files_it_names(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(demo.dense, "cpu_cores", lambda: 1)  # 2 ranks on "1 core"
    argv = ["--pp", "2", "--steps", "1", "--dim", "8", "--heads", "2", "--seq-len", "4",
            "--dtype", "float32", "--trace", str(tmp_path), "--timeout", "120"]
    code = demo.main(argv)
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "warning: 2 CPU rank(s) x 1 thread(s) on 1 core(s)" in err
    assert demo.exactness_line(True, torch.float32) in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(demo.TRACE_FILES)
    for name in demo.TRACE_FILES:
        assert str(tmp_path / name) in out


def test_the_readme_quickstart_names_every_trace_file():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    quickstart = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    for name in demo.TRACE_FILES:
        assert f"`{name}`" in quickstart, name


def test_demo_moe_runs_the_moe_demo_with_its_own_options(capsys):
    from twinpipe.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--moe", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "twinpipe demo --moe" in out and "--ep" in out


def test_the_demo_builds_the_trainers_blocks():
    # One toy transformer: the demo's stages are twinpipe.train.model blocks of the GPTConfig its options describe.
    import argparse as _argparse

    from twinpipe.demo import dense
    from twinpipe.train.model import Block, GPTConfig

    parser = _argparse.ArgumentParser()
    dense.add_options(parser)
    args = parser.parse_args(["--dim", "8", "--heads", "2", "--seq-len", "4", "--blocks-per-stage", "2"])
    assert dense.model_config(args, num_model_stages=3) == GPTConfig(seq_len=4, dim=8, heads=2, layers=6)
    stage = dense._stage(0, args, torch.device("cpu"))
    assert [type(b) for b in stage] == [Block, Block] and stage[0].norm1.weight.dtype == torch.float64
    assert isinstance(demo.Block(8, 2), Block)  # the demo's old block name still builds one
