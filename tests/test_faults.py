"""Fault injection: ranks that get out of step, disagree, pass tensors through, die during setup,
or share a process. Each case ends in exact results or a clear error on every rank involved, never
in wrong numbers, a hang or a process abort.

One world of three processes runs every case on a fresh sub-group; the rank killed during setup
gets a world of its own.
"""

from __future__ import annotations

import copy
import functools
import glob
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from distributed import run_cases, run_world

WORLD = 3
TIMEOUT = 4.0
SLACK = 6.0  # seconds a clear error may take beyond the timeout on a busy 2-core machine


def _outcome(fn):
    """Run fn; return (exception type name or 'none', message, seconds, fn's value)."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:  # the test inspects what came out
        return type(exc).__name__, str(exc), time.monotonic() - start, None
    return "none", "", time.monotonic() - start, value


class _Setup:
    """A model, its single-process reference, and this rank's pipeline over ``group``."""

    def __init__(self, group, schedule="dualpipev", kind=models.MLPStage, seed=7, **options):
        import twinpipe
        from twinpipe.schedule.registry import placement_for

        self.rank = dist.get_rank(group)
        self.placement = placement_for(schedule, dist.get_world_size(group))
        self.model = models.make_model(kind, self.placement.num_model_stages, seed=seed)
        mine = [copy.deepcopy(self.model[self.placement.model_stage(s)]) for s in self.placement.stages_of(self.rank)]
        options.setdefault("timeout", TIMEOUT)
        self.pipe = twinpipe.Pipeline(mine, schedule, process_group=group, **options)

    def data(self, n, seed, rows=2, inputs=1):
        gen = torch.Generator().manual_seed(seed)
        xs = [tuple(torch.randn(rows, 3, models.HIDDEN, generator=gen, dtype=torch.float64) for _ in range(inputs)) for _ in range(n)]
        labels = [torch.randn(rows, 3, models.HIDDEN, generator=gen, dtype=torch.float64) for _ in range(n)]
        return xs, labels

    def args(self, xs, labels):
        """What this rank passes to step(): its chains' inputs and labels."""
        n, args, labs = len(xs), (), ()
        for c, chain in enumerate(self.placement.chains):
            mbs = self.placement.microbatches_of_chain(c, n)
            if chain[0] in self.pipe.stages:
                args = tuple(torch.cat([xs[j][k] for j in mbs]) for k in range(len(xs[0])))
            if chain[-1] in self.pipe.stages:
                labs = (torch.cat([labels[j] for j in mbs]),)
        return args, labs

    def step(self, xs, labels, criterion=models.mse, **kw):
        args, labs = self.args(xs, labels)
        return self.pipe.step(*args, num_chunks=len(xs), criterion=criterion, labels=labs, **kw)

    def exact_step(self, xs, labels, criterion=models.mse) -> list[str]:
        """One training step from zero gradients, compared with the reference: what differs."""
        for m in (*self.model, self.pipe):
            m.zero_grad(set_to_none=True)
        ref_losses, _ = models.reference(self.model, self.placement, xs, labels, criterion)
        loss, _ = self.step(xs, labels, criterion)
        problems = []
        for c, chain in enumerate(self.placement.chains):
            if chain[-1] in self.pipe.stages:
                mbs = self.placement.microbatches_of_chain(c, len(xs))
                if not torch.equal(loss, torch.stack([ref_losses[j].detach() for j in mbs])):
                    problems.append("losses differ from the reference")
        for s, module in zip(self.pipe.stages, self.pipe.module):
            for p, q in zip(module.parameters(), self.model[self.placement.model_stage(s)].parameters()):
                if p.grad is None or not models.grad_error(p.grad, q.grad) <= 1e-13:
                    problems.append(f"stage {s}: gradients differ from the reference")
        return problems


# ---------------------------------------------------------------- ranks out of step


def case_extra_eval_step(group):
    """Rank 0 runs an evaluation step the others do not; every rank resyncs and trains again
    (tests/test_step_agreement.py follows such ranks further)."""
    setup = _Setup(group)
    xs, labels = setup.data(4, seed=1)
    first = setup.exact_step(xs, labels)
    if setup.rank == 0:
        with torch.no_grad():
            odd = _outcome(lambda: setup.step(xs, labels))
    else:
        odd = _outcome(lambda: setup.step(xs, labels))
    setup.pipe.resync()
    after = setup.exact_step(*setup.data(4, seed=2))
    return first, odd[:3], after


