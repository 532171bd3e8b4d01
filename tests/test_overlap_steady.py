"""Overlapped F&B ops in the 1F1B family, exact: one training step of 1F1B, interleaved 1F1B, ZB-H1
and ZB-V with ``overlap=True`` (and ``warmup_extra``) against the same schedule without, on
twinpipe.moe stages whose F&B ops run through the part engine (all-to-alls interleaved with the
other micro-batch's compute). Losses bitwise, gradients within 1e-13, for PP=2 and PP=4, EP=1 and
EP=2, several micro-batch counts; and a tiny transformers Qwen3-MoE model whose MoE layers run in
parts (twinpipe.hf, EP=2) under overlapped ZB-H1 and interleaved 1F1B. One world of 4 gloo
processes; each case runs on the ranks it needs.
"""

from __future__ import annotations

import pytest

from distributed import run_world

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv")
# (pp, ep) meshes of the world, and micro-batch counts per pp (interleaved needs multiples of pp)
MESHES = ((2, 2), (4, 1), (2, 1))
COUNTS = {2: (2, 4, 6), 4: (4, 8)}


def _cases():
    cases = []
    for schedule in SCHEDULES:
        for pp, ep in MESHES:
            for i, m in enumerate(COUNTS[pp]):
                cases.append((schedule, pp, ep, m, i % 2))  # warmup_extra 0 and 1 in turn
    return cases


CASES = _cases()
HF_CASES = (("zb-h1", 4, 1), ("interleaved-1f1b", 4, 0))  # (schedule, micro-batches, warmup_extra) on PP=2 x EP=2


def _compare(schedule: str, pp_group, ep_group, chunks: int, warmup_extra: int) -> list[str]:
    """The step with and without overlap on this rank: what differs (empty: nothing)."""
    import copy

    import torch
    import torch.distributed as dist

    import moe_models as mm
    import twinpipe
    from exactness import TOL
    from models import grad_error
    from twinpipe.moe import reduce_replica_grads
    from twinpipe.schedule.ops import OpKind
    from twinpipe.schedule.registry import placement_for

    pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
    placement = placement_for(schedule, pp)
    torch.manual_seed(11)
    model = [mm.make_stage("grouped", uneven=True) for _ in range(placement.num_model_stages)]
    torch.manual_seed(100 + ep_rank)  # each EP rank its own tokens
    x = torch.randn(chunks * 2, mm.SEQ, mm.HIDDEN, dtype=torch.float64)
    y = torch.randn_like(x)
    chain = placement.chains[0]
    runs, problems = {}, []
    for overlap in (False, True):
        modules = [mm.sharded(model[placement.model_stage(s)], ep_group) if ep_group is not None
                   else copy.deepcopy(model[placement.model_stage(s)]) for s in placement.stages_of(pp_rank)]
        options = dict(overlap=True, warmup_extra=warmup_extra) if overlap else {}
        pipe = twinpipe.Pipeline(modules, schedule, process_group=pp_group, timeout=120, **options)
        args = (x,) if chain[0] in pipe.stages else ()
        labels = (y,) if chain[-1] in pipe.stages else ()
        loss, _ = pipe.step(*args, num_chunks=chunks, criterion=mm.mse, labels=labels)
        for module in modules:
            reduce_replica_grads(module)
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for m in modules for p in m.parameters()]
        runs[overlap] = (loss, grads)
        pairs = [op for op in pipe.schedule_for(chunks).ops[pp_rank] if op.kind is OpKind.FB]
        ran = sum(len(m.fb_events) for m in modules)
        if ran != (len(pairs) if overlap else 0):
            problems.append(f"overlap={overlap}: {ran} F&B ops ran through the part engine, the schedule has {len(pairs)}")
        if overlap and pairs and not any(mm.interleaved(events) for m in modules for events in m.fb_events):
            problems.append("no F&B op interleaved its parts")
    (loss0, grads0), (loss1, grads1) = runs[False], runs[True]
    if labels and not torch.equal(loss0, loss1):
        problems.append(f"losses {loss1.tolist()} != {loss0.tolist()} without overlap")
    for i, (g0, g1) in enumerate(zip(grads0, grads1)):
        if not grad_error(g1, g0) <= TOL:
            problems.append(f"parameter {i}: gradient error {grad_error(g1, g0):.3g} > {TOL}")
    return problems


