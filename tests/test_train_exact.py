"""Training on a (dp, pp) mesh against one process: 30 steps, every loss bitwise, final weights bitwise
(so within the official 1e-12).

One 4-process gloo world runs every case (PP=4 alone, PP=2 x DP=2), SGD with momentum or AdamW,
clipping active in some; DualPipe's mirrored copies are compared bitwise after every step.
"""

from __future__ import annotations

import pytest

from distributed import run_named, run_world
from train_setup import Case, tiny_setup
from twinpipe.schedule import registry

WORLD = 4
STEPS = 30
TOL = 1e-12


CASES = [
    Case("1f1b", 4, 1, "sgd"),
    Case("1f1b", 2, 2, "adamw", max_norm=0.3),
    Case("zb-h1", 4, 1, "adamw"),
    Case("zb-h1", 2, 2, "sgd"),
    Case("dualpipev", 4, 1, "sgd", max_norm=0.3),
    Case("dualpipev", 2, 2, "adamw"),
    Case("dualpipe", 4, 1, "adamw", max_norm=0.3),
    Case("dualpipe", 2, 2, "sgd"),
    Case("1f1b", 1, 4, "adamw", dp_reduce="ordered"),  # four replicas, added in order: still bitwise
    # The data-parallel reduction off the pipeline step (overlap_dp=False), and overlapped with two
    # stages per rank (buckets per stage: other buckets than the serial path's), ordered for four replicas.
    Case("zb-h1", 2, 2, "sgd", overlap_dp=False),
    Case("dualpipev", 2, 2, "adamw", overlap_dp=False),
    Case("dualpipev", 1, 4, "adamw", max_norm=0.3, dp_reduce="ordered"),
    Case("dualpipev", 1, 4, "adamw", max_norm=0.3, dp_reduce="ordered", overlap_dp=False),
]
# Every other registered schedule (Chimera and BitPipe keep two copies too): a few steps each.
CASES += [Case(name, 2, 2, "sgd", max_norm=0.3, steps=3) for name in registry.names() if name not in {c.schedule for c in CASES}]


def _setup(case: Case):
    """The case's model, data, loss, optimizer and config (the same for the pipeline and its reference)."""
    return tiny_setup(case.schedule, max_norm=case.max_norm, optimizer=case.optimizer, dp_reduce=case.dp_reduce,
                      overlap_dp=case.overlap_dp)


def _reference(case: Case) -> tuple:
    """The case's run in one process (float64): each step's result and the final parameters."""
    import torch

    from twinpipe.train.reference import ReferenceTrainer

    model_fn, sampler, criterion, make_opt, config = _setup(case)
    ref = ReferenceTrainer(model_fn, sampler, criterion, make_opt, config, case.dp, case.pp, dtype=torch.float64)
    steps = [ref.step(step) for step in range(case.steps or STEPS)]
    return steps, {k: v.detach() for k, v in ref.named_parameters().items()}


def _shared_references(rank: int, world: int) -> dict:
    """Every case's reference, case i's run by rank ``i % world`` alone, then shared with every rank (rank 0
    running each in turn left the other core idle); a failed one is its message, failing that case."""
    import torch.distributed as dist

    mine = {}
    for case in CASES[rank::world]:
        try:
            mine[case.id] = _reference(case)
        except Exception as exc:
            mine[case.id] = f"{type(exc).__name__}: {exc}"
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return {name: value for part in everyone for name, value in part.items()}


