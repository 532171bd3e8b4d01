"""Late is not failed: waits under heavy CPU load, with a peer that arrives late, end at completion.

One world of two gloo ranks. Rank 0 loads the machine with busy processes (``LOAD_PER_CORE`` a
core, at most ``LOAD_MAX``, always stopped) and both ranks shorten the slice of a collective's
wait (``waits.POLL``) to ``SLICE``, so that waits cross many slice boundaries, each a chance for
the race of a work that completes just as its slice runs out (issue 29: "timed out after 0.2 s").
In each case rank 1 is late, by a few milliseconds many times or by ``LATE`` seconds once, in one
kind of wait: collectives through the one helper (all-reduce, all-gather, barrier, a data-parallel
sum), a gloo send, a pipeline's step on both transports (step agreement, gloo and shared-memory
messages), and the expert all-to-alls of a ``twinpipe.moe`` stage. None may raise; a genuine
timeout still does, naming its limit, and a group whose own timeout is shorter is named with both.
"""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import models
import moe_models
from distributed import run_cases, run_world

WORLD = 2
LIMIT = 30.0  # every wait's limit: far longer than any lateness here
LATE = 1.0  # seconds a late peer arrives after the other
SLICE = 0.001  # seconds of one slice of a collective's wait (waits.POLL, 0.2 s by default; gloo counts whole ms)
LOAD_PER_CORE = 20  # busy processes per core (the issue: 40 on 2 cores)
LOAD_MAX = 40  # at most this many in all (a machine with many cores)
LOAD_SECONDS = 120  # a busy process ends by itself after this, should its rank die


def _load() -> list[subprocess.Popen]:
    spin = f"import time\nend = time.monotonic() + {LOAD_SECONDS}\nwhile time.monotonic() < end:\n    pass\n"
    count = min(LOAD_PER_CORE * (os.cpu_count() or 1), LOAD_MAX)
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]


def _late(group, seconds: float) -> None:
    if dist.get_rank(group) == 1:
        time.sleep(seconds)


def case_collectives_jittered(group):
    """300 all-reduces and 50 all-gathers, rank 1 late by 0-20 ms each time: completions land all
    over the slices."""
    from twinpipe.runtime.collectives import collective, gather_objects

    rng, problems = random.Random(dist.get_rank(group)), []
    for i in range(300):
        _late(group, rng.uniform(0, 0.02))
        t = torch.tensor([float(i + dist.get_rank(group))])
        collective(dist.all_reduce, t, group=group, timeout=LIMIT, what=f"all-reduce {i}")
        if t.item() != 2 * i + 1:
            problems.append(f"all-reduce {i}: {t.item()}")
    for i in range(50):
        _late(group, rng.uniform(0, 0.02))
        if gather_objects(group, [i, dist.get_rank(group)], LIMIT, f"all-gather {i}") != [[i, 0], [i, 1]]:
            problems.append(f"all-gather {i}")
    return problems


def case_collectives_late(group):
    """Rank 1 arrives ``LATE`` s late at an all-reduce, a barrier and a data-parallel sum."""
    from twinpipe.runtime.collectives import barrier, collective
    from twinpipe.train.grads import sum_across

    _late(group, LATE)
    t = torch.ones(3)
    collective(dist.all_reduce, t, group=group, timeout=LIMIT, what="late all-reduce")
    _late(group, LATE)
    barrier(group, LIMIT, "late barrier")
    _late(group, LATE)
    sum_across(t, group, LIMIT, "late data-parallel sum")
    return t.tolist()


def case_gloo_send_late(group):
    """Rank 1 sends ``LATE`` s after rank 0 posted its receive (a gloo p2p wait: one call, the whole limit)."""
    from twinpipe.runtime.comm import wait_work

    t = torch.full((4,), float(dist.get_rank(group)))
    if dist.get_rank(group) == 1:
        time.sleep(LATE)
        wait_work(group.send([t], 0, 7), LIMIT, "late send")
        return None
    wait_work(group.recv([t], 1, 7), LIMIT, "receive from a late sender")
    return t.tolist()


