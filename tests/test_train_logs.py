"""What a scheduler's log file shows (docs/train.md, "What the log shows"): plain progress lines when
standard output is not a terminal, a rank persistently slower than the others named, and a failed
run told in one line (the rank, the wait, the remedy) with the tracebacks in a file."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from twinpipe.launch import RankFailedError, failure_line
from twinpipe.train_command.progress import LOG_EVERY, LOG_SECONDS, ProgressOutput, TrainProgress
from twinpipe.train_command.stragglers import WINDOW, slow_rank
from test_train_cli import TINY
from typed import typed_env


# ----------------------------------------------------------------------------- stragglers (pure)
def test_a_rank_persistently_slower_than_the_median_is_named():
    history = [[0.10, 0.13, 0.10, 0.10]] * WINDOW
    assert slow_rank(history) == (1, pytest.approx(1.3))
    # the slowest of two slow ranks; the median of all ranks stays the typical rank's
    assert slow_rank([[0.10, 0.13, 0.10, 0.16, 0.10]] * WINDOW) == (3, pytest.approx(1.6))


def test_no_rank_is_named_below_the_ratio_for_a_spike_or_before_a_full_window():
    assert slow_rank([[0.10, 0.115, 0.10]] * WINDOW) is None  # 1.15x: under 1.2x
    spikes = [[0.1, 0.1, 0.1]] * (WINDOW - 3) + [[0.1, 0.5, 0.1]] * 3  # 3 slow steps of 20: not persistent
    assert slow_rank(spikes) is None
    assert slow_rank([[0.10, 0.20]] * (WINDOW - 1)) is None  # not 20 steps yet
    assert slow_rank([[0.0, 0.0]] * WINDOW) is None and slow_rank([[]] * WINDOW) is None
    # only the last WINDOW steps count: a rank that was slow and recovered is not named
    assert slow_rank([[0.1, 0.3]] * WINDOW + [[0.1, 0.1]] * WINDOW) is None


# ----------------------------------------------------------------------------- the plain line (no processes)
def _result(loss: float = 2.0, total: float = 0.5):
    return SimpleNamespace(loss=loss, times={"total": total})


def test_plain_lines_come_every_n_steps_after_the_first_and_the_last(capsys):
    progress = TrainProgress(title="t", steps=range(0, 7), unit="byte", tokens_per_step=100, pp=2,
                             output=ProgressOutput(log_every=3, log_seconds=1e9, terminal=False))
    with progress:
        for step in range(7):
            progress.update(step, _result(), [0.1, 0.1], skipped=step // 4)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "twinpipe train: t; steps 0..7"
    assert [line.split()[1] for line in lines[1:]] == ["1/7", "3/7", "6/7", "7/7"]
    # loss in bits (2 nats / ln 2), tokens/s over the steps since the last line (3 steps of 0.5 s, 100 tokens each)
    assert lines[3].startswith("step 6/7  loss 2.885 bits/byte  200 tokens/s  elapsed 0:00:00  ETA 0:00:00  skipped 1"), lines
    assert "slow:" not in "".join(lines)


def test_the_line_names_a_straggler_and_a_resumed_run_counts_from_its_start(capsys):
    progress = TrainProgress(title="t", steps=range(10, 100), unit="token", tokens_per_step=64, pp=2,
                             output=ProgressOutput(log_every=WINDOW, terminal=False))
    with progress:
        for step in range(10, 10 + WINDOW):
            progress.update(step, _result(), [0.10, 0.10, 0.10, 0.15], skipped=0)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[1:]] == ["11/100", f"{10 + WINDOW}/100"]
    assert "slow:" not in lines[1]  # one step is no pattern
    assert lines[2].endswith(f"skipped 0  slow: rank dp=1 pp=1 1.50x the median rank (last {WINDOW} steps)"), lines


def test_a_slow_step_brings_a_line_before_its_turn(capsys, monkeypatch):
    import twinpipe.train_command.progress as progress_module

    clock = iter(range(0, 1000, 40))  # 40 s pass between two looks at the clock
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    progress = TrainProgress(title="t", steps=range(0, 50), unit="byte", tokens_per_step=1, pp=1,
                             output=ProgressOutput(log_every=10, log_seconds=30, terminal=False))
    with progress:
        for step in range(3):
            progress.update(step, _result(), [0.1], skipped=0)
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[1] for line in lines] == ["1/50", "2/50", "3/50"]
    assert "elapsed 0:00:40  ETA 0:32:40" in lines[0], lines  # 40 s for 1 step: 49 steps left take 49 x 40 s


def test_on_a_terminal_the_bar_carries_the_straggler_note(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich's width here (not a terminal): the whole bar
    progress = TrainProgress(title="t", steps=range(0, WINDOW), unit="byte", tokens_per_step=1, pp=1, output=ProgressOutput(terminal=True))
    with progress:
        for step in range(WINDOW):
            progress.update(step, _result(), [0.1, 0.2, 0.1], skipped=0)
    out = capsys.readouterr().out
    assert f"{WINDOW}/{WINDOW}" in out and "slow: rank dp=1 pp=0 2.00x" in out and "step 1/" not in out, out


def test_the_docs_show_the_lines_the_code_prints():
    text = (Path(__file__).resolve().parents[1] / "docs" / "train.md").read_text()
    section = text.split("## What the log shows", 1)[1].split("\n## ", 1)[0]
    progress_line, failure = (block.removeprefix("text").strip() for block in section.split("```")[1::2])
    shape = lambda line: re.sub(r"\d[\d,.:]*", "#", line)  # noqa: E731
    made = TrainProgress(title="t", steps=range(0, 300), unit="byte", tokens_per_step=1024, pp=1, output=ProgressOutput(terminal=False))
    made._since_line = (10, 1.6)
    assert shape(made.line(139, 2.86, 0, "")) == shape(progress_line), (made.line(139, 2.86, 0, ""), progress_line)
    summary = failure.removeprefix("twinpipe train: rank dp=0 pp=0: ").split("; if the ranks", 1)[0]
    error = RankFailedError(0, "timeout", summary, tracebacks={0: "..."})
    assert "twinpipe train: " + failure_line(error, lambda r: f"dp=0 pp={r}", 2.0, "twinpipe-train/failure-tracebacks.txt") == failure
    assert "every `--log-every` steps (default 10), at least every 30 s" in " ".join(section.split())
    made.history = [[0.1, 0.135, 0.1]] * WINDOW
    assert shape(made.straggler_note()) == shape(re.search(r"`(slow: [^`]*)`", " ".join(section.split()))[1])
    assert (LOG_EVERY, LOG_SECONDS) == (10, 30.0)


def test_only_the_rank_that_shows_prints(capsys):
    progress = TrainProgress(title="t", steps=range(0, 2), unit="byte", tokens_per_step=1, pp=1,
                             output=ProgressOutput(show=False, terminal=False))
    with progress:
        progress.update(0, _result(), [0.1], skipped=0)
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------------------- the one-line failure
def test_the_failure_line_names_the_rank_the_error_and_the_remedy():
    name = lambda rank: f"dp={rank // 2} pp={rank % 2}"  # noqa: E731
    timeout = RankFailedError(1, "timeout", "PipelineTimeoutError: step 3: recv from rank 0: did not complete within 60 s",
                              tracebacks={1: "Traceback ..."})
    assert failure_line(timeout, name, 60.0, "out/failure-tracebacks.txt") == (
        "rank dp=0 pp=1: PipelineTimeoutError: step 3: recv from rank 0: did not complete within 60 s; if the ranks are "
        "only slow (a loaded machine), raise --timeout (now 60 s); tracebacks in out/failure-tracebacks.txt")
    peer = RankFailedError(2, "peer", "PipelinePeerFailedError: step 3: stopped waiting, another rank failed: boom", "boom")
    assert failure_line(peer, name, 60.0).endswith("another rank failed: boom; fix the first failure it quotes")
    died = RankFailedError(3, "died", "exited (code -9) without a result")
    assert failure_line(died, name, 60.0) == "rank dp=1 pp=1: exited (code -9) without a result; it was killed or crashed (out of memory? a signal?)"
    assert str(died) == "rank 3 exited (code -9) without a result"
    assert "\n" not in str(failure_line(timeout, name, 60.0)) and "rank 1 failed:\nTraceback" in str(timeout)


def _rank_processes(pid: int) -> list[int]:
    """The ranks ``pid`` started: the children of the multiprocessing fork server below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))

    def forkserver(p: int) -> bool:
        try:
            return b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            return False

    servers = [c for c in children.get(pid, []) if forkserver(c)]
    return sorted(r for s in servers for r in children.get(s, []))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks' processes through /proc")