def _run_case(rank: int, case: Case, expected) -> list[str]:
    import torch

    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import Trainer
    from models import grad_error

    if isinstance(expected, str):
        raise RuntimeError(f"the reference run failed: {expected}")
    steps, final = expected
    model_fn, sampler, criterion, make_opt, config = _setup(case)
    mesh = build_mesh(case.dp, case.pp)
    trainer = Trainer(model_fn, sampler, criterion, make_opt, mesh, config, dtype=torch.float64)
    problems, clipped = [], 0
    # Where the reduction starts: inside the pipeline step, once per stage of this rank (overlap_dp
    # with one chain and replicas), else after it.
    overlapped = case.overlap_dp and len(trainer.placement.chains) == 1 and case.dp > 1
    events = _watch_reduction(trainer)
    for step in range(case.steps or STEPS):
        events.clear()
        got = trainer.step(step)
        starts = events[1 : events.index("end")]  # between the step's "begin" and "end"
        want = list(range(len(trainer.pipe.stages))) if overlapped else []
        if sorted(starts) != want:
            problems.append(f"step {step}: reduction parts started inside the pipeline step: {starts}, expected {want}")
        loss, losses, norm = steps[step]
        if not torch.equal(got.losses, losses):
            problems.append(f"step {step}: losses {got.losses.tolist()} != reference {losses.tolist()}")
        if got.loss != loss:
            problems.append(f"step {step}: mean loss {got.loss!r} != reference {loss!r}")
        if got.grad_norm != norm:
            problems.append(f"step {step}: gradient norm {got.grad_norm!r} != reference {norm!r}")
        if norm is not None and norm > case.max_norm:
            clipped += 1
        if not trainer.mirrors_equal():
            problems.append(f"step {step}: DualPipe's mirrored copies differ")
        if problems:
            break
    if case.max_norm is not None and clipped == 0:
        problems.append("clipping never acted: lower max_norm")
    for name, p, _ in trainer.held:
        err = grad_error(p.detach(), final[name])
        if not err <= TOL:
            problems.append(f"{name}: final parameter error {err:.3g} > {TOL}")
        elif not torch.equal(p.detach(), final[name]):  # the same additions in the same order: the same bits
            problems.append(f"{name}: final parameters within {TOL} but not bitwise equal")
    return problems


def _watch_reduction(trainer) -> list:
    """Record 'begin'/'end' of each pipeline step and the reducer parts started, in order."""
    events = []
    step, start = trainer.pipe.step, trainer.reducer.start

    def watched_step(*args, **kwargs):
        events.append("begin")
        try:
            return step(*args, **kwargs)
        finally:
            events.append("end")

    def watched_start(part):
        events.append(part)
        start(part)

    trainer.pipe.step, trainer.reducer.start = watched_step, watched_start
    return events


def _mirror_check(rank: int) -> list[str]:
    """The mirrored-copy comparison itself sees a one-ulp difference in one copy."""
    import torch

    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import Trainer

    model_fn, sampler, criterion, make_opt, config = tiny_setup("dualpipe")
    trainer = Trainer(model_fn, sampler, criterion, make_opt, build_mesh(1, 4), config, dtype=torch.float64)
    before = trainer.mirrors_equal()
    if rank == 1:
        with torch.no_grad():
            p = next(trainer.pipe.module[1].parameters())
            p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(2.0, dtype=p.dtype))  # one ulp up (LayerNorm weights are 1)
    after = trainer.mirrors_equal()
    return [] if (before, after) == (True, False) else [f"mirrors_equal before/after changing one copy: {before}/{after}"]


def _world(rank: int, world: int) -> dict:
    references = _shared_references(rank, world)
    cases = [(case.id, lambda case=case: _run_case(rank, case, references[case.id])) for case in CASES]
    return run_named([*cases, ("mirror_check", lambda: _mirror_check(rank))])


@pytest.fixture(scope="module")
def outcomes():
    return run_world(WORLD, _world, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_train_matches_one_process(outcomes, case):
    problems = {r: outcomes[r][case.id] for r in range(WORLD) if outcomes[r][case.id]}
    assert not problems, problems


def test_mirror_comparison_sees_one_ulp(outcomes):
    problems = {r: outcomes[r]["mirror_check"] for r in range(WORLD) if outcomes[r]["mirror_check"]}
    assert not problems, problems
