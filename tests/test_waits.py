"""The wait policy without a process group: one default limit, the limit in force, waits in slices
that stop at a published failure, the shared gloo group's bookkeeping, and the deprecated
``overlap.comm.TIMEOUT``."""

from __future__ import annotations

import datetime
import pathlib
import re
import time
import warnings

import pytest
import torch.distributed as dist

from twinpipe.checks import DEFAULT_TIMEOUT
from twinpipe.runtime import collectives, comm, waits
from twinpipe.runtime.comm import wait_work
from twinpipe.runtime.errors import PipelineCommError, PipelinePeerFailedError, PipelineTimeoutError

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "twinpipe"


def test_the_limit_is_the_call_s_then_the_one_in_force_then_the_default():
    assert waits.timeout_for() == DEFAULT_TIMEOUT
    with waits.limit(2.5):
        assert waits.timeout_for() == 2.5
        assert waits.timeout_for(7) == 7.0
        with waits.limit(1):
            assert waits.timeout_for() == 1.0
        assert waits.timeout_for() == 2.5
    assert waits.timeout_for() == DEFAULT_TIMEOUT
    with pytest.raises(ValueError, match="timeout=-1"):
        waits.timeout_for(-1)
    with pytest.raises(ValueError, match="timeout=nan"):
        waits.limit(float("nan")).__enter__()


def test_no_wait_has_a_default_limit_of_its_own():
    """One default, defined once (twinpipe.checks.DEFAULT_TIMEOUT): no other signature or module
    constant spells a number of seconds for a wait."""
    default = re.compile(r"\btimeout\s*:\s*[\w .|\[\]]+=\s*\d|^[A-Z_]*TIMEOUT\s*=\s*\d", re.M)
    found = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel == "checks.py":
            continue
        found += [f"{rel}: {m.group(0)}" for m in default.finditer(path.read_text())]
    assert found == [], found


class _Group:
    """A stand-in process group with a name and no CPU backend (as an NCCL-only group)."""

    def __init__(self, name, ranks=(0, 1)):
        self.group_name, self.ranks = name, list(ranks)

    def _get_backend(self, device):
        raise RuntimeError("No backend type associated with device type cpu")

    def size(self):
        return len(self.ranks)


def test_cpu_group_is_made_once_per_ranks_and_freed_by_its_last_user(monkeypatch):
    made, destroyed = [], []
    monkeypatch.setattr(collectives, "_CPU_GROUPS", {})
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: g.ranks)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or object())
    monkeypatch.setattr(dist, "destroy_process_group", lambda g: destroyed.append(g))
    nccl_groups = [_Group(str(i)) for i in range(100)]  # 100 pipelines on 100 groups of ranks 0 and 1
    cpus = [collectives.cpu_group(g, 60.0) for g in nccl_groups]
    assert len(made) == 1 and made[0][0] == [0, 1] and made[0][1]["backend"] == "gloo"
    assert all(c is cpus[0] for c in cpus)
    other = collectives.cpu_group(_Group("x", (0, 2)), 60.0)  # other ranks: another group
    assert len(made) == 2 and other is not cpus[0]
    for c in cpus[:-1]:
        collectives.release_cpu_group(c)
    assert destroyed == []
    collectives.release_cpu_group(cpus[-1])
    assert destroyed == [cpus[0]]
    assert collectives.cpu_group(nccl_groups[0], 60.0) is not cpus[0] and len(made) == 3  # made again
    owned = object()  # a group the caller passed in (it has a CPU backend): never destroyed
    collectives.release_cpu_group(owned)
    assert destroyed == [cpus[0]]


