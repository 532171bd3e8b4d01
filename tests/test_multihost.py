"""Two hosts on one machine: two torchrun agents (``--nnodes 2``, static rendezvous on 127.0.0.1),
each with its own ``TWINPIPE_HOST_ID``, run ``python -m twinpipe.train``; the losses are bitwise
those of the same run on one host (``twinpipe train``), and no shared-memory segment joins the two
"hosts" (their workers' memory maps are watched while they run), as with two real machines.

Cases: DualPipeV PP=4 over the two hosts (the pipeline crosses them between ranks 1 and 2), and a
MoE GPT on DualPipe PP=2 x DP=2 (expert parallelism over data parallel: the experts' all-to-all
crosses them). 4 processes on CI's 2 cores: a tiny model, 2 steps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

LIMIT_S = 240  # one run, all its processes; the runs take about 10-20 s on 2 cores
TINY = ["--steps", "2", "--dim", "16", "--heads", "2", "--seq-len", "16", "--microbatch-size", "1", "--corpus-bytes", "65536"]
CASES = {
    "dualpipev-pp4": ["--schedule", "dualpipev", "--pp", "4", "--layers", "8", "--batch-size", "8", *TINY],
    "moe-dualpipe-pp2-dp2": ["--schedule", "dualpipe", "--pp", "2", "--dp", "2", "--experts", "4", "--layers", "4",
                             "--batch-size", "8", *TINY],
}
_NOT_INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TWINPIPE_HOST_ID")  # by any run here
_SEGMENT = re.compile(r"^\S+ \S+ \S+ (\S+) (\d+)\s+(/dev/shm/twinpipe-\S+)")  # dev, inode, path of a maps line


def _environment(host_id: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    env["PYTHONFAULTHANDLER"] = "1"  # a worker killed by a signal prints where it was
    if host_id is not None:
        env["TWINPIPE_HOST_ID"] = host_id
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _SegmentWatch:
    """Polls the memory maps of the processes under the given agents: which agents' workers map each
    twinpipe shared-memory segment (by device and inode: the files are unlinked once mapped)."""

    def __init__(self, agents: list[subprocess.Popen]):
        self.agents = agents
        self.mapped_by: dict[tuple[str, str], set[int]] = {}
        self.names: dict[tuple[str, str], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for index, agent in enumerate(self.agents):
                for pid in _descendants(agent.pid):
                    for key, name in _segments(pid):
                        self.mapped_by.setdefault(key, set()).add(index)
                        self.names[key] = name
            self._stop.wait(0.02)

    def shared_across(self) -> list[str]:
        return sorted(self.names[k] for k, agents in self.mapped_by.items() if len(agents) > 1)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in Path(f"/proc/{parent}/task/{task}/children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _segments(pid: int) -> list[tuple[tuple[str, str], str]]:
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:  # it exited
        return []
    return [((m[1], m[2]), m[3]) for m in map(_SEGMENT.match, lines) if m]


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: its workers go too
        proc.wait()


def _two_hosts(args: list[str], out: Path, token: str) -> tuple[dict, _SegmentWatch]:
    """``python -m twinpipe.train`` on two agents of 2 processes, hosts ``{token}-0`` and ``{token}-1``,
    writing to one ``out`` (a shared folder: every rank writes its checkpoint shard there): its log,
    and the watch of the shared-memory segments the agents' workers mapped."""
    port, agents, logs = _free_port(), [], [out.parent / f"{out.name}-agent{node}.log" for node in (0, 1)]
    try:
        with _SegmentWatch(agents) as watch:
            for node in (0, 1):
                command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                           "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                           "--rdzv-backend", "static", "-m", "twinpipe.train", *args, "--out", str(out)]
                with open(logs[node], "w") as log:
                    agents.append(subprocess.Popen(command, env=_environment(f"{token}-{node}"), stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
            _wait(agents, logs)
    finally:
        _stop(agents)
    return json.loads((out / "train-log.json").read_text()), watch


_TELLING = re.compile(r"terminate called|what\(\)|Error|error:|Signal|abort|Aborted|Traceback|core dumped|Fatal Python|File \"|Thread 0x", re.I)


def _failure(node: int, why: str, logs: list[Path]) -> AssertionError:
    """The failed agent's tail, and the lines of both agents' logs that say why a worker died (a
    C++ abort's message is printed long before the agent's summary at the end of its log)."""
    telling = [f"agent {n}: {line}" for n, log in enumerate(logs)
               for line in log.read_text(errors="replace").splitlines() if _TELLING.search(line)]
    return AssertionError(f"agent {node} {why}:\n{logs[node].read_text(errors='replace')[-4000:]}\n"
                          "telling lines of both agents:\n" + "\n".join(telling[-60:]))


def _wait(agents: list[subprocess.Popen], logs: list[Path]) -> None:
    """Until every agent exits 0; AssertionError with its output when one fails (its peer may wait
    for it until a rendezvous timeout: it is not waited for) or LIMIT_S passes."""
    deadline = time.monotonic() + LIMIT_S
    while any(agent.poll() is None for agent in agents):
        failed = [node for node, agent in enumerate(agents) if agent.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            node = failed[0] if failed else 0
            raise _failure(node, f"exited {agents[node].returncode}" if failed else f"did not finish within {LIMIT_S} s", logs)
        time.sleep(0.1)
    for node, agent in enumerate(agents):
        if agent.returncode != 0:
            raise _failure(node, f"exited {agent.returncode}", logs)


def _one_host(args: list[str], out: Path) -> dict:
    """The reference: ``twinpipe train``'s function called here (its ranks on this host alone; no second
    interpreter to import torch again), with no host identity set."""
    from twinpipe.train_command.cli import main

    with pytest.MonkeyPatch.context() as patch:
        for name in _NOT_INHERITED:
            patch.delenv(name, raising=False)
        assert main([*args, "--out", str(out)]) == 0
    return json.loads((out / "train-log.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each case on two hosts (log, segment watch) and on one host (log)."""
    token = uuid.uuid4().hex[:8]
    results = {}
    for name, args in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        results[name] = (*_two_hosts(args, folder / "two-hosts", token), _one_host(args, folder / "one-host"))
    return results


def _numbers(log: dict) -> list[tuple]:
    return [(s["step"], s["loss"], s["grad_norm"], s["skipped"]) for s in log["steps"]]


@pytest.mark.parametrize("name", list(CASES))
def test_two_hosts_train_bitwise_as_one_host(runs, name):
    two, _, one = runs[name]
    assert len(two["steps"]) == 2
    assert _numbers(two) == _numbers(one)  # floats read back from JSON: exact
    assert two["args"]["pp"] * two["args"]["dp"] == 4


@pytest.mark.parametrize("name", list(CASES))
def test_no_shared_memory_joins_the_two_hosts(runs, name):
    _, watch, _ = runs[name]
    assert watch.mapped_by, "no shared-memory segment seen at all: the watch saw nothing"
    assert watch.shared_across() == []


def _in_a_launchers_group(rank: int, world: int, out: str) -> tuple:
    """``python -m twinpipe.train`` called inside a process group its launcher already made, with
    torchrun's variables set (as Ray's TorchTrainer does for its workers)."""
    import torch.distributed as dist

    from twinpipe.train_command.cli import main

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    code = main(["--schedule", "1f1b", "--pp", "2", "--layers", "2", "--batch-size", "4", *TINY, "--out", out])
    dist.barrier()  # the launcher's group is still there: the command did not destroy what it did not make
    return code, dist.is_initialized()


def test_train_runs_in_a_process_group_its_launcher_made(tmp_path):
    from distributed import run_world

    assert run_world(2, _in_a_launchers_group, str(tmp_path)) == [(0, True), (0, True)]
    assert len(json.loads((tmp_path / "train-log.json").read_text())["steps"]) == 2
