"""A failure reaches every rank at once, and every wait takes the user's one limit.

A rank that raises in the middle of a step (its own exception, alive) publishes it; the ranks
waiting for it raise ``PipelinePeerFailedError`` quoting it within about a second, on both
transports, in an expert all-to-all, and when the sender rejects a longer sequence. A rank that
hangs without a word is still found by the timeout, which is the user's: the pipeline's
``timeout=`` reaches the expert all-to-alls inside a stage, ``waits.limit`` the standalone MoE
calls. Pipelines on a process group without a CPU backend share one gloo group and give it back
when closed.

One world of three processes runs every case on a fresh sub-group.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist

import models
import moe_models
from distributed import run_cases, run_world

WORLD = 3
LONG = 30.0  # the pipelines' timeout where a failure must be heard long before it
QUICK = 6.0  # seconds within which every waiting rank must have raised (~0.2-1 s when quiet)
SHORT = 2.0  # the timeout of the cases that end in it
SLACK = 6.0  # what a timeout may run over on a busy 2-core machine


def _outcome(fn):
    """Run fn; return (exception type name or 'none', message, seconds)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # the test inspects what came out
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "none", "", time.monotonic() - start


def _pipeline(group, transport, timeout=LONG, schedule="1f1b"):
    import twinpipe
    from twinpipe.schedule.registry import placement_for

    rank = dist.get_rank(group)
    placement = placement_for(schedule, dist.get_world_size(group))
    model = models.make_model(models.MLPStage, placement.num_model_stages, seed=3)
    mine = [copy.deepcopy(model[placement.model_stage(s)]) for s in placement.stages_of(rank)]
    return twinpipe.Pipeline(mine, schedule, process_group=group, timeout=timeout, transport=transport)


def _step(pipe, n=6, seq=3, seed=5):
    """A training step of ``n`` micro-batches (1F1B: rank 0 holds the inputs, the last rank the labels)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, seq, models.HIDDEN, generator=gen, dtype=torch.float64)
    y = torch.randn(2 * n, seq, models.HIDDEN, generator=gen, dtype=torch.float64)
    last = pipe.rank == pipe.num_ranks - 1
    return pipe.step(*((x,) if pipe.rank == 0 else ()), num_chunks=n, criterion=models.mse, labels=(y,) if last else ())


def _on_call(module, n, action):
    """Make ``module``'s ``n``-th forward call run ``action`` first (raise, or sleep)."""
    forward, calls = module.forward, [0]

    def wrapped(*args):
        calls[0] += 1
        if calls[0] == n:
            action()
        return forward(*args)

    module.forward = wrapped


def _boom():
    raise RuntimeError("boom: user code failed")


# ---------------------------------------------------------------- a stage raises mid-step


def _stage_raises(group, transport):
    """Rank 1's stage raises on its third forward; ranks 0 and 2 wait for it (timeout 30 s)."""
    pipe = _pipeline(group, transport)
    if pipe.rank == 1:
        _on_call(pipe.module[0], 3, _boom)
    failed = _outcome(lambda: _step(pipe))
    return failed, _outcome(lambda: _step(pipe))


def case_stage_raises_shm(group):
    return _stage_raises(group, "auto")


def case_stage_raises_gloo(group):
    return _stage_raises(group, "process-group")


def case_longer_sequence(group):
    """Layouts discovered on the first step; on the second rank 0's batch has a longer sequence:
    rank 0 refuses to send it, and rank 1, waiting for it, hears why at once."""
    pipe = _pipeline(group, "auto")
    first = _outcome(lambda: _step(pipe))
    return first, _outcome(lambda: _step(pipe, seq=4 if pipe.rank == 0 else 3))


def case_silent_rank(group):
    """Rank 1 hangs (sleeps) in its third forward: its peers raise at the timeout, naming it."""
    pipe = _pipeline(group, "auto", timeout=SHORT)
    if pipe.rank == 1:
        _on_call(pipe.module[0], 3, lambda: time.sleep(SHORT + 1.5))
    return _outcome(lambda: _step(pipe))


# ---------------------------------------------------------------- expert parallelism: PP=1 x EP=2


def _ep_pipeline(ep_group, timeout):
    """DualPipeV on one rank (both stages MoE, experts sharded over ``ep_group``): the only waits
    of a step are the EP all-to-alls."""
    import twinpipe

    rank = dist.get_rank(ep_group)
    pp_group = dist.new_group([dist.get_global_rank(ep_group, rank)], use_local_synchronization=True)
    torch.manual_seed(11)
    stages = [moe_models.sharded(moe_models.make_stage("shared"), ep_group) for _ in range(2)]
    return twinpipe.DualPipeV(stages, process_group=pp_group, timeout=timeout)