def _compare_hf(schedule: str, pp_group, ep_group, chunks: int, warmup_extra: int) -> tuple[list[str], int]:
    """Qwen3-MoE (2 MoE layers, experts sharded over EP) cut by twinpipe.hf with its MoE layers in
    parts: one step with and without overlap, losses bitwise, gradients within 1e-13. Returns what
    differs and how many F&B ops this rank ran through the part engine."""
    import copy

    import torch
    import torch.distributed as dist

    import hf_models
    from exactness import TOL
    from models import grad_error
    from twinpipe import hf
    from twinpipe.hf.experts import shard_experts_
    from twinpipe.hf.moe_layer import MoEDecoderLayer, wrap_layer
    from twinpipe.moe import reduce_replica_grads

    pp, rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    base = hf_models.model("qwen3_moe", layers=2 * pp)
    ids, mask, labels = hf_models.batch(chunks, 8, seed=1 + dist.get_rank(ep_group))
    runs, problems, engine_ops = {}, [], 0
    for overlap in (False, True):
        options = dict(overlap=True, warmup_extra=warmup_extra) if overlap else {}
        m = shard_experts_(copy.deepcopy(base), ep_group)
        stages = hf.build(m, schedule, pp, rank, wrap_layer=wrap_layer, **options)
        inputs, labs = stages.batch(ids, mask, labels, num_chunks=chunks)
        with stages.pipeline(pp_group, timeout=120) as pipe:
            loss, _ = pipe.step(*inputs, num_chunks=chunks, criterion=stages.criterion, labels=labs)
            stages.sync_grads(pipe)
        for module in stages.modules:
            reduce_replica_grads(module)
        grads = {n: p.grad.clone() for module in stages.modules for n, p in module.named_parameters() if p.grad is not None}
        # A rank whose layers are all dense (Qwen3-MoE here: every second layer is MoE) holds plain
        # stages: its F&B ops run F then B. A rank with MoE layers in parts runs them through the engine.
        moe = any(isinstance(layer, MoEDecoderLayer) for module in stages.modules for layer in module.modules())
        ran = sum(len(module.fb_events) for module in stages.modules if hasattr(module, "fb_events"))
        pairs = [op for op in pipe.schedule_for(chunks).ops[rank] if op.kind.value == "FB"]
        if overlap and moe and pairs and not ran:
            problems.append(f"{len(pairs)} F&B ops, none through the part engine")
        engine_ops = ran if overlap else engine_ops
        runs[overlap] = (loss, grads)
    (loss0, grads0), (loss1, grads1) = runs[False], runs[True]
    if loss0 is not None and not torch.equal(loss0, loss1):  # None: this rank holds no last stage
        problems.append(f"losses {loss1.tolist()} != {loss0.tolist()} without overlap")
    if grads0.keys() != grads1.keys():
        problems.append(f"gradients of {sorted(grads0.keys() ^ grads1.keys())} in one run only")
    for name in grads0.keys() & grads1.keys():
        if not grad_error(grads1[name], grads0[name]) <= TOL:
            problems.append(f"{name}: gradient error {grad_error(grads1[name], grads0[name]):.3g} > {TOL}")
    return problems, engine_ops


def _world(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    groups = {(2, 2): (mesh["pp"].get_group(), mesh["ep"].get_group()),
              (4, 1): (dist.group.WORLD, None),
              (2, 1): (dist.new_group([0, 1]), None)}
    results = {}
    for case in CASES:
        schedule, pp, ep, m, k = case
        if rank < pp * ep:
            try:
                results[case] = _compare(schedule, *groups[pp, ep], m, k)
            except Exception as exc:  # report the case, keep the world going
                results[case] = [f"{type(exc).__name__}: {exc}"]
        dist.barrier()
    for case in HF_CASES:
        try:
            results[("hf",) + case], results[("hf-engine",) + case] = _compare_hf(case[0], *groups[2, 2], *case[1:])
        except Exception as exc:
            results[("hf",) + case], results[("hf-engine",) + case] = [f"{type(exc).__name__}: {exc}"], 0
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def outcomes():
    return run_world(4, _world, timeout=400)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}-pp{}-ep{}-m{}-k{}".format(*c))
def test_overlapped_step_equals_the_schedule_without_overlap(outcomes, case):
    """Losses bitwise, every gradient within 1e-13, each FB op run through the part engine."""
    assert {r: o[case] for r, o in enumerate(outcomes) if o.get(case)} == {}


@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: "{}-m{}-k{}".format(*c))
def test_transformers_moe_in_parts_under_overlap_equals_without(outcomes, case):
    """Losses bitwise, gradients within 1e-13; the MoE layers' F&B ops ran through the part engine."""
    pytest.importorskip("transformers")
    assert {r: o[("hf",) + case] for r, o in enumerate(outcomes) if o.get(("hf",) + case)} == {}
    assert sum(o[("hf-engine",) + case] for o in outcomes) > 0


def test_engine_with_the_store_on_leaves_weight_gradients_to_the_caller():
    """An F&B op whose backward half is a B (ZB-H1, ZB-V): called with the weight-gradient store
    on, the engine runs no W step and files nothing itself; the caller files the closures under
    its B and its W op runs them: then every gradient is F-then-BW's."""
    import copy

    import torch

    import moe_models as mm
    from exactness import TOL
    from models import grad_error
    from twinpipe.overlap import forward_backward
    from twinpipe.runtime.weight_grad import GradStore

    torch.manual_seed(1)
    stages = [mm.make_stage("grouped", blocks=2, uneven=True) for _ in range(2)]
    refs = copy.deepcopy(stages)
    x0, x1 = (torch.randn(2, mm.SEQ, mm.HIDDEN, dtype=torch.float64) for _ in range(2))
    label = torch.randn_like(x0)
    out1 = stages[1](x1.clone().requires_grad_())
    g1 = torch.randn_like(out1)
    store = GradStore()
    with store.active():
        store.enabled = True
        outputs0, loss0, events = forward_backward(stages[0], [x0], mm.mse, [label], stages[1], None, [out1], [g1])
        store.enabled = False
    assert not [e for e in events if e[1] == "W"] and store.pending() == 0 and store.cache
    assert stages[1].blocks[0].qkv.weight.grad is None  # deferred: not yet computed
    store.flush(("stage", 1))
    store.pop(("stage", 1))
    refs[0](x0)
    refs[1](x1.clone().requires_grad_()).backward(g1)
    for (name, p), q in zip(stages[1].named_parameters(), refs[1].parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert grad_error(p.grad, q.grad) <= TOL, name
    assert mm.interleaved(events)
