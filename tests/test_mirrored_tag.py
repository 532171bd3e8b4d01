"""DualPipe's mirrored-copy swaps (sync_mirrored_grads/weights) use the pipeline's own p2p tag, so
a user's messages on the same process group (tag 0, gloo's default) are never paired with them:
the user's message arrives intact and the sums stay exact.

One world of two processes; each case on a fresh sub-group.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import models
from distributed import run_cases, run_world

TIMEOUT = 4.0


def _grads(rank: int, stage: int, shapes) -> list[torch.Tensor]:
    """The gradients rank ``rank`` gives its ``stage`` (any rank can make them)."""
    gen = torch.Generator().manual_seed(1000 * rank + stage)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]


def _user_message_around(group, sync) -> list[str]:
    """Rank 1 posts a user receive (tag 0) before ``sync`` and rank 0 sends it after: the
    receive must get the user's message, not the swap's; then the copies' sums are checked."""
    import twinpipe

    rank = dist.get_rank(group)
    stages = twinpipe.stages_of_rank("dualpipe", 2, rank)
    pipe = twinpipe.Pipeline([models.MLPStage().double() for _ in stages], "dualpipe", process_group=group, timeout=TIMEOUT)
    shapes = [p.shape for p in pipe.module[0].parameters()]
    for s, module in zip(pipe.stages, pipe.module):
        for p, g in zip(module.parameters(), _grads(rank, s, shapes)):
            p.grad = g.clone()
    message = torch.tensor([7, 8, 9], dtype=torch.int64)  # the swap's header has this size and dtype
    received = torch.zeros(3, dtype=torch.int64)
    pending = dist.irecv(received, src=dist.get_global_rank(group, 0), group=group, tag=0) if rank == 1 else None
    problems = []
    try:
        sync(pipe)
    except Exception as exc:  # the old tag-0 swap paired the user's receive with its header
        problems.append(f"{type(exc).__name__}: {exc}")
    if rank == 0:
        dist.isend(message, dst=dist.get_global_rank(group, 1), group=group, tag=0).wait()
    else:
        pending.wait()
        if not torch.equal(received, message):
            problems.append(f"the user's message arrived as {received.tolist()}")
    if sync.__name__ == "grads":
        for model_stage, copies in pipe._copies.items():
            want = None
            for r, s in copies:  # the sum in chain order, as documented
                g = _grads(r, s, shapes)
                want = g if want is None else [a + b for a, b in zip(want, g)]
            for r, s in copies:
                if r == rank:
                    got = [p.grad for p in pipe.module[pipe.stages.index(s)].parameters()]
                    if not all(torch.equal(a, b) for a, b in zip(got, want)):
                        problems.append(f"model stage {model_stage}: the summed gradients differ")
    return problems


def grads(pipe):
    pipe.sync_mirrored_grads()


def weights(pipe):
    pipe.sync_mirrored_weights()


CASES = {
    "user_tag0_around_sync_grads": (2, functools.partial(_user_message_around, sync=grads)),
    "user_tag0_around_sync_weights": (2, functools.partial(_user_message_around, sync=weights)),
}


@pytest.fixture(scope="module")
def out():
    return run_world(2, run_cases, CASES)


@pytest.mark.parametrize("name", CASES)
def test_user_tag0_messages_are_not_mixed_with_the_swap(out, name):
    assert [o[name] for o in out] == [[], []], [o[name] for o in out]
