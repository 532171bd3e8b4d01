"""Ranks that fall out of step: an extra step() on one rank, steps with different ``step_id``s,
pipelines stepped in different orders. The first step that shows it raises PipelineMismatchError
on every rank; every later step raises PipelineOutOfStepError on every rank until all of them call
``resync()``; then the gradients equal a clean run's. Mismatches that leave the ranks on the same
step (another ``num_chunks``, or equal ``step_id``s) keep the pipeline usable.

Each scenario runs on both transports: ``"auto"`` (shared-memory messages, shared-memory
agreement board) and ``"process-group"`` with the agreement's all-gather over the group (as across
hosts). One world of three processes runs every case, each on a fresh sub-group.
"""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch
import torch.distributed as dist

import models
from distributed import run_cases, run_world

WORLD = 3
TIMEOUT = 4.0
SLACK = 6.0  # seconds a clear error may take beyond the timeout on a busy 2-core machine
TRANSPORTS = ("auto", "process-group")


def _outcome(fn):
    """Run fn; return (exception type name or 'none', message, seconds, fn's value)."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:  # the test inspects what came out
        return type(exc).__name__, str(exc), time.monotonic() - start, None
    return "none", "", time.monotonic() - start, value


class _Setup:
    """A DualPipeV model on the group's ranks, its single-process reference, and this rank's pipeline.
    With ``transport="process-group"`` the agreement goes through the group's all-gather too."""

    def __init__(self, group, transport, seed=7):
        import twinpipe
        from twinpipe.schedule.registry import placement_for

        self.rank = dist.get_rank(group)
        self.placement = placement_for("dualpipev", dist.get_world_size(group))
        self.model = models.make_model(models.MLPStage, self.placement.num_model_stages, seed=seed)
        mine = [copy.deepcopy(self.model[self.placement.model_stage(s)]) for s in self.placement.stages_of(self.rank)]
        self.pipe = twinpipe.Pipeline(mine, "dualpipev", process_group=group, timeout=TIMEOUT, transport=transport)
        if transport == "process-group":
            self.pipe._board = None  # the agreement's all-gather over the group, as across hosts

    def data(self, seed, n=4):
        gen = torch.Generator().manual_seed(seed)
        xs = [(torch.randn(2, 3, models.HIDDEN, generator=gen, dtype=torch.float64),) for _ in range(n)]
        labels = [torch.randn(2, 3, models.HIDDEN, generator=gen, dtype=torch.float64) for _ in range(n)]
        return xs, labels

    def step(self, xs, labels, **kw):
        args, labs = (), ()
        for c, chain in enumerate(self.placement.chains):
            mbs = self.placement.microbatches_of_chain(c, len(xs))
            if chain[0] in self.pipe.stages:
                args = (torch.cat([xs[j][0] for j in mbs]),)
            if chain[-1] in self.pipe.stages:
                labs = (torch.cat([labels[j] for j in mbs]),)
        return self.pipe.step(*args, num_chunks=len(xs), criterion=models.mse, labels=labs, **kw)

    def exact(self, seed, **kw) -> list[str]:
        """One training step on batch ``seed`` from zero gradients, against a clean single-process
        run of the same batch: what differs ([] when every loss and gradient matches)."""
        xs, labels = self.data(seed)
        for m in (*self.model, self.pipe):
            m.zero_grad(set_to_none=True)
        ref_losses, _ = models.reference(self.model, self.placement, xs, labels, models.mse)
        loss, _ = self.step(xs, labels, **kw)
        problems = []
        for c, chain in enumerate(self.placement.chains):
            if chain[-1] in self.pipe.stages:
                mbs = self.placement.microbatches_of_chain(c, len(xs))
                if not torch.equal(loss, torch.stack([ref_losses[j].detach() for j in mbs])):
                    problems.append("losses differ from a clean run")
        for s, module in zip(self.pipe.stages, self.pipe.module):
            for p, q in zip(module.parameters(), self.model[self.placement.model_stage(s)].parameters()):
                if p.grad is None or not models.grad_error(p.grad, q.grad) <= 1e-13:
                    problems.append(f"stage {s}: gradients differ from a clean run")
        return problems

    def eval_step(self, seed):
        with torch.no_grad():
            return self.step(*self.data(seed))


_try = _outcome


# ---------------------------------------------------------------- an extra step on one rank


