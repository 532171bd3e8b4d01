"""One ``twinpipe train`` run per ``--out``: the run lock (``twinpipe.train.run_lock``).

No process group: a child process holds the lock as a first run would, and ``twinpipe train`` with
the same ``--out`` is refused before any rank starts, naming it; killed with SIGKILL, its lock is taken
over with a note; the fallback rule for filesystems without ``flock`` is a table.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import pytest

from twinpipe.train.owners import this_host
from twinpipe.train.run_lock import LOCK_FILE, holder_gone, take_run_lock

TINY = ["--layers", "2", "--dim", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--microbatch-size", "2",
        "--corpus-bytes", "20000", "--pp", "1", "--schedule", "1f1b", "--steps", "1"]
HOLD = "import sys; from twinpipe.train.run_lock import take_run_lock; take_run_lock(sys.argv[1]); print('held', flush=True); sys.stdin.read()"


def _run_train(*argv) -> int:
    from twinpipe.train_command.cli import add_train_parser, run_train

    parser = argparse.ArgumentParser()
    return run_train(add_train_parser(parser.add_subparsers()).parse_args(list(argv)))


@pytest.fixture
def first_run(tmp_path):
    """A process holding the run lock of ``tmp_path / "out"``, as a running ``twinpipe train`` does."""
    out = tmp_path / "out"
    out.mkdir()
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "held\n", "the first run could not take the lock"
        yield out, child
    finally:
        child.kill()
        child.wait()


def test_a_second_run_with_the_same_out_is_refused_naming_the_first(first_run, capsys):
    out, child = first_run
    assert _run_train(*TINY, "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"twinpipe train: error: --out={str(out)!r}: is the folder of another twinpipe train run that is "
                          f"still running: process {child.pid} on host {this_host()}, started ") and err.count("\n") == 1, err
    assert (out / LOCK_FILE).exists(), "the refused run removed the first run's lock"


def test_a_killed_runs_lock_is_taken_over_with_a_note_and_released_at_exit(first_run):
    out, child = first_run
    child.send_signal(signal.SIGKILL)
    child.wait()
    with take_run_lock(out) as lock:
        assert lock.note and "took over the lock of an earlier run that ended without releasing it" in lock.note, lock.note
        assert f"process {child.pid} on host {this_host()}" in lock.note, lock.note
        with pytest.raises(ValueError, match=f"process {os.getpid()} on host"):
            take_run_lock(out)  # held: by this very process now
    assert not (out / LOCK_FILE).exists()
    with take_run_lock(out) as again:
        assert again.note is None  # released cleanly: nothing to take over


@pytest.mark.parametrize("record, run_id, is_gone", [
    ({"host": "this", "pid": "dead"}, None, True),     # this host, no such process
    ({"host": "this", "pid": "self"}, None, False),    # this host, running
    ({"host": "another-host", "pid": 1}, None, False),  # cannot be checked from here: taken to run
    ({"host": "another-host", "pid": 1, "run_id": "job-7"}, "job-7", True),   # torchrun restarted the same job
    ({"host": "another-host", "pid": 1, "run_id": "job-7"}, "job-8", False),  # another job
])
def test_without_flock_the_record_decides(record, run_id, is_gone):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {**record, "host": this_host() if record["host"] == "this" else record["host"],
              "pid": {"dead": dead.pid, "self": os.getpid()}.get(record["pid"], record["pid"])}
    assert holder_gone(record, run_id) is is_gone


def test_a_run_removes_the_temporary_folders_a_killed_run_left_in_its_out(tmp_path):
    out = tmp_path / "out"
    left = out / ".checkpoint-step2.partial-77@another-host-0123456789ab"  # its owner cannot be checked from here
    left.mkdir(parents=True)
    (left / "__0_0.distcp").write_bytes(b"x")
    assert _run_train(*TINY, "--out", str(out)) == 0
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [], "hidden files or folders left"


def test_a_link_in_place_of_the_lock_file_is_refused_not_followed(tmp_path):
    (tmp_path / "elsewhere").write_text("keep")
    (tmp_path / LOCK_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"^--out='.*': its run lock .* cannot be opened \("):
        take_run_lock(tmp_path)
    assert (tmp_path / "elsewhere").read_text() == "keep"