def _ep_step(pipe, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, moe_models.SEQ, moe_models.HIDDEN, generator=gen, dtype=torch.float64)
    y = torch.randn(8, moe_models.SEQ, moe_models.HIDDEN, generator=gen, dtype=torch.float64)
    return pipe.step(x, num_chunks=4, criterion=moe_models.mse, labels=(y,))


def _on_all_to_all(n, action):
    """Make this rank's ``n``-th expert all-to-all run ``action`` before it starts; undo with the result."""
    from twinpipe.moe import exchange as block  # the module whose parts call all_to_all

    original, calls = block.all_to_all, [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            action()
        return original(*args, **kwargs)

    block.all_to_all = wrapped
    return lambda: setattr(block, "all_to_all", original)


def _ep_case(group, timeout, action):
    pipe = _ep_pipeline(group, timeout)
    _ep_step(pipe, 1)  # a whole step first: layouts agreed, the EP group in use
    undo = _on_all_to_all(5, action) if dist.get_rank(group) == 1 else (lambda: None)
    try:
        return _outcome(lambda: _ep_step(pipe, 2))
    finally:
        undo()


def case_ep_rank_raises(group):
    """EP rank 1 raises inside its fifth all-to-all of a step; EP rank 0 waits in its own (timeout 30 s)."""
    return _ep_case(group, LONG, _boom)


def case_ep_rank_silent(group):
    """EP rank 1 hangs before its fifth all-to-all; EP rank 0's all-to-all waits the pipeline's 2 s
    (it waited 300 s, whatever the pipeline's timeout)."""
    return _ep_case(group, SHORT, lambda: time.sleep(SHORT + 1.5))


# ---------------------------------------------------------------- standalone EP calls: their own limit


def _alone(group, call):
    """Rank 1 never joins ``call``: rank 0's wait ends at its limit."""
    if dist.get_rank(group) == 1:
        time.sleep(SHORT + 1)
        return None
    return _outcome(call)


def case_reduce_dense_grads_timeout(group):
    from twinpipe.moe import reduce_dense_grads

    stage = moe_models.sharded(moe_models.make_stage("shared"), group)
    return _alone(group, lambda: reduce_dense_grads(stage, group, timeout=SHORT))


def case_reduce_dense_grads_limit_in_force(group):
    """No timeout=: the limit in force (waits.limit) applies, not a default of its own."""
    from twinpipe.moe import reduce_dense_grads
    from twinpipe.runtime import waits

    stage = moe_models.sharded(moe_models.make_stage("shared"), group)

    def call():
        with waits.limit(SHORT):
            reduce_dense_grads(stage, group)

    return _alone(group, call)


def case_balancer_timeout(group):
    from twinpipe.eplb import Balancer

    stage = moe_models.sharded(moe_models.make_stage("shared"), group)
    balancer = Balancer(stage, interval=1, timeout=SHORT)
    return _alone(group, balancer.step)


def case_expert_move_limit_in_force(group):
    from twinpipe.moe import apply_placement_
    from twinpipe.runtime import waits

    block = moe_models.sharded(moe_models.make_stage("shared"), group).blocks[0]

    def call():
        with waits.limit(SHORT):
            apply_placement_(block, torch.tensor([2, 3, 0, 1]))

    return _alone(group, call)


# ---------------------------------------------------------------- a process group without a CPU backend


def case_shared_gloo_group(group):
    """Pipelines on a group with no CPU backend (as an NCCL-only one) share one gloo group of the
    same ranks; the last to close gives it back; a closed pipeline's step raises."""
    from twinpipe.runtime import collectives

    ranks = dist.get_process_group_ranks(group)
    device_only = dist.new_group(ranks, backend="cuda:gloo", use_local_synchronization=True)
    before = dict(collectives._CPU_GROUPS)
    out = {}
    with _pipeline(device_only, "auto") as a, _pipeline(device_only, "auto") as b:
        pipes = [a, b] + [_pipeline(device_only, "auto") for _ in range(3)]
        made = [k for k in collectives._CPU_GROUPS if k not in before]
        out["gloo groups made"] = len(made)
        out["one group shared"] = len({id(p._agree_group) for p in pipes}) == 1 and pipes[0]._agree_group is not device_only
        out["step"] = _outcome(lambda: _step(a))[0]
        for p in pipes[2:]:
            p.close()
        out["users while two are open"] = collectives._CPU_GROUPS[made[0]][1] if made else None
    out["left after closing all"] = [k for k in collectives._CPU_GROUPS if k not in before]
    kind, msg, _ = _outcome(lambda: _step(a))
    out["closed step"] = (kind, "closed" in msg)
    a.close()  # again: nothing happens
    return out


CASES = {
    "stage_raises_shm": (3, case_stage_raises_shm),
    "stage_raises_gloo": (3, case_stage_raises_gloo),
    "longer_sequence": (3, case_longer_sequence),
    "silent_rank": (3, case_silent_rank),
    "ep_rank_raises": (2, case_ep_rank_raises),
    "ep_rank_silent": (2, case_ep_rank_silent),
    "reduce_dense_grads_timeout": (2, case_reduce_dense_grads_timeout),
    "reduce_dense_grads_limit_in_force": (2, case_reduce_dense_grads_limit_in_force),
    "balancer_timeout": (2, case_balancer_timeout),
    "expert_move_limit_in_force": (2, case_expert_move_limit_in_force),
    "shared_gloo_group": (2, case_shared_gloo_group),
}


@pytest.fixture(scope="module")
def out():
    return run_world(WORLD, run_cases, CASES)


def _result(out, name, rank):
    result = out[rank][name]
    assert not isinstance(result, str), f"rank {rank}: {result}"
    return result


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_stage_that_raises_reaches_every_rank_at_once(out, transport):
    name = f"stage_raises_{transport}"
    (kind, msg, _), _ = _result(out, name, 1)
    assert kind == "RuntimeError" and "boom" in msg, (kind, msg)
    for rank in (0, 2):
        (kind, msg, seconds), again = _result(out, name, rank)
        assert kind == "PipelinePeerFailedError", (rank, kind, msg)
        assert "global rank 1" in msg and "RuntimeError: boom: user code failed" in msg, msg
        assert seconds < QUICK, f"rank {rank} took {seconds:.1f} s (timeout {LONG:g} s): {msg}"
        assert again[0] == "PipelineBrokenError", (rank, again)


def test_a_sender_refusing_a_longer_sequence_reaches_its_receiver_at_once(out):
    first, (kind, msg, _) = _result(out, "longer_sequence", 0)
    assert first[0] == "none", first
    assert kind == "ValueError" and "receiver expects" in msg, (kind, msg)
    for rank in (1, 2):
        first, (kind, msg, seconds) = _result(out, "longer_sequence", rank)
        assert first[0] == "none", first
        assert kind == "PipelinePeerFailedError" and "global rank 0" in msg and "receiver expects" in msg, (rank, kind, msg)
        assert seconds < QUICK, f"rank {rank} took {seconds:.1f} s (timeout {LONG:g} s): {msg}"


def test_a_silent_rank_still_ends_in_the_timeout_naming_it(out):
    # Ranks 0 and 2 both wait for rank 1: each times out, or hears first of the other's timeout
    # (which names rank 1 and the limit too).
    kinds = []
    for rank in (0, 2):
        kind, msg, seconds = _result(out, "silent_rank", rank)
        assert kind in ("PipelineTimeoutError", "PipelinePeerFailedError"), (rank, kind, msg)
        assert "from/to rank 1" in msg and f"within {SHORT:g} s" in msg, (rank, msg)
        assert SHORT - 0.5 < seconds < SHORT + SLACK, (rank, seconds)
        kinds.append(kind)
    assert "PipelineTimeoutError" in kinds, kinds
    assert _result(out, "silent_rank", 1)[0] != "none"


def test_an_ep_rank_that_raises_in_an_all_to_all_reaches_its_peer_at_once(out):
    kind, msg, _ = _result(out, "ep_rank_raises", 1)
    assert kind == "RuntimeError" and "boom" in msg, (kind, msg)
    kind, msg, seconds = _result(out, "ep_rank_raises", 0)
    assert kind == "PipelinePeerFailedError" and "EP rank 0" in msg and "global rank 1" in msg and "boom" in msg, (kind, msg)
    assert seconds < QUICK, f"took {seconds:.1f} s (timeout {LONG:g} s): {msg}"


def test_the_pipeline_timeout_reaches_the_expert_all_to_alls(out):
    kind, msg, seconds = _result(out, "ep_rank_silent", 0)
    assert kind == "PipelineTimeoutError" and "all-to-all" in msg and f"within {SHORT:g} s" in msg, (kind, msg)
    assert SHORT - 0.5 < seconds < SHORT + SLACK, seconds
    assert _result(out, "ep_rank_silent", 1)[0] != "none"


@pytest.mark.parametrize("name, what", [
    ("reduce_dense_grads_timeout", "reduce_dense_grads"),
    ("reduce_dense_grads_limit_in_force", "reduce_dense_grads"),
    ("balancer_timeout", "ExpertLoads.record"),
    ("expert_move_limit_in_force", "apply_placement_"),
])
def test_standalone_ep_waits_take_the_given_limit(out, name, what):
    kind, msg, seconds = _result(out, name, 0)
    assert kind == "PipelineTimeoutError" and what in msg and f"within {SHORT:g} s" in msg, (kind, msg)
    assert SHORT - 0.5 < seconds < SHORT + SLACK, seconds


def test_pipelines_share_one_gloo_group_and_give_it_back(out):
    for rank in (0, 1):
        result = _result(out, "shared_gloo_group", rank)
        assert result == {
            "gloo groups made": 1, "one group shared": True, "step": "none", "users while two are open": 2,
            "left after closing all": [], "closed step": ("RuntimeError", True),
        }, (rank, result)