def case_extra_step_then_continue(group, transport):
    """The issue's loop: rank 0 runs an extra evaluation step after batch 0; every rank catches
    PipelineMismatchError and continues with its next batch. Then every rank resyncs and trains."""
    from twinpipe import PipelineMismatchError

    s = _Setup(group, transport)
    log = []
    for batch in range(4):
        if s.rank == 0 and batch == 1:
            log.append(("eval", _try(lambda: s.eval_step(batch))))
        try:
            log.append((batch, _try(lambda: s.exact(batch))))
        except PipelineMismatchError:
            continue
    log.append(("resync", _try(s.pipe.resync)))
    log.append(("after", _try(lambda: s.exact(10))))
    log.append(("after", _try(lambda: s.exact(11))))
    return [(what, o[0], o[1], o[2], o[3]) for what, o in log]


def case_partial_resync(group, transport):
    """After an extra step, ranks 0 and 1 call resync() while rank 2 calls step(): rank 2 raises
    at once (its pipeline is out of step), ranks 0 and 1 give up at the timeout, naming resync()."""
    s = _Setup(group, transport)
    if s.rank == 0:
        _try(lambda: s.eval_step(0))  # the extra step
    else:
        _try(lambda: s.exact(0))
    outcome = _try(s.pipe.resync if s.rank < 2 else lambda: s.exact(1))[:3]
    return outcome, s.pipe._broken is not None


def case_resync_and_step_when_in_step(group, transport):
    """On a pipeline in step, rank 0 calls resync() while the others call step(): every rank
    raises at once, and the ranks are then out of step until all resync."""
    s = _Setup(group, transport)
    mixed = _try(s.pipe.resync if s.rank == 0 else lambda: s.exact(0))[:3]
    return mixed, _try(lambda: s.exact(1))[:3], _try(s.pipe.resync)[:3], s.exact(2)


def case_resync_is_collective_over_one_pipeline(group, transport):
    """resync() of two different pipelines on two ranks: both raise; then both resync alike and train."""
    a, b = _Setup(group, transport, seed=1), _Setup(group, transport, seed=2)
    if a.rank == 0:
        _try(lambda: a.eval_step(0))
    else:
        _try(lambda: a.exact(0))
    other = _try(a.pipe.resync if a.rank == 0 else b.pipe.resync)
    again = [_try(p.resync)[:3] for p in (a.pipe, b.pipe)]
    return other[:3], again, a.exact(3), b.exact(4)


def case_resync_of_an_aligned_pipeline(group, transport):
    """resync() when nothing went wrong is a no-op collective: the steps around it are exact."""
    s = _Setup(group, transport)
    return s.exact(0), _try(s.pipe.resync)[:3], s.exact(1)


def case_resync_of_a_broken_pipeline(group, transport):
    """A pipeline broken half-way (here: rank 1's, injected) cannot be resynced: every rank says so."""
    s = _Setup(group, transport)
    if s.rank == 1:
        s.pipe._broken = "rank 1 failed during step 0: RuntimeError: injected"
    return _try(s.pipe.resync)[:3]


# ---------------------------------------------------------------- two pipelines in different orders


def case_pipelines_in_different_orders(group, transport):
    """Rank 0 steps pipeline A while the others step B: their step counts now differ. Every later
    step of either raises until both are resynced; then both train exactly."""
    a, b = _Setup(group, transport, seed=1), _Setup(group, transport, seed=2)
    first = _try(lambda: (a if a.rank == 0 else b).exact(0))
    later = [_try(lambda: a.exact(1))[:3], _try(lambda: b.exact(2))[:3]]
    resyncs = [_try(p.resync)[:3] for p in (a.pipe, b.pipe)]
    return first[:3], later, resyncs, a.exact(3), b.exact(4)


# ---------------------------------------------------------------- mismatches that keep the ranks aligned


def case_other_num_chunks_stays_usable(group, transport):
    """Another num_chunks on one rank for the same step: every rank raises, and the next step runs."""
    s = _Setup(group, transport)
    n = 2 if s.rank == 0 else 4
    odd = _try(lambda: s.step(*s.data(0, n=n)))
    return odd[:3], s.exact(1)


def case_step_ids(group, transport):
    """Equal step_ids run; different ones raise naming them and put the ranks out of step until
    resync(); equal ids with another mode or num_chunks on one rank leave the ranks aligned;
    a step_id that is no int is refused before anything moves."""
    s = _Setup(group, transport)
    out = {"equal": s.exact(0, step_id=0)}
    out["differ"] = _try(lambda: s.exact(1, step_id=1 if s.rank else 2))[:3]
    out["then"] = _try(lambda: s.exact(2, step_id=2))[:3]
    out["resync"] = _try(s.pipe.resync)[:3]
    out["realigned"] = s.exact(3, step_id=3)
    if s.rank == 0:
        out["mode"] = _try(lambda: _eval_with_id(s, 4))[:3]
    else:
        out["mode"] = _try(lambda: s.exact(4, step_id=4))[:3]
    out["after_mode"] = s.exact(5, step_id=5)
    out["missing"] = _try(lambda: s.exact(6, step_id=6 if s.rank else None))[:3]
    out["after_missing"] = _try(lambda: s.exact(7, step_id=7))[:3]
    _try(s.pipe.resync)
    out["bad"] = _try(lambda: s.exact(8, step_id="8" if s.rank == 1 else 8))[:3]
    out["after_bad"] = s.exact(9, step_id=9)
    return out


