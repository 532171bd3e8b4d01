"""``Pipeline.step(on_grads_ready=...)``: once per local stage, right after the stage's last
gradient-writing op, for every registered schedule.

At the call the stage's gradients already equal the step's final ones bitwise (not too early), and
the call falls between the end of that op and the start of the rank's next op in the step's trace
(not too late). The hook changes no loss or gradient, forward-only steps never call it, and a value
that is not callable is refused. One 4-process gloo world; pipelines of 2 and 4 ranks.
"""

from __future__ import annotations

import pytest

from distributed import run_world
from exactness import Case
from twinpipe.schedule.registry import names

WORLD = 4


def _cases() -> list[Case]:
    cases = []
    for name in names():
        options = (("stages_per_rank", 2),) if name == "interleaved-1f1b" else ()
        for p, m in ((2, 4), (4, 8)):
            cases.append(Case(name, p, m, "mlp", options))
    # B computes the weight gradients of layers that do not defer (TwoTensorStage.b); a user's F&B.
    cases += [Case("zb-h1", 2, 4, "two"), Case("zbv", 2, 4, "two"), Case("dualpipev", 2, 6, "overlap"),
              Case("dualpipe", 4, 8, "overlap"), Case("interleaved-1f1b", 2, 6, "two", (("stages_per_rank", 3),))]
    return cases


CASES = _cases()


def _expected_last(ops) -> dict[int, int]:
    """Stage -> index of its last op writing weight gradients (B, W, BW, or the BW half of an F&B)."""
    last = {}
    for i, op in enumerate(ops):
        kind = op.kind.value
        if kind == "FB":
            last[op.backward.stage] = i
        elif kind in ("B", "W", "BW"):
            last[op.stage] = i
    return last


def _run_case(rank: int, group, case: Case) -> list[str]:
    import copy
    import time

    import torch

    import models
    import twinpipe
    from exactness import KINDS, _data
    from twinpipe.schedule.registry import placement_for

    options = dict(case.options)
    placement = placement_for(case.schedule, case.ranks, **options)
    model = models.make_model(KINDS[case.model], placement.num_model_stages, seed=7)
    pipe = twinpipe.Pipeline([copy.deepcopy(model[placement.model_stage(s)]) for s in placement.stages_of(rank)],
                             case.schedule, process_group=group, **options)
    criterion = models.mse2 if case.model == "two" else models.mse
    inputs, label = _data(case)
    n = case.chunks
    args, labs = (), ()
    for c, chain in enumerate(placement.chains):
        rows = torch.cat([torch.tensor_split(torch.arange(label.shape[0]), n)[j] for j in placement.microbatches_of_chain(c, n)])
        if chain[0] in pipe.stages:
            args = tuple(t[rows] for t in inputs)
        if chain[-1] in pipe.stages:
            labs = (label[rows],)

    def grads(stage):
        module = pipe.module[pipe.stages.index(stage)]
        return [None if p.grad is None else p.grad.clone() for p in module.parameters()]

    problems = []
    loss_plain, _ = pipe.step(*args, num_chunks=n, criterion=criterion, labels=labs)
    plain = {s: grads(s) for s in pipe.stages}
    pipe.zero_grad(set_to_none=True)

    calls, seen, when = [], {}, {}

    def hook(stage):
        calls.append(stage)
        seen[stage], when[stage] = grads(stage), time.perf_counter()

    loss, _ = pipe.step(*args, num_chunks=n, criterion=criterion, labels=labs, trace=True, on_grads_ready=hook)
    if sorted(calls) != sorted(pipe.stages):
        problems.append(f"called for stages {calls}, expected each of {list(pipe.stages)} once")
    if (loss is None) != (loss_plain is None) or (loss is not None and not torch.equal(loss, loss_plain)):
        problems.append("the loss differs from the same step without the hook")
    for s in pipe.stages:
        final = grads(s)
        if any(a is None or not torch.equal(a, b) for a, b in zip(plain[s], final)):
            problems.append(f"stage {s}: gradients differ from the same step without the hook")
        if s in seen and any(a is None or not torch.equal(a, b) for a, b in zip(seen[s], final)):
            problems.append(f"stage {s}: gradients at the call are not yet the step's final ones")
    ops = pipe.schedule_for(n).ops[pipe.rank]
    compute = [(start, end) for kind, _, start, end in pipe.last_trace if kind == "compute"]
    if len(compute) != len(ops):
        problems.append(f"{len(compute)} compute events in the trace for {len(ops)} ops")
    else:
        for s, i in _expected_last(ops).items():
            if s not in when:
                continue
            if when[s] < compute[i][1]:
                problems.append(f"stage {s}: called before its last gradient op {ops[i]} (#{i}) ended")
            if i + 1 < len(ops) and when[s] > compute[i + 1][0]:
                problems.append(f"stage {s}: called after op #{i + 1} ({ops[i + 1]}) began, not right after {ops[i]} (#{i})")
    calls.clear()
    with torch.no_grad():
        pipe.step(*args, num_chunks=n, criterion=criterion, labels=labs, on_grads_ready=hook)
    if calls:
        problems.append(f"a forward-only step called the hook for stages {calls}")
    if case.schedule == "zb-h1" and case.model == "mlp" and case.ranks == 2:
        try:
            pipe.step(*args, num_chunks=n, criterion=criterion, labels=labs, on_grads_ready="stage 0")
            problems.append("on_grads_ready='stage 0' was accepted")
        except ValueError as exc:
            if "on_grads_ready='stage 0'" not in str(exc):
                problems.append(f"the error does not name the argument: {exc}")
    return problems


def _world(rank: int, world: int) -> dict:
    import torch.distributed as dist

    groups = {p: dist.new_group(list(range(p))) for p in (2, 4)}
    results = {}
    for case in CASES:
        if rank < case.ranks:
            try:
                results[case.id] = _run_case(rank, groups[case.ranks], case)
            except Exception as exc:
                results[case.id] = [f"{type(exc).__name__}: {exc}"]
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def outcomes():
    return run_world(WORLD, _world, timeout=300)


def test_every_registered_schedule_is_covered():
    assert {c.schedule for c in CASES} == set(names())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_on_grads_ready(outcomes, case):
    problems = {r: outcomes[r][case.id] for r in range(case.ranks) if outcomes[r][case.id]}
    assert not problems, problems
