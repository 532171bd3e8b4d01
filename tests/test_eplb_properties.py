"""EPLB properties on random small layouts (hypothesis), and equality with the plain per-layer greedy."""

import importlib.util
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinpipe.eplb import gpu_loads, rebalance_experts, replicas_to_move

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _load_baseline():
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_eplb.py"
    spec = importlib.util.spec_from_file_location("bench_eplb", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.baseline_rebalance


baseline_rebalance = _load_baseline()


@st.composite
def problems(draw):
    """(weight, (R, G, N, P), hierarchical, gpus_per_node) for a valid layout."""
    if draw(st.booleans()):  # hierarchical
        nodes = draw(st.integers(1, 3))
        groups = nodes * draw(st.integers(1, 3))
        experts = groups * draw(st.integers(1, 3))
        gpus = nodes * draw(st.integers(1, 3))
    else:  # global: nodes do not divide groups
        nodes = draw(st.integers(2, 3))
        groups = nodes * draw(st.integers(0, 2)) + 1
        experts = draw(st.integers(1, 12))
        gpus = draw(st.integers(1, 6))
    slots = draw(st.integers(-(-experts // gpus), -(-experts // gpus) + 2))
    layers = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["float", "int", "zero"]))
    if kind == "float":
        values = st.floats(0, 1000, allow_nan=False, width=32)
    elif kind == "int":
        values = st.integers(0, 4)  # many ties
    else:
        values = st.just(0)
    rows = draw(st.lists(st.lists(values, min_size=experts, max_size=experts), min_size=layers, max_size=layers))
    weight = torch.tensor(rows, dtype=torch.float32)
    hierarchical = groups % nodes == 0
    return weight, (gpus * slots, groups, nodes, gpus), hierarchical, gpus // nodes if hierarchical else gpus


def _check_placement(weight, layout, hierarchical, out):
    phy2log, log2phy, logcnt = out
    replicas, groups, nodes, gpus = layout
    layers, experts = weight.shape
    assert phy2log.shape == (layers, replicas) and logcnt.shape == (layers, experts)
    assert log2phy.shape == (layers, experts, int(logcnt.max()))
    assert all(t.dtype == torch.int64 for t in out)
    assert bool((logcnt >= 1).all()) and logcnt.sum(1).tolist() == [replicas] * layers
    counted = torch.zeros_like(logcnt).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    assert torch.equal(counted, logcnt)
    # log2phy: replica k of expert e sits in a slot holding e; padding -1 after logcnt entries; every slot once.
    valid = torch.arange(log2phy.size(2)) < logcnt[:, :, None]
    assert bool((log2phy[~valid] == -1).all())
    slots = log2phy.clamp(min=0)
    held = phy2log.gather(1, slots.view(layers, -1)).view_as(slots)
    assert bool((held[valid] == torch.arange(experts)[None, :, None].expand_as(held)[valid]).all())
    for layer in range(layers):
        assert sorted(log2phy[layer][valid[layer]].tolist()) == list(range(replicas))
    if hierarchical:  # every replica of a group's experts sits on one node, G/N groups per node
        node_of_slot = torch.arange(replicas) // (replicas // nodes)
        group = phy2log // (experts // groups)
        for layer in range(layers):
            pairs = set(zip(group[layer].tolist(), node_of_slot.tolist()))
            assert len(pairs) == groups


@_SETTINGS
@given(problems())
def test_placement_is_consistent_and_equals_the_plain_greedy(problem):
    weight, layout, hierarchical, _ = problem
    out = rebalance_experts(weight, *layout)
    _check_placement(weight, layout, hierarchical, out)
    ref = baseline_rebalance(weight, *layout)
    for mine, theirs in zip(out, ref):
        assert torch.equal(mine, theirs)


@_SETTINGS
@given(problems(), st.booleans())
def test_refine_never_increases_the_max_load(problem, distinct):
    weight, layout, hierarchical, gpus_per_node = problem
    if distinct and layout[0] > weight.size(1) * gpus_per_node:
        distinct = False
    greedy = rebalance_experts(weight, *layout, distinct_per_gpu=distinct)
    refined = rebalance_experts(weight, *layout, distinct_per_gpu=distinct, refine=True)
    _check_placement(weight, layout, hierarchical, refined)
    gpus = layout[3]
    before = gpu_loads(weight, greedy[0], gpus).max(1).values
    after = gpu_loads(weight, refined[0], gpus).max(1).values
    assert bool((after <= before).all()), (before, after)
    if distinct:
        per_gpu = refined[0].view(weight.size(0), gpus, -1).sort(-1).values
        assert not bool((per_gpu.diff(dim=-1) == 0).any())


@_SETTINGS
@given(problems())
def test_distinct_per_gpu_never_duplicates_or_says_why(problem):
    weight, layout, hierarchical, gpus_per_node = problem
    replicas, gpus = layout[0], layout[3]
    if replicas > weight.size(1) * gpus_per_node:  # infeasible: some GPU must hold a duplicate
        with pytest.raises(ValueError, match="distinct_per_gpu"):
            rebalance_experts(weight, *layout, distinct_per_gpu=True)
        return
    out = rebalance_experts(weight, *layout, distinct_per_gpu=True)
    _check_placement(weight, layout, hierarchical, out)
    assert bool((out[2] <= gpus_per_node).all())
    per_gpu = out[0].view(weight.size(0), gpus, -1).sort(-1).values
    assert not bool((per_gpu.diff(dim=-1) == 0).any())


@_SETTINGS
@given(problems(), st.integers(0, 2**31 - 1), st.booleans())
def test_migration_keeps_the_balance(problem, seed, distinct):
    weight, layout, hierarchical, gpus_per_node = problem
    replicas, _, nodes, gpus = layout
    if distinct and replicas > weight.size(1) * gpus_per_node:
        distinct = False
    gen = torch.Generator().manual_seed(seed)
    previous = torch.randint(0, weight.size(1), (weight.size(0), replicas), generator=gen)
    fresh = rebalance_experts(weight, *layout, distinct_per_gpu=distinct)
    aligned = rebalance_experts(weight, *layout, distinct_per_gpu=distinct, previous_phy2log=previous)
    _check_placement(weight, layout, hierarchical, aligned)
    assert torch.equal(fresh[2], aligned[2])
    assert replicas_to_move(previous, aligned[0], gpus) <= replicas_to_move(previous, fresh[0], gpus)
    before, after = gpu_loads(weight, fresh[0], gpus), gpu_loads(weight, aligned[0], gpus)
    assert bool((after.max(1).values <= before.max(1).values * (1 + 1e-6)).all())
    if hierarchical and nodes > 1:
        torch.testing.assert_close(
            before.view(len(before), nodes, -1).sum(-1).sort(1).values,
            after.view(len(after), nodes, -1).sum(-1).sort(1).values,
            rtol=1e-5,
            atol=1e-3,
        )
    if distinct:
        per_gpu = aligned[0].view(weight.size(0), gpus, -1).sort(-1).values
        assert not bool((per_gpu.diff(dim=-1) == 0).any())