class _SlowWork:
    """A collective that finishes after ``seconds`` and times out slices until then (as gloo's do)."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def is_completed(self):
        return time.monotonic() >= self.end

    def wait(self, timeout=None):
        left = self.end - time.monotonic()
        if timeout is not None and left > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        time.sleep(max(left, 0))
        return True


@pytest.fixture
def store(monkeypatch):
    """A real store (as the default group's), and the stand-in groups taken for gloo groups."""
    store = dist.HashStore()
    monkeypatch.setattr(waits, "_store", lambda: store)
    monkeypatch.setattr(comm, "_gloo_only", lambda group: True)
    return store


def test_a_collective_waits_in_slices_and_stops_at_a_published_failure(store):
    group = _Group("g1")
    wait_work(_SlowWork(0.5), 5.0, "fine", group)  # finishes across several slices
    waits.publish_failure("global rank 3 (pipeline rank 1) failed during step 5: ValueError: bad", [group])
    waits.publish_failure("global rank 0 failed later: PipelinePeerFailedError: ...", [group])  # the first stays
    start = time.monotonic()
    with pytest.raises(PipelinePeerFailedError) as info:
        wait_work(_SlowWork(30), 30.0, "rank 0: waiting for the all-reduce", group)
    assert time.monotonic() - start < 2 * waits.POLL + 1
    assert str(info.value).startswith("rank 0: waiting for the all-reduce: stopped waiting, another rank failed: ")
    assert info.value.first == "global rank 3 (pipeline rank 1) failed during step 5: ValueError: bad"
    with pytest.raises(PipelineTimeoutError, match="other: did not complete within 0.5 s"):
        wait_work(_SlowWork(30), 0.5, "other", _Group("g2"))  # another group: its own timeout


def test_a_wait_heeds_the_groups_of_the_scope_in_force(store):
    pipeline_group, ep_group = _Group("pp"), _Group("ep")
    scope = waits.Scope(30.0, [pipeline_group])
    with waits.entered(scope):
        waits.note(ep_group)
    assert [g.group_name for g in scope.groups] == ["pp", "ep"] and scope.moved
    waits.publish_failure("global rank 1 failed during step 0: RuntimeError: boom", [pipeline_group])
    with pytest.raises(PipelineTimeoutError):  # outside the scope: only its own group counts
        wait_work(_SlowWork(30), 0.3, "ep wait", ep_group)
    with waits.entered(scope), pytest.raises(PipelinePeerFailedError, match="boom"):
        wait_work(_SlowWork(30), 30.0, "ep wait", ep_group)


def test_a_finished_wait_does_not_look_at_the_store(monkeypatch):
    def no_store():
        raise AssertionError("looked at the store")

    monkeypatch.setattr(waits, "_store", no_store)
    monkeypatch.setattr(comm, "_gloo_only", lambda group: True)
    wait_work(_SlowWork(0), 1.0, "done", _Group("g"))
    wait_work(_SlowWork(0.05), 1.0, "done within its first slice", _Group("g"))


def test_only_gloo_collectives_wait_in_slices(monkeypatch):
    """A collective of another backend (NCCL) is waited for as before, in one call with its limit."""
    def no_store():
        raise AssertionError("looked at the store")

    waited = []

    class _Once(_SlowWork):
        def wait(self, timeout=None):
            waited.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(waits, "_store", no_store)
    wait_work(_Once(0.3), 5.0, "nccl-like", _Group("n"))  # a stand-in group: not a gloo one
    assert waited == [datetime.timedelta(seconds=5)]


def test_overlap_comm_timeout_is_deprecated_and_cannot_be_set():
    from twinpipe.overlap import comm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert comm.TIMEOUT == DEFAULT_TIMEOUT
    assert caught and issubclass(caught[0].category, DeprecationWarning)
    with pytest.raises(AttributeError, match="waits.limit"):
        comm.TIMEOUT = 5.0


def test_peer_failed_errors_survive_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(PipelinePeerFailedError("x: stopped", "global rank 1 failed")))
    assert str(error) == "x: stopped" and error.first == "global rank 1 failed"


class _BackendTimedOut:
    """A collective that failed at once with the backend's own timeout error."""

    def is_completed(self):
        return True

    def wait(self, timeout=None):
        raise RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete")


class _TimedGroup(_Group):
    """A stand-in group whose backend's own timeout is ``seconds``."""

    def __init__(self, name, seconds):
        super().__init__(name)
        self.options = type("Options", (), {"_timeout": datetime.timedelta(seconds=seconds)})()

    def _get_backend(self, device):
        return self


def test_the_timeout_message_says_when_the_backend_gave_up_first(store):
    with pytest.raises(PipelineTimeoutError) as info:
        wait_work(_BackendTimedOut(), 300.0, "w", _TimedGroup("short", 10))
    message = str(info.value)
    assert message.startswith("w: timed out after 0.0 s at the process group's own timeout, 10 s (the timeout= the group "
                              "was made with: init_process_group or new_group"), message
    assert "shorter than this wait's 300 s limit (the timeout= of this call or of the object making it" in message, message
    with waits.limit(300), pytest.raises(PipelineTimeoutError) as info:
        wait_work(_BackendTimedOut(), 300.0, "w", _TimedGroup("short", 10))
    assert "300 s limit (the limit in force: the pipeline's or trainer's timeout= during its step" in str(info.value)


def test_the_group_s_timeout_is_blamed_only_when_it_is_shorter(store):
    """A backend error that names a timeout, on a group whose own timeout is not shorter, is not
    blamed on the group (the old rule blamed any early timeout on it): with the group's timeout as
    long as the wait's or longer (it runs from the collective's start), the work is over the limit;
    with no timeout known, the transport gave up early."""
    for seconds in (300, 600):
        with pytest.raises(PipelineTimeoutError) as info:
            wait_work(_BackendTimedOut(), 300.0, "w", _TimedGroup(f"as long {seconds}", seconds))
        assert str(info.value).startswith("w: did not complete within 300 s ([gloo] Timed out"), str(info.value)
    with pytest.raises(PipelineCommError) as info:
        wait_work(_BackendTimedOut(), 300.0, "w", _Group("unknown"))
    assert "process group's own timeout" not in str(info.value), str(info.value)
    assert "before this wait's 300 s limit" in str(info.value), str(info.value)


