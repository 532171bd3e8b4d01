"""``twinpipe demo --moe``: a tiny PP=1 x EP=2 run, its argument checks, and with ``--eplb`` the
imbalance falling (moved here from test_eplb_loop.py with the demo)."""

from __future__ import annotations

import json
import re

import pytest

from twinpipe.cli import main


def test_demo_runs_and_overlap_keeps_losses():
    from documented_commands import MOE_DEMO
    from typed import run_typed_once

    # The line tests/test_documented_commands.py runs for `twinpipe demo --moe --trace fb.json`: typed,
    # at the console script, in a fresh folder; one run for both modules.
    done, folder = run_typed_once(MOE_DEMO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "losses identical" in done.stdout
    assert "all-to-alls in flight" in done.stdout
    slices = [e for e in json.loads((folder / "fb.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    assert {e["tid"] for e in slices} == {0, 1, 2}  # compute, comm of F, comm of B
    assert {e["name"] for e in slices if e["tid"] == 2} >= {"0.dispatch(B)", "0.combine(B)"}


@pytest.mark.parametrize("argv,message", [
    (["--ep", "3"], "--experts=8: must be a multiple of --ep=3"),
    (["--tokens", "10"], "--tokens=10: must be a multiple of --seq-len=16"),
    (["--pp", "0"], "--pp=0: must be >= 1"),
    (["--eplb", "--redundant", "3"], "--redundant=3: must be a multiple of --ep=2"),
    (["--interval", "0"], "--interval=0: must be >= 1"),
    (["--timeout", "1e300"], "--timeout=1e+300: must be a finite number >= 0.001 and <= 2.592e+06"),
    (["--dim", "6"], "--dim=6: must be a multiple of --heads=4"),
    (["--trace", "{file}"], "--trace='{file}': must be a folder (or a file name ending in .json); it is a file"),
    (["--trace", "{file}/fb.json"], "--trace='{file}': must be a folder; it is a file"),  # was an error after the run
])
def test_demo_rejects_bad_arguments(argv, message, capsys, tmp_path):
    file = tmp_path / "a-file"
    file.write_text("")
    argv, message = [a.format(file=file) for a in argv], message.format(file=file)
    assert main(["demo", "--moe", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"twinpipe demo --moe: error: {message}") and err.count("\n") == 1, err


def test_demo_options_of_the_other_demo_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--moe", "--schedule", "1f1b"])  # the MoE demo runs DualPipeV only: not silently ignored
    assert exit_.value.code == 2 and "unrecognized arguments: --schedule" in capsys.readouterr().err


def test_demo_eplb_shows_the_imbalance_falling(capsys):
    # Typed with the demo's old spellings (--chunks, --tokens, --hidden, --expert-hidden, --blocks): they still work.
    assert main(["demo", "--moe", "--pp", "1", "--ep", "2", "--steps", "3", "--chunks", "2", "--tokens", "64", "--hidden", "8",
                 "--experts", "4", "--expert-hidden", "8", "--blocks", "1", "--eplb", "--interval", "1", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    assert "losses identical" in out
    steps = [line for line in out.splitlines() if line.startswith("  step ")]
    assert len(steps) == 3 and re.search(r"rebalanced [1-9]", steps[0]), out
    first, last = (float(re.search(r"load ([\d.]+)", line).group(1)) for line in (steps[0], steps[-1]))
    assert first > 1.2 and last < first, out


def test_the_old_module_says_where_the_demo_went():
    import subprocess
    import sys

    with pytest.raises(ImportError, match=r"twinpipe.moe.demo moved: run `twinpipe demo --moe`"):
        from twinpipe.moe import demo  # noqa: F401
    done = subprocess.run([sys.executable, "-m", "twinpipe.moe.demo", "--eplb"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "run `twinpipe demo --moe`" in done.stderr and "Traceback" not in done.stderr
