"""Runs one pipeline case against a single-process reference and lists what differs.

Losses and outputs must be bitwise equal, gradients within 1e-13 (the official metric), in
training and in forward-only mode; the live activation count must equal the simulator's peak.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

import models
from twinpipe.sim import CostModel, simulate

TOL = 1e-13


@dataclass(frozen=True)
class Case:
    schedule: str
    ranks: int
    chunks: int
    model: str = "mlp"  # mlp | overlap | two
    options: tuple = ()  # schedule options as (name, value) pairs
    transport: str = "auto"  # "auto" (shared memory between CPU ranks here) or "process-group" (gloo)

    @property
    def id(self) -> str:
        opts = "".join(f"-{k}{v}" for k, v in self.options)
        via = "" if self.transport == "auto" else f"-{self.transport}"
        return f"{self.schedule}-p{self.ranks}-n{self.chunks}-{self.model}{opts}{via}"


KINDS = {"mlp": models.MLPStage, "overlap": models.OverlapStage, "two": models.TwoTensorStage}


def _data(case: Case, batch_per_mb: int = 2):
    torch.manual_seed(1234 + case.chunks)
    n = case.chunks
    shape = (n * batch_per_mb, 3, models.HIDDEN)
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randn(shape, dtype=torch.float64)
    label = torch.randn(shape, dtype=torch.float64)
    inputs = (x, y) if case.model == "two" else (x,)
    return inputs, label


def run_case(rank: int, group, case: Case) -> list[str]:
    import twinpipe
    from twinpipe.schedule.registry import placement_for

    problems = []
    options = dict(case.options)
    placement = placement_for(case.schedule, case.ranks, **options)
    model = models.make_model(KINDS[case.model], placement.num_model_stages, seed=7)
    pipe_modules = [copy.deepcopy(model[placement.model_stage(s)]) for s in placement.stages_of(rank)]
    criterion = models.mse2 if case.model == "two" else models.mse
    inputs, label = _data(case)
    n = case.chunks
    xs = list(zip(*[torch.tensor_split(t, n) for t in inputs]))
    labels = list(torch.tensor_split(label, n))
    ref_losses, ref_outputs = models.reference(model, placement, xs, labels, criterion)

    if case.schedule == "dualpipe":
        pipe = twinpipe.DualPipe(pipe_modules, process_group=group, transport=case.transport)
    elif case.schedule == "dualpipev":
        pipe = twinpipe.DualPipeV(pipe_modules, process_group=group, transport=case.transport)
    else:
        pipe = twinpipe.Pipeline(pipe_modules, case.schedule, process_group=group, transport=case.transport, **options)

    def my_args():
        args, labs = (), ()
        for c, chain in enumerate(placement.chains):
            mbs = placement.microbatches_of_chain(c, n)
            if chain[0] in pipe.stages:
                args = tuple(torch.cat([xs[j][k] for j in mbs]) for k in range(len(inputs)))
            if chain[-1] in pipe.stages:
                labs = (torch.cat([labels[j] for j in mbs]),)
        return args, labs

    def my_chain_mbs():
        for c, chain in enumerate(placement.chains):
            if chain[-1] in pipe.stages:
                return list(placement.microbatches_of_chain(c, n))
        return None

    args, labs = my_args()
    mbs = my_chain_mbs()
    loss, outputs = pipe.step(*args, num_chunks=n, criterion=criterion, labels=labs, return_outputs=True)
    if mbs is None:
        if loss is not None or outputs is not None:
            problems.append("a rank without a last stage got a loss or outputs")
    else:
        expected = torch.stack([ref_losses[j].detach() for j in mbs])
        if not torch.equal(loss, expected):
            problems.append(f"loss {loss.tolist()} != reference {expected.tolist()}")
        out_ref = [torch.cat([ref_outputs[j][k] for j in mbs]) for k in range(len(ref_outputs[mbs[0]]))]
        got = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(got) != len(out_ref) or not all(torch.equal(a, b.detach()) for a, b in zip(got, out_ref)):
            problems.append("training outputs differ from the reference")
    # Live activation sets in the real run equal the simulator's peak (M_W = M_B: held until W).
    schedule = pipe.schedule_for(n)
    predicted = simulate(schedule, CostModel(mw=1.0)).peak_activation[rank]
    if pipe.last_peak_live != predicted:
        problems.append(f"peak live activations {pipe.last_peak_live} != simulated {predicted}")
    if len(placement.chains) > 1:  # several copies of each model stage: sum their gradients
        pipe.sync_mirrored_grads()
        problems += _copies_differ(placement, pipe, rank, group)
    for s, module in zip(placement.stages_of(rank), pipe.module):
        ref = model[placement.model_stage(s)]
        for (name, p), q in zip(module.named_parameters(), ref.parameters()):
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            err = models.grad_error(got, q.grad)
            if not err <= TOL:
                problems.append(f"stage {s} {name}: gradient error {err:.3g} > {TOL}")

    # Forward only: losses and outputs equal the reference's, under no_grad.
    with torch.no_grad():
        ref_losses, ref_outputs = models.reference(model, placement, xs, labels, criterion)
        loss, outputs = pipe.step(*args, num_chunks=n, criterion=criterion, labels=labs, return_outputs=True)
    if mbs is not None:
        expected = torch.stack([ref_losses[j] for j in mbs])
        if not torch.equal(loss, expected):
            problems.append("forward-only loss differs from the reference")
        out_ref = [torch.cat([ref_outputs[j][k] for j in mbs]) for k in range(len(ref_outputs[mbs[0]]))]
        got = outputs if isinstance(outputs, tuple) else (outputs,)
        if not all(torch.equal(a, b) for a, b in zip(got, out_ref)):
            problems.append("forward-only outputs differ from the reference")
    if case.model == "overlap" and models.OverlapStage.calls == 0 and case.chunks > 1 and _has_fb(placement, case, rank):
        problems.append("overlapped_forward_backward was never called")
    models.OverlapStage.calls = 0
    return problems


def _copies_differ(placement, pipe, rank, group) -> list[str]:
    """After sync_mirrored_grads every copy of a model stage holds the same gradient bits, on every rank."""
    digests = {}
    for s, module in zip(placement.stages_of(rank), pipe.module):
        data = b"".join(p.grad.detach().cpu().numpy().tobytes() for p in module.parameters())
        digests.setdefault(placement.model_stage(s), set()).add(hashlib.sha256(data).hexdigest())
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, digests, group=group)
    merged = {}
    for theirs in everyone:
        for k, found in theirs.items():
            merged.setdefault(k, set()).update(found)
    return [f"model stage {k}: its copies' gradients differ after sync_mirrored_grads" for k, found in sorted(merged.items()) if len(found) > 1]


def _has_fb(placement, case, rank) -> bool:
    from twinpipe.schedule.registry import build

    return any(op.kind.value == "FB" for op in build(case.schedule, case.ranks, case.chunks, **dict(case.options)).ops[rank])


def assert_case(outcomes: list[dict], case: Case) -> None:
    """Fail with every rank's problems for ``case`` (outcomes: what run_all returned per rank)."""
    problems = {r: outcomes[r][case.id] for r in range(case.ranks) if outcomes[r][case.id]}
    assert not problems, problems


def run_all(rank: int, world: int, cases: list[Case]) -> dict[str, list[str]]:
    groups = {p: dist.new_group(list(range(p))) for p in range(1, world + 1)}
    results = {}
    for case in cases:
        if rank < case.ranks:
            try:
                results[case.id] = run_case(rank, groups[case.ranks], case)
            except Exception as exc:  # report the case, keep the world going
                results[case.id] = [f"{type(exc).__name__}: {exc}"]
        dist.barrier()
    return results