def case_extra_training_step(group, transport):
    """Rank 0 runs one training step more, with the same num_chunks: without step ids it looks
    like the others' step and runs (the limit docs/runtime.md states; rank 0's last step then
    waits for a step nobody else runs)."""
    s = _Setup(group, transport)
    out = [_try(lambda: s.exact(0))[:3]]
    if s.rank == 0:
        out.append(_try(lambda: s.exact(1))[:3])  # the extra step
    out.append(_try(lambda: s.exact(2))[:3])
    return out


def case_extra_training_step_with_ids(group, transport):
    """The same with step ids: the extra step is caught before anything moves."""
    s = _Setup(group, transport)
    out = [_try(lambda: s.exact(0, step_id=0))[:3]]
    if s.rank == 0:
        out.append(_try(lambda: s.exact(1, step_id=1))[:3])
    out.append(_try(lambda: s.exact(2, step_id=2))[:3])
    return out


def _eval_with_id(s, seed):
    with torch.no_grad():
        return s.step(*s.data(seed), step_id=seed)


def _cases():
    cases = {}
    for transport in TRANSPORTS:
        for name, fn in [
            ("extra_step", case_extra_step_then_continue),
            ("partial_resync", case_partial_resync),
            ("resync_and_step", case_resync_and_step_when_in_step),
            ("resync_other_pipeline", case_resync_is_collective_over_one_pipeline),
            ("resync_aligned", case_resync_of_an_aligned_pipeline),
            ("resync_broken", case_resync_of_a_broken_pipeline),
            ("different_orders", case_pipelines_in_different_orders),
            ("other_num_chunks", case_other_num_chunks_stays_usable),
            ("step_ids", case_step_ids),
            ("extra_training_step", case_extra_training_step),
            ("extra_training_step_ids", case_extra_training_step_with_ids),
        ]:
            cases[f"{name}[{transport}]"] = (WORLD, functools.partial(fn, transport=transport))
    return cases


@pytest.fixture(scope="module")
def out():
    return run_world(WORLD, run_cases, _cases())


def _result(out, name, transport, rank):
    result = out[rank][f"{name}[{transport}]"]
    assert not isinstance(result, str), f"rank {rank}: {result}"
    return result