def test_a_rank_stopped_past_the_timeout_ends_the_run_with_one_line_and_progress_lines_came_before(tmp_path):
    # A rank stopped (SIGSTOP) longer than --timeout, as a loaded machine stalls one: the rank waiting
    # for it times out. Its one line, not every rank's traceback; the tracebacks in --out. The
    # progress lines reached the pipe while the run went, not at its end.
    argv = ["twinpipe", "train", "--pp", "2", "--steps", "100000", "--timeout", "2", "--log-every", "1", *TINY]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=typed_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        seen = [proc.stdout.readline() for _ in range(3)]  # the title line, then steps 1 and 2
        assert [line.split()[:2] for line in seen[1:]] == [["step", "1/100000"], ["step", "2/100000"]], seen
        ranks = _rank_processes(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGSTOP)
        time.sleep(4)
        with contextlib.suppress(ProcessLookupError):  # ended by then: the run stops every rank once one failed
            os.kill(ranks[-1], signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ours = [line for line in err.splitlines() if line.startswith("twinpipe train:")]
    assert proc.returncode == 1 and len(ours) == 1 and "Traceback" not in err, err
    assert ours[0].startswith("twinpipe train: rank dp=0 pp=") and "PipelineTimeoutError: " in ours[0], ours
    assert ours[0].endswith("raise --timeout (now 2 s); tracebacks in twinpipe-train/failure-tracebacks.txt"), ours
    tracebacks = (tmp_path / "twinpipe-train" / "failure-tracebacks.txt").read_text()
    assert tracebacks.startswith("--- rank ") and "Traceback (most recent call last)" in tracebacks


@pytest.mark.parametrize("argv, rank", [
    (["demo", "--pp", "2", "--steps", "1", "--dim", "8", "--heads", "2", "--seq-len", "4"], r"rank \d: "),
    (["demo", "--moe", "--pp", "1", "--ep", "2", "--steps", "1", "--microbatches", "2", "--microbatch-size", "1",
      "--blocks-per-stage", "1", "--dim", "16", "--experts", "2", "--expert-ffn", "16"], r"rank pp=0 ep=\d: "),
], ids=["demo", "demo --moe"])
def test_the_demos_take_timeout_and_a_failed_wait_is_one_line(argv, rank, capfd):
    from twinpipe.cli import main

    code = main([*argv, "--timeout", "0.001"])  # every wait given 1 ms: the first one across ranks runs out
    err = capfd.readouterr().err
    command = " ".join(argv[:2]) if "--moe" in argv else "demo"
    ours = [line for line in err.splitlines() if line.startswith(f"twinpipe {command}: ")]
    assert code == 1 and len(ours) == 1 and "Traceback" not in err, err
    assert re.match(f"twinpipe {command}: {rank}", ours[0]) and "raise --timeout (now 0.001 s); tracebacks in " in ours[0], ours
    written = Path(ours[0].rsplit("tracebacks in ", 1)[1])
    assert "Traceback (most recent call last)" in written.read_text()
    written.unlink()


def test_a_torchrun_worker_that_fails_says_so_in_one_line_and_writes_its_traceback(tmp_path, monkeypatch, capsys):
    # Under torchrun each worker is its own process: its failure is its own line, its traceback a file per rank.
    from twinpipe.launch import free_port
    from twinpipe.runtime.errors import PipelineTimeoutError
    from twinpipe.train_command import cli
    from test_train_cli import _args

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)

    def stalls(args, device, stopper=None):
        raise PipelineTimeoutError("rank 0, op 3 (1B0): waiting for grad 1->0 mb0 from/to rank 1: did not complete within 5 s")

    monkeypatch.setattr(cli, "_train", stalls)
    assert cli.run_train(_args(*TINY, "--pp", "1", "--timeout", "5", "--out", str(tmp_path / "out"))) == 1
    err = capsys.readouterr().err
    written = tmp_path / "out" / "failure-tracebacks-rank0.txt"
    assert err == (f"twinpipe train: rank dp=0 pp=0: PipelineTimeoutError: rank 0, op 3 (1B0): waiting for grad 1->0 mb0 from/to "
                   f"rank 1: did not complete within 5 s; if the ranks are only slow (a loaded machine), raise --timeout "
                   f"(now 5 s); tracebacks in {written}\n")
    assert "in stalls" in written.read_text()