def case_skipped_bad_batch(group):
    """Rank 0's step rejects a batch; every rank catches the error and skips it; training goes on."""
    setup = _Setup(group)
    xs, labels = setup.data(4, seed=3)
    if setup.rank == 0:
        bad = _outcome(lambda: setup.pipe.step(xs[0][0][:1], num_chunks=4, criterion=models.mse, labels=(labels[0],)))
    else:
        bad = _outcome(lambda: setup.step(xs, labels))
    after = [setup.exact_step(*setup.data(4, seed=s)) for s in (4, 5)]
    return bad[:3], after


def case_different_num_chunks(group):
    setup = _Setup(group)
    n = 4 if setup.rank == 0 else 6
    return _outcome(lambda: setup.step(*setup.data(n, seed=6)))[:3]


def case_different_num_chunks_across_hosts(group):
    """The same, with the agreement through the process group (as across hosts) instead of the
    shared-memory board; then the ranks agree again and train exactly."""
    setup = _Setup(group)
    setup.pipe._board = None
    n = 4 if setup.rank == 0 else 6
    odd = _outcome(lambda: setup.step(*setup.data(n, seed=6)))[:3]
    return odd, setup.exact_step(*setup.data(4, seed=7))


def _build_and_step(group, **options):
    def run():
        setup = _Setup(group, **options)
        return setup.step(*setup.data(4, seed=7))

    return _outcome(run)[:3]


def case_different_schedules(group):
    """Ranks build their pipelines with different schedules: construction says so on both."""
    return _build_and_step(group, schedule="1f1b" if dist.get_rank(group) == 0 else "zb-h1")


def _different_dtypes(group, transport):
    rank = dist.get_rank(group)
    dtype = torch.float64 if rank == 0 else torch.float32
    return _build_and_step(group, tensor_shapes=[(2, 3, models.HIDDEN)], tensor_dtype=dtype, transport=transport)


def case_different_dtypes_gloo(group):
    return _different_dtypes(group, "process-group")


def case_different_dtypes_shm(group):
    return _different_dtypes(group, "auto")


def case_pipelines_called_in_different_orders(group):
    """Two pipelines on one group, stepped in a different order on each rank."""
    a, b = _Setup(group, seed=1), _Setup(group, seed=2)
    first, second = (a, b) if dist.get_rank(group) == 0 else (b, a)
    data = first.data(4, seed=9)
    return _outcome(lambda: first.step(*data))[:3]


def case_mid_step_failure_then_next_step(group):
    """A rank fails inside a step; the next step says clearly on every rank that the pipeline is broken."""
    setup = _Setup(group, schedule="1f1b", transport="process-group")
    if setup.rank == 1:
        setup.pipe.module[0].forward = _fail_on_third_call(setup.pipe.module[0].forward)
    xs, labels = setup.data(6, seed=10)
    failed = _outcome(lambda: setup.step(xs, labels))[:3]
    again = _outcome(lambda: setup.step(xs, labels))[:3]
    # A new pipeline, on a new group: gloo closes a connection whose wait timed out.
    fresh = _Setup(dist.new_group(list(range(3))), schedule="1f1b", transport="process-group")
    return failed, again, fresh.exact_step(xs, labels)


def _fail_on_third_call(forward):
    calls = [0]

    def wrapped(*args):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("boom: user code failed")
        return forward(*args)

    return wrapped


# ---------------------------------------------------------------- pass-through outputs


class FirstPassThrough(nn.Module):
    """Stage 0 of a token model: returns its hidden state and its own input token ids unchanged."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(models.HIDDEN, models.HIDDEN)

    def forward(self, x, token_ids):
        return self.lin(x), token_ids


class MiddlePassThrough(nn.Module):
    """A middle stage: uses the received ids and float mask, and passes both on unchanged."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(models.HIDDEN, models.HIDDEN)

    def forward(self, h, token_ids, mask=None):
        if mask is None:  # the first stage's mask rides along in the ids' place
            mask = (token_ids % 2).to(h.dtype)
        return torch.tanh(self.lin(h)) * mask[..., None], token_ids, mask


class LastPassThrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(models.HIDDEN, models.HIDDEN)

    def forward(self, h, token_ids, mask):
        return self.lin(h * mask[..., None])


def _pass_through(group, transport):
    import twinpipe

    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(11)
    model = [FirstPassThrough().double(), *[MiddlePassThrough().double() for _ in range(ranks - 2)], LastPassThrough().double()]
    pipe = twinpipe.Pipeline([copy.deepcopy(model[rank])], "1f1b", process_group=group, timeout=TIMEOUT, transport=transport)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(8, 3, models.HIDDEN, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 9, (8, 3), generator=gen)
    label = torch.randn(8, 3, models.HIDDEN, generator=gen, dtype=torch.float64)

    def reference():
        losses = []
        for xk, ik, lk in zip(x.tensor_split(4), ids.tensor_split(4), label.tensor_split(4)):
            out = (xk, ik)
            for stage in model:
                out = stage(*out)
                out = out if isinstance(out, tuple) else (out,)
            loss = models.mse(out[0], lk)
            if torch.is_grad_enabled():
                loss.backward()
            losses.append(loss.detach())
        return torch.stack(losses)

    problems = []
    for training in (True, False):
        with torch.set_grad_enabled(training):
            ref = reference()
            args = (x, ids) if rank == 0 else ()
            labels = (label,) if rank == ranks - 1 else ()
            loss, _ = pipe.step(*args, num_chunks=4, criterion=models.mse, labels=labels)
        if rank == ranks - 1 and not torch.equal(loss, ref):
            problems.append(f"{'training' if training else 'forward-only'} losses differ")
        if training:
            for p, q in zip(pipe.parameters(), model[rank].parameters()):
                if not models.grad_error(p.grad, q.grad) <= 1e-13:
                    problems.append("gradients differ")
    return problems


def case_pass_through_shm(group):
    return _pass_through(group, "auto")


def case_pass_through_gloo(group):
    return _pass_through(group, "process-group")


# ---------------------------------------------------------------- one process, two pipelines