def _pipeline_late(group, transport):
    """A 1F1B step with rank 1's second forward ``LATE`` s late, after one on time: the same loss."""
    import twinpipe
    from twinpipe.schedule.registry import placement_for

    rank = dist.get_rank(group)
    placement = placement_for("1f1b", 2)
    model = models.make_model(models.MLPStage, placement.num_model_stages, seed=3)
    mine = [copy.deepcopy(model[placement.model_stage(s)]) for s in placement.stages_of(rank)]
    pipe = twinpipe.Pipeline(mine, "1f1b", process_group=group, timeout=LIMIT, transport=transport)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 3, models.HIDDEN, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 3, models.HIDDEN, generator=gen, dtype=torch.float64)

    def step():
        loss, _ = pipe.step(*((x,) if rank == 0 else ()), num_chunks=4, criterion=models.mse, labels=(y,) if rank == 1 else ())
        return None if loss is None else loss.detach().clone()

    on_time = step()
    if rank == 1:
        forward, calls = pipe.module[0].forward, [0]

        def late_forward(*args):
            calls[0] += 1
            if calls[0] == 2:
                time.sleep(LATE)
            return forward(*args)

        pipe.module[0].forward = late_forward
    else:
        time.sleep(LATE)  # rank 0 late at the start of the step instead: the step agreement waits
    late = step()
    pipe.close()
    return on_time is late is None or torch.equal(on_time, late)


def case_pipeline_shm(group):
    return _pipeline_late(group, "auto")


def case_pipeline_gloo(group):
    return _pipeline_late(group, "process-group")


def case_expert_all_to_all(group):
    """A MoE stage's forward and backward over EP 2, rank 1 ``LATE`` s late before its second
    expert all-to-all (timeout: the limit in force)."""
    from twinpipe.moe import exchange
    from twinpipe.runtime import waits

    torch.manual_seed(11)
    stage = moe_models.sharded(moe_models.make_stage("shared"), group)
    original, calls = exchange.all_to_all, [0]

    def late_all_to_all(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2 and dist.get_rank(group) == 1:
            time.sleep(LATE)
        return original(*args, **kwargs)

    exchange.all_to_all = late_all_to_all
    try:
        x = torch.randn(4, moe_models.SEQ, moe_models.HIDDEN, dtype=torch.float64, requires_grad=True)
        with waits.limit(LIMIT):
            stage(x).sum().backward()
    finally:
        exchange.all_to_all = original
    return calls[0] >= 2 and x.grad is not None


def case_genuine_timeout(group):
    """Rank 1 arrives 1.5 s late at an all-reduce that rank 0 waits 0.5 s for: rank 0's error names the limit."""
    from twinpipe.runtime.collectives import collective

    _late(group, 1.5)
    try:
        collective(dist.all_reduce, torch.ones(1), group=group, timeout=0.5, what="all-reduce with a silent peer")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def case_group_timeout_shorter(group):
    """On a group made with a 1 s timeout, rank 1 arrives 2 s late at an all-reduce that rank 0
    may wait 30 s for: gloo gives up at 1 s, and rank 0's error says both numbers."""
    import datetime

    from twinpipe.runtime.collectives import collective

    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    _late(group, 2.0)
    try:
        collective(dist.all_reduce, torch.ones(1), group=short, timeout=LIMIT, what="all-reduce on a 1 s group")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


CASES = {name[5:]: (WORLD, fn) for name, fn in list(globals().items()) if name.startswith("case_")}


def _world(rank: int, world: int) -> dict:
    from twinpipe.runtime import waits

    waits.POLL = SLICE
    busy = _load() if rank == 0 else []
    dist.barrier()
    try:
        return run_cases(rank, world, CASES)
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait()


@pytest.fixture(scope="module")
def outcomes():
    return run_world(WORLD, _world, timeout=240)


def test_a_late_collective_is_not_a_failure(outcomes):
    assert [o["collectives_jittered"] for o in outcomes] == [[], []], outcomes
    assert [o["collectives_late"] for o in outcomes] == [[4.0, 4.0, 4.0]] * 2, outcomes


def test_a_late_sender_is_not_a_failure(outcomes):
    assert [o["gloo_send_late"] for o in outcomes] == [[1.0] * 4, None], outcomes


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_late_stage_is_not_a_failure(outcomes, transport):
    assert [o[f"pipeline_{transport}"] for o in outcomes] == [True, True], outcomes


def test_a_late_expert_all_to_all_is_not_a_failure(outcomes):
    assert [o["expert_all_to_all"] for o in outcomes] == [True, True], outcomes


def test_a_genuine_timeout_still_names_its_limit(outcomes):
    message = outcomes[0]["genuine_timeout"]
    assert message.startswith("PipelineTimeoutError: all-reduce with a silent peer: did not complete within 0.5 s"), message
    assert outcomes[1]["genuine_timeout"] == "returned", outcomes[1]


def test_a_shorter_group_timeout_is_named_with_both_numbers(outcomes):
    message = outcomes[0]["group_timeout_shorter"]
    assert message.startswith("PipelineTimeoutError: all-reduce on a 1 s group: timed out after "), message
    assert "at the process group's own timeout, 1 s" in message and "this wait's 30 s limit" in message, message
    assert outcomes[1]["group_timeout_shorter"] != "returned", outcomes[1]  # its peer gave up: it fails too