class _CompletesAfterSlice:
    """A collective that completes just after its ``slices``-th slice ran out: the slice's wait has
    raised "Operation timed out!", and the work reads as completed when asked (the race of a busy
    machine, made certain). ``error``: the work's own failure, raised by a wait once it completed."""

    def __init__(self, slices, error=None):
        self.left, self.error, self.completed, self.slice_waits = slices, error, False, 0

    def is_completed(self):
        return self.completed

    def wait(self, timeout=None):
        if self.completed:
            if self.error is not None:
                raise RuntimeError(self.error)
            return True
        self.slice_waits += 1
        self.left -= 1
        if self.left <= 0:
            self.completed = True  # between the slice's timeout and the caller's question
        raise RuntimeError("Operation timed out!")


def test_a_collective_completing_as_its_slice_runs_out_is_not_a_failure(store):
    for slices in (1, 2, 50):
        work = _CompletesAfterSlice(slices)
        wait_work(work, 60.0, "all-reduce", _Group("g"))  # returns: completed, not timed out
        assert work.slice_waits == slices
    with pytest.raises(PipelineCommError, match=r"all-reduce: failed \(Connection closed by peer\)"):
        wait_work(_CompletesAfterSlice(3, "Connection closed by peer"), 60.0, "all-reduce", _Group("g"))


def test_the_collective_helper_runs_an_async_collective_on_the_group_and_waits_within_the_limit(store, monkeypatch):
    calls = []

    def fake_all_reduce(tensor, group=None, async_op=False):
        calls.append((tensor, group, async_op))
        return _CompletesAfterSlice(2)

    group = _Group("dp")
    collectives.collective(fake_all_reduce, "t", group=group, timeout=30.0, what="sum")
    assert calls == [("t", group, True)]
    started = collectives.Collective(lambda group, async_op: _SlowWork(30), group=group, timeout=0.3, what="at start")
    with pytest.raises(PipelineTimeoutError, match="named later: did not complete within 0.3 s"):
        started.wait("named later")


def test_a_polling_wait_takes_a_last_look_at_its_deadline():
    """What arrived while the rank was not running counts (shared memory, the agreement board)."""
    deadline = time.monotonic() + 0.05
    assert waits.poll(lambda: time.monotonic() > deadline, deadline, "arrives as the deadline passes") is True
    start = time.monotonic()
    assert waits.poll(lambda: False, start + 0.05, "never arrives") is False
    assert time.monotonic() - start >= 0.05


def test_a_cuda_all_to_all_wait_is_bounded_by_its_limit():
    """The CUDA path's wait polls its event until the limit (a stand-in event: no GPU here)."""
    from twinpipe.overlap import comm as overlap_comm

    class _NeverDone:
        def query(self):
            return False

    work = overlap_comm._CudaWork(_NeverDone(), None, "EP rank 0: all-to-all receiving from EP ranks [1]", None, 0.2)
    start = time.monotonic()
    with pytest.raises(PipelineTimeoutError, match=r"EP rank 0: all-to-all receiving from EP ranks \[1\]: did not complete within 0.2 s"):
        work.wait()
    assert 0.2 <= time.monotonic() - start < 5


def test_hf_time_balance_waits_the_user_s_limit(monkeypatch):
    """hf.build(balance="time") sends the first rank's measurement to every rank within the call's
    timeout=, else the limit in force (the trainer's), not a default of its own."""
    import torch

    pytest.importorskip("transformers")
    import hf_models
    from twinpipe import hf
    from twinpipe.train import balance as train_balance

    limits = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(train_balance, "collective", lambda op, t, group, timeout, what, **_: limits.append(timeout))
    model, sample = hf_models.model("llama", layers=2), torch.randint(0, 64, (2, 8))
    with waits.limit(7):
        hf.build(model, "1f1b", 2, 1, balance="time", sample=sample)
    hf.build(model, "1f1b", 2, 1, balance="time", sample=sample, timeout=3)
    assert limits == [7.0, 3.0]
    with pytest.raises(ValueError, match="timeout=-1"):
        hf.build(model, "1f1b", 2, 1, balance="time", sample=sample, timeout=-1)


def test_every_collective_runs_through_the_one_helper():
    """Only runtime/collectives.py starts a collective (``Collective``: async, awaited within the
    user's limit); elsewhere a collective is passed to it, never called, so no wait falls back on
    the process group's own timeout (the demos' too: bounded by their --timeout). One known
    exception: the CUDA all-to-all, launched on a side stream and bounded by its event's wait."""
    call = re.compile(r"\bdist\.(all_reduce|broadcast|barrier|monitored_barrier|all_gather\w*|all_to_all\w*|reduce_scatter\w*"
                      r"|reduce|gather|scatter|gather_object|scatter_object_list|broadcast_object_list)\(")
    allowed = {"runtime/collectives.py", "overlap/comm.py"}
    found = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text()
        if rel not in allowed:
            found += [f"{rel}: {m.group(0)}" for m in call.finditer(text)]
        if rel != "runtime/collectives.py" and "async_op" in text:
            found.append(f"{rel}: async_op")
    assert found == [], found
    assert len(call.findall((SRC / "overlap" / "comm.py").read_text())) == 1  # the CUDA launch only
