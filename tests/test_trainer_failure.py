"""A Trainer rank that fails between the pipeline step and the norms all-reduce: its peer, waiting
in that all-reduce, raises at once quoting the error, not at the timeout (10 s here).

Needs the Trainer to publish its failures (``twinpipe.runtime.waits.publish_failure`` in
``Trainer.step``'s failure path) and its collectives to name their group (``wait_work(...,
group)`` in ``train/grads.py``): until then it is an expected failure (strict: it fails loudly,
so the mark goes, once the Trainer is wired).
"""

from __future__ import annotations

import dataclasses
import time


from distributed import run_world

TIMEOUT = 10.0
QUICK = 6.0  # seconds within which the waiting rank must have raised (~0.2-1 s when quiet)


def _rank_fails_at_the_norms(rank, world):
    import torch

    import twinpipe.train.step_vector as step_vector_module
    from train_setup import tiny_setup
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import Trainer

    model_fn, sampler, criterion, make_opt, config = tiny_setup("1f1b")
    config = dataclasses.replace(config, timeout=TIMEOUT)
    trainer = Trainer(model_fn, sampler, criterion, make_opt, build_mesh(1, 2), config, dtype=torch.float64)
    trainer.step(0)
    if rank == 1:
        def boom(*args, **kwargs):
            raise RuntimeError("boom: the norms could not be computed")

        step_vector_module.sum_across = boom  # the step vector's all-reduce
    start = time.monotonic()
    try:
        trainer.step(1)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "none", "", time.monotonic() - start


def test_a_trainer_rank_failing_at_the_norms_reaches_its_peer_at_once():
    (kind1, msg1, _), (kind0, msg0, seconds) = run_world(2, _rank_fails_at_the_norms)[::-1]
    assert kind1 == "RuntimeError" and "boom" in msg1, (kind1, msg1)
    assert kind0 == "PipelinePeerFailedError" and "boom" in msg0 and "norms" in msg0, (kind0, msg0)
    assert seconds < QUICK, f"rank 0 took {seconds:.1f} s (timeout {TIMEOUT:g} s): {msg0}"