def case_two_pipelines_two_threads(group):
    """Two zero-bubble pipelines (deferred W) on two groups, stepped at once from two threads."""
    # Only ranks 0 and 1 run this: groups made without the other ranks must not count for theirs
    # (else a later case's group over all three ranks waits forever for rank 2).
    groups = [dist.new_group([0, 1], use_local_synchronization=True) for _ in range(2)]
    setups = [_Setup(g, schedule="zb-h1", seed=20 + i) for i, g in enumerate(groups)]
    results: list = [None, None]

    def train(i):
        problems = []
        for s in range(3):
            problems += setups[i].exact_step(*setups[i].data(6, seed=30 + 10 * i + s))
        results[i] = problems

    threads = [threading.Thread(target=train, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


# ---------------------------------------------------------------- bounded waits


def case_construction_alone(group):
    """Rank 1 never builds its pipeline: rank 0's construction gives up at its timeout."""
    if dist.get_rank(group) == 1:
        time.sleep(TIMEOUT + 1)
        return None
    return _outcome(lambda: _Setup(group))[:3]


def case_long_construction_facts(group):
    """150 declared message tensors (a fact longer than the agreement's frame): the pipeline
    builds; when rank 1 declares one more, both ranks name the difference."""
    rank = dist.get_rank(group)
    shapes = [(2, 3, models.HIDDEN)] * 150
    built = _outcome(lambda: _Setup(group, tensor_shapes=shapes, tensor_dtype=torch.float64))[:3]
    extra = [(2, 3, models.HIDDEN)] if rank == 1 else []
    differ = _outcome(lambda: _Setup(group, tensor_shapes=shapes + extra, tensor_dtype=torch.float64))[:3]
    return built, differ


def case_sync_mirrored_grads_alone(group):
    import twinpipe

    rank = dist.get_rank(group)
    pipe = twinpipe.DualPipe([models.MLPStage().double(), models.MLPStage().double()], process_group=group, timeout=TIMEOUT)
    if rank == 1:
        time.sleep(TIMEOUT + 1)
        return None
    return _outcome(pipe.sync_mirrored_grads)[:3]


def case_expert_all_to_all_alone(group):
    """An EP all-to-all whose peer never joins gives up at the limit in force."""
    from twinpipe.overlap import comm
    from twinpipe.runtime import waits

    if dist.get_rank(group) == 1:
        time.sleep(3.0)
        return None
    with waits.limit(1.5):
        return _outcome(lambda: comm.all_to_all(torch.zeros(4, 2), [2, 2], [2, 2], group).wait())[:3]


def case_mirrored_copies_disagree(group):
    """DualPipe's two copies of a stage differ in shape, then the ranks call different syncs: every
    rank raises, nothing aborts the process and no weight lands in a gradient."""
    import twinpipe

    rank = dist.get_rank(group)
    widths = (models.HIDDEN, models.HIDDEN if rank == 0 else models.HIDDEN + 1)
    pipe = twinpipe.DualPipe([models.MLPStage(w).double() for w in widths], process_group=group, timeout=TIMEOUT)
    shapes = _outcome(pipe.sync_mirrored_grads)[:3]
    same = twinpipe.DualPipe([models.MLPStage().double(), models.MLPStage().double()], process_group=group, timeout=TIMEOUT)
    operations = _outcome(same.sync_mirrored_grads if rank == 0 else same.sync_mirrored_weights)[:3]
    return shapes, operations


def case_mirrored_sync_of_different_pipelines(group):
    """Two DualPipes alike on one group; rank 0 syncs the first, rank 1 the second: both raise,
    and no rank's gradients are summed with another pipeline's."""
    import twinpipe

    rank = dist.get_rank(group)
    pipes = [twinpipe.DualPipe([models.MLPStage().double(), models.MLPStage().double()], process_group=group, timeout=TIMEOUT)
             for _ in range(2)]
    return _outcome(pipes[rank].sync_mirrored_grads)[:3]


def _copies_pipeline(group, chain_ranks, widths=None):
    """A pipeline over a placement whose chains are whole copies of a 2-stage model, chain c's
    stages on ranks ``chain_ranks[c]`` (several copies of one stage may share a rank)."""
    import twinpipe
    from twinpipe.schedule.ops import BW, F, Schedule
    from twinpipe.schedule.placement import Placement

    n = len(chain_ranks[0])
    chains = tuple(tuple(range(c * n, (c + 1) * n)) for c in range(len(chain_ranks)))
    placement = Placement("copies", dist.get_world_size(group), tuple(r for ranks in chain_ranks for r in ranks), chains)
    slots = [[] for _ in range(placement.num_ranks)]  # micro-batch c down chain c, then back (GPipe-like)
    for c, chain in enumerate(chains):
        for q, stage in enumerate(chain):
            slots[placement.rank_of(stage)] += [((q, c), F(stage, c)), ((2 * n - 1 - q, c), BW(stage, c))]
    ops = tuple(tuple(op for _, op in sorted(rank_slots)) for rank_slots in slots)
    rank = dist.get_rank(group)
    mine = placement.stages_of(rank)
    widths = widths or [models.HIDDEN] * len(mine)
    modules = [models.MLPStage(w).double() for w in widths]
    return twinpipe.Pipeline(modules, Schedule("copies", placement, len(chains), ops), process_group=group, timeout=TIMEOUT), placement


def _seeded(stage: int, params, salt: int) -> list:
    """What copy ``stage`` holds in this test: tensors drawn from a seed of its own."""
    gen = torch.Generator().manual_seed(1000 * salt + stage)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def case_mirrored_three_copies(group, chain_ranks):
    """Three copies of each model stage: after sync_mirrored_grads every copy holds the sum of the
    three in chain order, bitwise; after sync_mirrored_weights the lowest rank's copy (its lowest
    chain's, where it holds two). Returns what differs."""
    pipe, placement = _copies_pipeline(group, chain_ranks)
    rank, problems = dist.get_rank(group), []
    copies = {}  # model stage -> its stages, in chain order
    for chain in placement.chains:
        for q, stage in enumerate(chain):
            copies.setdefault(q, []).append(stage)
    shapes = list(pipe.module[0].parameters())
    for s, m in zip(pipe.stages, pipe.module):
        for p, g in zip(m.parameters(), _seeded(s, shapes, 1)):
            p.grad = g
        with torch.no_grad():
            for p, w in zip(m.parameters(), _seeded(s, shapes, 2)):
                p.copy_(w)
    pipe.sync_mirrored_grads()
    pipe.sync_mirrored_weights()
    for s, m in zip(pipe.stages, pipe.module):
        stages = copies[placement.model_stage(s)]
        a, b, c = (_seeded(t, shapes, 1) for t in stages)
        in_order = [(x + y) + z for x, y, z in zip(a, b, c)]
        if all(torch.equal(u, v) for u, v in zip(in_order, [(x + z) + y for x, y, z in zip(a, b, c)])):
            problems.append("the data cannot tell one summation order from another")
        if not all(torch.equal(p.grad, t) for p, t in zip(m.parameters(), in_order)):
            problems.append(f"stage {s}: gradients are not the chain-order sum of the copies")
        source = min(stages, key=lambda t: (placement.rank_of(t), placement.chain_of_stage(t)))
        if not all(torch.equal(p, t) for p, t in zip(m.parameters(), _seeded(source, shapes, 2))):
            problems.append(f"stage {s}: weights are not those of stage {source}")
    return problems


def case_mirrored_three_copies_disagree(group):
    """Three copies of each model stage on three ranks; rank 2's are wider, then rank 2 calls the
    other sync: every rank raises PipelineMismatchError, none aborts or waits for its timeout."""
    rank = dist.get_rank(group)
    chain_ranks = ((0, 1), (1, 2), (2, 0))
    width = models.HIDDEN + (1 if rank == 2 else 0)
    pipe, _ = _copies_pipeline(group, chain_ranks, [width, width])
    shapes = _outcome(pipe.sync_mirrored_grads)[:3]
    same, _ = _copies_pipeline(group, chain_ranks)
    operations = _outcome(same.sync_mirrored_weights if rank == 2 else same.sync_mirrored_grads)[:3]
    return shapes, operations


def case_mirrored_own_copies_disagree(group):
    """Rank 0 holds two copies of model stage 0 that differ: both ranks raise PipelineMismatchError."""
    widths = [models.HIDDEN, models.HIDDEN, models.HIDDEN + 1] if dist.get_rank(group) == 0 else None
    pipe, _ = _copies_pipeline(group, ((0, 1), (1, 0), (0, 1)), widths)
    return _outcome(pipe.sync_mirrored_grads)[:3]


def case_bad_timeouts(group):
    import twinpipe

    out = []
    for value in (float("nan"), float("inf"), "5", 0.0005, -1, True):
        out.append(_outcome(lambda v=value: twinpipe.Pipeline([models.MLPStage().double()], "1f1b", process_group=group, timeout=v))[:2])
    return out


CASES = {
    "extra_eval_step": (3, case_extra_eval_step),
    "skipped_bad_batch": (3, case_skipped_bad_batch),
    "different_num_chunks": (2, case_different_num_chunks),
    "different_num_chunks_across_hosts": (2, case_different_num_chunks_across_hosts),
    "different_schedules": (2, case_different_schedules),
    "different_dtypes_gloo": (2, case_different_dtypes_gloo),
    "different_dtypes_shm": (2, case_different_dtypes_shm),
    "pipelines_called_in_different_orders": (2, case_pipelines_called_in_different_orders),
    "mid_step_failure_then_next_step": (3, case_mid_step_failure_then_next_step),
    "pass_through_shm": (3, case_pass_through_shm),
    "pass_through_gloo": (3, case_pass_through_gloo),
    "two_pipelines_two_threads": (2, case_two_pipelines_two_threads),
    "construction_alone": (2, case_construction_alone),
    "long_construction_facts": (2, case_long_construction_facts),
    "sync_mirrored_grads_alone": (2, case_sync_mirrored_grads_alone),
    "expert_all_to_all_alone": (2, case_expert_all_to_all_alone),
    "mirrored_copies_disagree": (2, case_mirrored_copies_disagree),
    "mirrored_sync_of_different_pipelines": (2, case_mirrored_sync_of_different_pipelines),
    # Model stage 0's copies: chains 0 and 2 on rank 0, chain 1 on rank 1 (and the reverse for stage 1).
    "mirrored_three_copies_two_ranks": (2, functools.partial(case_mirrored_three_copies, chain_ranks=((0, 1), (1, 0), (0, 1)))),
    "mirrored_three_copies_three_ranks": (3, functools.partial(case_mirrored_three_copies, chain_ranks=((0, 1), (1, 2), (2, 0)))),
    "mirrored_three_copies_disagree": (3, case_mirrored_three_copies_disagree),
    "mirrored_own_copies_disagree": (2, case_mirrored_own_copies_disagree),
    "bad_timeouts": (1, case_bad_timeouts),
}


@pytest.fixture(scope="module")
def out():
    return run_world(WORLD, run_cases, CASES)


def _all_clear(out, name, ranks):
    """Every rank raised, quickly; returns their (kind, message) pairs."""
    results = [out[r][name] for r in range(ranks)]
    for r, result in enumerate(results):
        assert not isinstance(result, str), f"rank {r}: {result}"
        kind, msg, seconds = result
        assert kind != "none", f"rank {r} raised nothing"
        assert seconds < TIMEOUT + SLACK, f"rank {r} took {seconds:.1f} s: {msg}"
    return [(k, m) for k, m, _ in results]


def test_extra_evaluation_step_on_one_rank(out):
    for rank in range(3):
        first, odd, after = out[rank]["extra_eval_step"]
        assert first == [] and after == [], (rank, first, after)
        kind, msg, seconds = odd
        assert kind == "PipelineMismatchError", (rank, kind, msg)
        assert "forward-only" in msg and "training" in msg and "rank 0" in msg, msg
        assert seconds < TIMEOUT, seconds  # found before any message moved, not by a timeout


def test_caught_and_skipped_bad_batch(out):
    kind, msg, _ = out[0]["skipped_bad_batch"][0]
    assert kind == "ValueError" and "inputs[0]" in msg
    for rank in (1, 2):
        (kind, msg, seconds), after = out[rank]["skipped_bad_batch"]
        assert kind == "PipelineAbortedError" and "rank 0" in msg and "inputs[0]" in msg, msg
        assert seconds < TIMEOUT
    for rank in range(3):
        assert out[rank]["skipped_bad_batch"][1] == [[], []], out[rank]["skipped_bad_batch"][1]


def test_different_num_chunks(out):
    for kind, msg in _all_clear(out, "different_num_chunks", 2):
        assert kind == "PipelineMismatchError" and "num_chunks" in msg and "4" in msg and "6" in msg, msg


def test_different_num_chunks_agreed_through_the_process_group(out):
    for rank in (0, 1):
        (kind, msg, seconds), after = out[rank]["different_num_chunks_across_hosts"]
        assert kind == "PipelineMismatchError" and "num_chunks" in msg and seconds < TIMEOUT, msg
        assert after == [], after


def test_different_schedules(out):
    for kind, msg in _all_clear(out, "different_schedules", 2):
        assert kind == "PipelineMismatchError" and "1f1b" in msg and "zb-h1" in msg, msg


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_different_declared_dtypes(out, transport):
    for kind, msg in _all_clear(out, f"different_dtypes_{transport}", 2):
        assert kind == "PipelineMismatchError" and "float64" in msg and "float32" in msg, msg


def test_pipelines_called_in_different_orders(out):
    for kind, msg in _all_clear(out, "pipelines_called_in_different_orders", 2):
        assert kind == "PipelineMismatchError" and "pipeline" in msg, msg


def test_mid_step_failure_makes_the_next_step_say_so(out):
    for rank in range(3):
        failed, again, fresh = out[rank]["mid_step_failure_then_next_step"]
        assert fresh == [], (rank, fresh)
        assert failed[0] != "none"
        kind, msg, seconds = again
        # Each rank names the failure it saw: rank 1 its own, its peers their wait for rank 1.
        assert kind == "PipelineBrokenError" and "rank 1" in msg, (rank, kind, msg)
        assert rank != 1 or "boom" in msg, msg
        assert seconds < TIMEOUT + SLACK


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_pass_through_outputs(out, transport):
    for rank in range(3):
        assert out[rank][f"pass_through_{transport}"] == [], out[rank][f"pass_through_{transport}"]


def test_two_pipelines_in_two_threads(out):
    for rank in (0, 1):
        assert out[rank]["two_pipelines_two_threads"] == [[], []], out[rank]["two_pipelines_two_threads"]


def test_construction_waits_are_bounded(out):
    kind, msg, seconds = out[0]["construction_alone"]
    assert kind == "PipelineTimeoutError" and "rank 0" in msg, msg
    assert seconds < TIMEOUT + SLACK


def test_long_construction_facts(out):
    for rank in (0, 1):
        built, differ = out[rank]["long_construction_facts"]
        assert built[0] == "none", (rank, built)
        kind, msg, seconds = differ
        assert kind == "PipelineMismatchError" and "message layouts" in msg, (rank, kind, msg)
        assert seconds < TIMEOUT


def test_sync_mirrored_grads_waits_are_bounded(out):
    kind, msg, seconds = out[0]["sync_mirrored_grads_alone"]
    assert kind == "PipelineTimeoutError" and "sync_mirrored_grads" in msg and "rank 1" in msg, msg
    assert seconds < TIMEOUT + SLACK


def test_expert_all_to_all_waits_are_bounded(out):
    kind, msg, seconds = out[0]["expert_all_to_all_alone"]
    assert kind == "PipelineTimeoutError" and "EP rank 0" in msg and "[0, 1]" in msg, (kind, msg)
    assert seconds < 1.5 + SLACK


def test_mirrored_copies_that_disagree_raise_on_both_ranks(out):
    for rank in (0, 1):
        for kind, msg, seconds in out[rank]["mirrored_copies_disagree"]:
            assert kind == "PipelineMismatchError" and "copies disagree" in msg, (rank, kind, msg)
            assert seconds < TIMEOUT


def test_mirrored_sync_of_different_pipelines_raises_on_both_ranks(out):
    for rank in (0, 1):
        kind, msg, seconds = out[rank]["mirrored_sync_of_different_pipelines"]
        assert kind == "PipelineMismatchError" and "copies disagree" in msg and "pipeline #" in msg, (rank, kind, msg)
        assert seconds < TIMEOUT


@pytest.mark.parametrize("ranks", ["two", "three"])
def test_mirrored_sync_of_three_copies(out, ranks):
    n = {"two": 2, "three": 3}[ranks]
    for rank in range(n):
        assert out[rank][f"mirrored_three_copies_{ranks}_ranks"] == [], (rank, out[rank][f"mirrored_three_copies_{ranks}_ranks"])


def test_three_copies_that_disagree_raise_on_every_rank(out):
    for rank in range(3):
        result = out[rank]["mirrored_three_copies_disagree"]
        assert not isinstance(result, str), f"rank {rank}: {result}"
        for kind, msg, seconds in result:
            assert kind == "PipelineMismatchError" and "copies disagree" in msg, (rank, kind, msg)
            assert seconds < TIMEOUT


def test_copies_that_disagree_on_one_rank_raise_on_every_rank(out):
    for rank in range(2):
        kind, msg, seconds = out[rank]["mirrored_own_copies_disagree"]
        assert kind == "PipelineMismatchError" and "copies disagree" in msg, (rank, kind, msg)
        assert rank == 1 or "rank 0's own copies of model stages [0] differ" in msg, msg
        assert seconds < TIMEOUT


def test_bad_timeouts_are_refused_up_front(out):
    for kind, msg in out[0]["bad_timeouts"]:
        assert kind == "ValueError" and "timeout=" in msg, (kind, msg)


# ---------------------------------------------------------------- a rank killed during setup


def _killed_during_setup(rank, world):
    import twinpipe
    from twinpipe.runtime import shm

    if rank == 1:  # dies right after creating its ring files, before its peer maps them
        original = shm._Pipe.__init__

        def die(self, path, capacity, create):
            original(self, path, capacity, create)
            os._exit(3)

        shm._Pipe.__init__ = die
    before = set(glob.glob("/dev/shm/twinpipe-*"))
    result = _outcome(lambda: twinpipe.Pipeline([models.MLPStage().double()], "1f1b", timeout=TIMEOUT))[:3]
    time.sleep(0.5)
    return result, sorted(set(glob.glob("/dev/shm/twinpipe-*")) - before)


def test_rank_killed_during_setup():
    results = run_world(2, _killed_during_setup, allow_deaths=True)
    assert results[1] == ("died", 3)
    (kind, msg, seconds), leftovers = results[0]
    assert kind in ("PipelineTimeoutError", "PipelineCommError"), (kind, msg)
    assert "rank 0" in msg and seconds < TIMEOUT + SLACK, (msg, seconds)
    assert leftovers == [], leftovers