OUT_OF_STEP = "PipelineOutOfStepError"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_extra_step_blocks_every_rank_until_resync(out, transport):
    for rank in range(WORLD):
        log = _result(out, "extra_step", transport, rank)
        kinds = [(what, kind) for what, kind, *_ in log]
        # Batch 0 is exact; the extra step (rank 0) meets batch 1 (the others): a mismatch on every
        # rank; then no step completes anywhere until resync().
        expected = [(0, "none"), ("eval" if rank == 0 else 1, "PipelineMismatchError")]
        expected += [(b, OUT_OF_STEP) for b in (range(1, 4) if rank == 0 else range(2, 4))]
        expected += [("resync", "none"), ("after", "none"), ("after", "none")]
        assert kinds == expected, (rank, log)
        for what, kind, msg, seconds, value in log:
            assert seconds < TIMEOUT, (rank, what, seconds, msg)  # found by the agreement, not a timeout
            if kind == "none" and what != "resync":
                assert value == [], (rank, what, value)  # gradients equal a clean run's
            if kind == "PipelineMismatchError":
                assert "forward-only" in msg and "training" in msg and "resync()" in msg, msg
            if kind == OUT_OF_STEP:
                assert "resync()" in msg and "new pipeline" in msg and "step 1" in msg, msg


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_resync_called_by_some_ranks_only(out, transport):
    for rank in range(WORLD):
        (kind, msg, seconds), broken = _result(out, "partial_resync", transport, rank)
        if rank < 2:  # rank 2 never calls resync(): the others give up at the timeout, naming it
            assert kind == "PipelineTimeoutError" and "resync()" in msg and f"rank {rank}" in msg, (rank, kind, msg)
            assert seconds < TIMEOUT + SLACK, (rank, seconds)
            assert broken, rank  # its exchanges no longer pair with rank 2's
        else:
            assert kind == OUT_OF_STEP and "resync()" in msg and seconds < TIMEOUT, (rank, kind, msg)
            assert not broken


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_resync_against_step_on_a_pipeline_in_step(out, transport):
    for rank in range(WORLD):
        (kind, msg, seconds), then, resync, after = _result(out, "resync_and_step", transport, rank)
        assert kind == "PipelineMismatchError" and "call (rank 0: resync(); ranks 1, 2: step())" in msg, (rank, kind, msg)
        assert seconds < TIMEOUT, (rank, seconds)
        assert then[0] == OUT_OF_STEP and resync[0] == "none" and after == [], (rank, then, resync, after)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_resync_of_another_pipeline(out, transport):
    for rank in range(WORLD):
        other, again, exact_a, exact_b = _result(out, "resync_other_pipeline", transport, rank)
        kind, msg, seconds = other
        assert kind == "PipelineMismatchError" and "pipeline" in msg and seconds < TIMEOUT, (rank, kind, msg)
        assert [k for k, _, _ in again] == ["none", "none"], (rank, again)
        assert exact_a == [] and exact_b == [], (rank, exact_a, exact_b)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_resync_when_aligned_is_harmless(out, transport):
    for rank in range(WORLD):
        before, resync, after = _result(out, "resync_aligned", transport, rank)
        assert before == [] and resync[0] == "none" and after == [], (rank, before, resync, after)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_resync_of_a_broken_pipeline_raises_everywhere(out, transport):
    for rank in range(WORLD):
        kind, msg, seconds = _result(out, "resync_broken", transport, rank)
        assert kind == "PipelineBrokenError" and "injected" in msg and "new pipeline" in msg, (rank, kind, msg)
        assert seconds < TIMEOUT


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pipelines_stepped_in_different_orders(out, transport):
    for rank in range(WORLD):
        first, later, resyncs, exact_a, exact_b = _result(out, "different_orders", transport, rank)
        assert first[0] == "PipelineMismatchError" and "pipeline" in first[1], (rank, first)
        for kind, msg, seconds in later:
            assert kind == OUT_OF_STEP and "resync()" in msg and seconds < TIMEOUT, (rank, kind, msg)
        assert [k for k, _, _ in resyncs] == ["none", "none"], (rank, resyncs)
        assert exact_a == [] and exact_b == [], (rank, exact_a, exact_b)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_other_num_chunks_keeps_the_pipeline_usable(out, transport):
    for rank in range(WORLD):
        (kind, msg, _), after = _result(out, "other_num_chunks", transport, rank)
        assert kind == "PipelineMismatchError" and "num_chunks" in msg and "still usable" in msg, (rank, kind, msg)
        assert after == [], (rank, after)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_step_ids(out, transport):
    for rank in range(WORLD):
        r = _result(out, "step_ids", transport, rank)
        assert r["equal"] == [] and r["realigned"] == [] and r["after_mode"] == [] and r["after_bad"] == [], (rank, r)
        kind, msg, _ = r["differ"]
        assert kind == "PipelineMismatchError" and "step_id (rank 0: 2; ranks 1, 2: 1)" in msg and "resync()" in msg, (rank, msg)
        assert r["then"][0] == OUT_OF_STEP and r["resync"][0] == "none", (rank, r)
        kind, msg, _ = r["mode"]  # same step_id, another mode: the same step, skipped on every rank
        assert kind == "PipelineMismatchError" and "forward-only" in msg and "still usable" in msg, (rank, msg)
        kind, msg, _ = r["missing"]  # a step_id on some ranks only: which step they run is unknown
        assert kind == "PipelineMismatchError" and "step_id (rank 0: none; ranks 1, 2: 6)" in msg, (rank, msg)
        assert r["after_missing"][0] == OUT_OF_STEP, (rank, r)
        kind, msg, _ = r["bad"]
        if rank == 1:
            assert kind == "ValueError" and msg.startswith("step_id='8': must be an int"), msg
        else:
            assert kind == "PipelineAbortedError" and "step_id='8'" in msg, (rank, kind, msg)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_extra_step_alike_needs_step_ids(out, transport):
    for rank in range(WORLD):
        plain = [k for k, _, _ in _result(out, "extra_training_step", transport, rank)]
        # It ran: nothing tells it apart. Rank 0's last step finds no partner.
        assert plain == (["none", "none", "PipelineTimeoutError"] if rank == 0 else ["none", "none"]), (rank, plain)
        ids = _result(out, "extra_training_step_ids", transport, rank)
        expected = ["none", "PipelineMismatchError"] + ([OUT_OF_STEP] if rank == 0 else [])
        assert [k for k, _, _ in ids] == expected, (rank, ids)
        assert "step_id (rank 0: 1; ranks 1, 2: 2)" in ids[1][1], ids[1][1]
        assert all(seconds < TIMEOUT for _, _, seconds in ids), ids
