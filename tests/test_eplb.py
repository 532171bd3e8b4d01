"""EPLB: known answers, options, migration, report and input errors."""

import math

import pytest
import torch

from twinpipe.eplb import (
    EplbArgumentError,
    balance_report,
    gpu_loads,
    naive_gpu_loads,
    rebalance_experts,
    replicas_to_move,
)

README_WEIGHT = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)


# --------------------------------------------------------------------------- known answers


def test_readme_example_matches_the_published_placement():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    assert log2phy.tolist() == [
        [[12, -1], [15, 13], [11, -1], [6, -1], [7, 5], [0, 2], [1, -1], [3, -1], [4, -1], [9, -1], [8, 10], [14, -1]],
        [[13, -1], [15, 11], [8, -1], [14, -1], [9, -1], [10, 12], [2, 4], [0, -1], [6, 3], [7, -1], [1, -1], [5, -1]],
    ]
    for out in (phy2log, log2phy, logcnt):
        assert out.dtype == torch.int64


def test_readme_example_balance_report():
    phy2log, _, _ = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    report = balance_report(README_WEIGHT, phy2log, num_gpus=8, num_nodes=2)
    assert report.gpu_loads_after.tolist() == [
        [121.5, 86.5, 125, 113, 147.5, 131.5, 156, 152],
        [173, 179.5, 120.5, 172, 123, 152, 118.5, 117.5],
    ]
    assert report.gpu_after.per_layer.tolist() == pytest.approx([1.2081, 1.2422], abs=1e-4)
    node_loads = report.gpu_loads_after.view(2, 2, 4).sum(-1)
    assert node_loads.tolist() == [[446, 587], [645, 511]]
    # "Before": no copies, experts split contiguously (e * P // E): GPU 0 holds experts 0 and 1.
    assert report.gpu_loads_before[0, 0].item() == 90 + 132
    assert report.gpu_before.mean > report.gpu_after.mean
    assert report.gpu_after.worst == pytest.approx(1.2422, abs=1e-4) and report.gpu_after.worst_layer == 1


# Derived by hand; see the comments for the steps.
HAND_CASES = [
    # Global (3 groups, 2 nodes: 2 does not divide 3). Copies go to expert 0 (10/1) then 1 (6/1 > 10/2).
    # Replica loads [5,3,4,2,5,3]; packed heaviest first onto 2 GPUs of 3 slots: GPU 0 <- 0, 2, 3; GPU 1 <- 0', 1, 1'.
    ([[10, 6, 4, 2]], (6, 3, 2, 2), [[0, 2, 3, 0, 1, 1]], [[2, 2, 1, 1]], [[[0, 3], [4, 5], [1, -1], [2, -1]]]),
    # One GPU: copies to 0 (3) then 2 (2 > 1.5); slots heaviest first, ties in creation order.
    ([[3, 1, 2]], (5, 1, 1, 1), [[0, 0, 1, 2, 2]], [[2, 1, 2]], [[[0, 1], [2, -1], [3, 4]]]),
    # All-zero loads: every copy goes to the first expert; GPU 0 fills first (lowest index on ties).
    ([[0, 0, 0, 0]], (6, 1, 1, 2), [[0, 1, 2, 3, 0, 0]], [[3, 1, 1, 1]],
     [[[0, 4, 5], [1, -1, -1], [2, -1, -1], [3, -1, -1]]]),
    # All-zero, hierarchical: one group per node, the first expert of each node gets the copies.
    ([[0] * 8], (12, 2, 2, 4), [[0, 1, 2, 3, 0, 0, 4, 5, 6, 7, 4, 4]], [[3, 1, 1, 1, 3, 1, 1, 1]],
     [[[0, 4, 5], [1, -1, -1], [2, -1, -1], [3, -1, -1], [6, 10, 11], [7, -1, -1], [8, -1, -1], [9, -1, -1]]]),
    # Hierarchical, 4 one-expert groups on 2 nodes: node 0 <- groups 1, 0; node 1 <- groups 3, 2.
    # Each node copies its heavier expert; one GPU per node, slots heaviest first.
    ([[1, 4, 2, 3]], (6, 4, 2, 2), [[1, 1, 0, 2, 3, 3]], [[1, 2, 1, 2]], [[[2, -1], [0, 1], [3, -1], [4, 5]]]),
]


@pytest.mark.parametrize("weight,layout,phy2log,logcnt,log2phy", HAND_CASES)
def test_hand_derived_cases(weight, layout, phy2log, logcnt, log2phy):
    out = rebalance_experts(torch.tensor(weight), *layout)
    assert out[0].tolist() == phy2log
    assert out[2].tolist() == logcnt
    assert out[1].tolist() == log2phy


def test_layers_are_independent():
    both, _, _ = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    for layer in range(2):
        alone, _, _ = rebalance_experts(README_WEIGHT[layer : layer + 1], 16, 4, 2, 8)
        assert torch.equal(alone[0], both[layer])


def test_any_real_dtype_is_computed_in_float32():
    ref = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    for dtype in (torch.int32, torch.float16, torch.float64):
        out = rebalance_experts(README_WEIGHT.to(dtype), 16, 4, 2, 8)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


# --------------------------------------------------------------------------- options


def test_distinct_per_gpu_hand_case():
    # Global case above puts both copies of expert 1 on GPU 1. Distinct: replica 1' (load 3) finds
    # GPU 1 holding expert 1 and goes to GPU 0; expert 3 then fills GPU 1.
    phy2log, log2phy, logcnt = rebalance_experts(torch.tensor([[10, 6, 4, 2]]), 6, 3, 2, 2, distinct_per_gpu=True)
    assert phy2log.tolist() == [[0, 2, 1, 0, 1, 3]]
    assert log2phy.tolist() == [[[0, 3], [4, 2], [1, -1], [5, -1]]]
    assert logcnt.tolist() == [[2, 2, 1, 1]]


def test_distinct_caps_replicas_and_balances_better_here():
    # The reference gives expert 3 five copies of 1.0 on 4 GPUs (some GPU holds two: max 2.0).
    weight = torch.tensor([[0, 0, 0, 5, 0, 0, 0, 0]])
    plain, _, cnt = rebalance_experts(weight, 12, 2, 1, 4)
    assert cnt[0, 3] == 5 and gpu_loads(weight, plain, 4).max() == 2.0
    distinct, _, cnt = rebalance_experts(weight, 12, 2, 1, 4, distinct_per_gpu=True)
    assert cnt[0, 3] == 4 and gpu_loads(weight, distinct, 4).max() == 1.25


def test_distinct_needs_a_swap_when_every_open_gpu_holds_the_expert():
    # Expert 3 gets the copy; replica loads 4,5,7,4 | 4(e4),4(e3'), labels 0,1,2,3,4,3.
    # Heaviest first: 7->G0, 5->G1, 4(e0)->G1, 4(e3)->G0, 4(e4)->G1 (full). e3' can only go to G0, which
    # holds e3: the lightest-max swap moves e0 from G1 to G0 and puts e3' on G1.
    weight = torch.tensor([[4, 5, 7, 8, 4]])
    plain, _, _ = rebalance_experts(weight, 6, 1, 1, 2)
    assert plain.tolist() == [[2, 3, 3, 1, 0, 4]]  # without the option: e3 twice on GPU 0
    phy2log, log2phy, logcnt = rebalance_experts(weight, 6, 1, 1, 2, distinct_per_gpu=True)
    assert phy2log.tolist() == [[2, 0, 3, 1, 4, 3]]
    assert logcnt.tolist() == [[1, 1, 1, 2, 1]]
    assert log2phy[0, 3].tolist() == [2, 5]
    assert gpu_loads(weight, phy2log, 2).tolist() == [[15, 13]]


def test_distinct_infeasible_raises():
    with pytest.raises(ValueError, match=r"distinct_per_gpu.*num_replicas=16"):
        rebalance_experts(README_WEIGHT, 16, 4, 2, 2, distinct_per_gpu=True)  # 6 experts, 8 slots, 1 GPU per node


def test_refine_fixes_a_greedy_packing_by_hand():
    # No copies (R = E), 2 GPUs of 4 slots. Greedy, heaviest first to the lighter GPU (ties -> GPU 0):
    # 10->0, 9->1, 8->1, 7->0, 6->0, 5->1, 4->1 (GPU 1 full: 9+8+5+4 = 26), 1->0 (24).
    # Swapping 8 (GPU 1) with 7 (GPU 0) gives 25/25.
    weight = torch.tensor([[10.0, 9, 8, 7, 6, 5, 4, 1]])
    greedy, _, _ = rebalance_experts(weight, 8, 1, 1, 2)
    refined, _, _ = rebalance_experts(weight, 8, 1, 1, 2, refine=True)
    assert gpu_loads(weight, greedy, 2).tolist() == [[24, 26]]
    assert gpu_loads(weight, refined, 2).tolist() == [[25, 25]]
    assert greedy[0, :4].tolist() == [0, 3, 4, 7]
    assert refined[0, :4].tolist() == [0, 2, 4, 7]  # heaviest first within the GPU


def test_refine_improves_a_realistic_case():
    gen = torch.Generator().manual_seed(0)
    weight = torch.rand(8, 64, generator=gen) * 100
    for layout in ((80, 4, 2, 8), (80, 1, 1, 8)):
        greedy = balance_report(weight, rebalance_experts(weight, *layout)[0], 8, layout[2])
        refined = balance_report(weight, rebalance_experts(weight, *layout, refine=True)[0], 8, layout[2])
        assert bool((refined.gpu_after.per_layer <= greedy.gpu_after.per_layer).all())
        assert refined.gpu_after.mean < greedy.gpu_after.mean


# --------------------------------------------------------------------------- migration


def _shuffle_gpus(phy2log, num_gpus, num_nodes, seed):
    """A placement equal up to node / GPU-in-node / slot relabelling."""
    gen = torch.Generator().manual_seed(seed)
    layers, replicas = phy2log.shape
    per_node, slots = num_gpus // num_nodes, replicas // num_gpus
    out = phy2log.view(layers, num_nodes, per_node, slots).clone()
    for layer in range(layers):
        out[layer] = out[layer, torch.randperm(num_nodes, generator=gen)]
        for node in range(num_nodes):
            out[layer, node] = out[layer, node, torch.randperm(per_node, generator=gen)]
            for gpu in range(per_node):
                out[layer, node, gpu] = out[layer, node, gpu, torch.randperm(slots, generator=gen)]
    return out.view(layers, replicas)


@pytest.mark.parametrize("layout", [(16, 4, 2, 8), (16, 3, 2, 8), (24, 4, 2, 4)])
def test_migration_recovers_a_relabelled_placement(layout):
    num_gpus, num_nodes = layout[3], (layout[2] if layout[1] % layout[2] == 0 else 1)
    phy2log, _, _ = rebalance_experts(README_WEIGHT, *layout)
    previous = _shuffle_gpus(phy2log, num_gpus, num_nodes, seed=1)
    assert replicas_to_move(previous, phy2log, num_gpus) > 0
    aligned, log2phy, logcnt = rebalance_experts(README_WEIGHT, *layout, previous_phy2log=previous)
    assert torch.equal(aligned, previous)
    assert replicas_to_move(previous, aligned, num_gpus) == 0
    _check_consistent(aligned, log2phy, logcnt)


def test_migration_keeps_the_balance_and_moves_fewer_replicas():
    gen = torch.Generator().manual_seed(3)
    old_weight = torch.rand(6, 32, generator=gen) * 100
    weight = old_weight * (0.2 * torch.randn(6, 32, generator=gen)).exp()  # loads drift
    for layout in ((48, 4, 2, 8), (48, 4, 3, 8)):
        previous, _, _ = rebalance_experts(old_weight, *layout)
        fresh, _, fresh_cnt = rebalance_experts(weight, *layout)
        aligned, log2phy, logcnt = rebalance_experts(weight, *layout, previous_phy2log=previous)
        _check_consistent(aligned, log2phy, logcnt)
        assert torch.equal(logcnt, fresh_cnt)
        assert replicas_to_move(previous, aligned, 8) < replicas_to_move(previous, fresh, 8)
        loads_fresh, loads_aligned = gpu_loads(weight, fresh, 8), gpu_loads(weight, aligned, 8)
        # Same max GPU load (up to float32 summation order, slots may be reordered), so same max/mean.
        assert bool((loads_aligned.max(1).values <= loads_fresh.max(1).values * (1 + 1e-6)).all())
        torch.testing.assert_close(loads_fresh.sum(1), loads_aligned.sum(1), rtol=1e-5, atol=0)
        if layout[1] % layout[2] == 0:  # hierarchical: node loads and group locality kept too
            nodes = layout[2]
            torch.testing.assert_close(
                loads_fresh.view(6, nodes, -1).sum(-1).sort(1).values,
                loads_aligned.view(6, nodes, -1).sum(-1).sort(1).values,
                rtol=1e-6,
                atol=0,
            )
            _check_groups_stay_on_a_node(aligned, 32, *layout[1:])


def test_migration_swaps_respect_distinct_per_gpu():
    gen = torch.Generator().manual_seed(4)
    old_weight = torch.randn(4, 16, generator=gen).exp()
    weight = old_weight * (0.3 * torch.randn(4, 16, generator=gen)).exp()
    previous, _, _ = rebalance_experts(old_weight, 32, 4, 3, 4)  # global; may hold duplicates
    aligned, _, _ = rebalance_experts(weight, 32, 4, 3, 4, distinct_per_gpu=True, previous_phy2log=previous)
    per_gpu = aligned.view(4, 4, 8).sort(-1).values
    assert not bool((per_gpu.diff(dim=-1) == 0).any())


def test_migration_with_unrelated_previous_is_valid():
    previous = torch.zeros(2, 16, dtype=torch.int64)  # expert 0 everywhere
    out = rebalance_experts(README_WEIGHT, 16, 4, 2, 8, previous_phy2log=previous)
    _check_consistent(*out)


# --------------------------------------------------------------------------- report


def test_report_all_zero_loads_is_balanced():
    weight = torch.zeros(3, 8)
    phy2log, _, _ = rebalance_experts(weight, 8, 2, 2, 4)
    report = balance_report(weight, phy2log, 4, 2)
    assert report.gpu_after.per_layer.tolist() == [1.0] * 3
    assert report.gpu_before.mean == 1.0 and report.node_after.worst == 1.0


def test_report_without_nodes_and_to_dict():
    phy2log, _, _ = rebalance_experts(README_WEIGHT, 16, 3, 2, 8)
    report = balance_report(README_WEIGHT, phy2log, 8)
    assert report.node_before is None and report.node_after is None
    data = report.to_dict()
    assert data["node"] == {"before": None, "after": None}
    assert math.isclose(data["gpu"]["after"]["mean"], report.gpu_after.mean)
    assert len(data["gpu"]["before"]["per_layer"]) == 2


def test_naive_loads_split_experts_contiguously():
    weight = torch.arange(12.0)[None]
    assert naive_gpu_loads(weight, 4).tolist() == [[0 + 1 + 2, 3 + 4 + 5, 6 + 7 + 8, 9 + 10 + 11]]
    assert naive_gpu_loads(weight, 5).sum() == weight.sum()  # uneven split still places every expert


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "weight,layout,argument,fragment",
    [
        (README_WEIGHT, (15, 4, 2, 8), "num_replicas", "num_replicas=15"),
        (README_WEIGHT, (8, 4, 2, 8), "num_replicas", "num_replicas=8"),
        (README_WEIGHT, (16, 8, 2, 8), "num_groups", "num_groups=8"),
        (README_WEIGHT, (18, 4, 4, 6), "num_gpus", "num_gpus=6"),
        (README_WEIGHT, (0, 4, 2, 8), "num_replicas", "num_replicas=0"),
        (README_WEIGHT, (16, -1, 2, 8), "num_groups", "num_groups=-1"),
        (README_WEIGHT, (16, 4, 0, 8), "num_nodes", "num_nodes=0"),
        (README_WEIGHT, (16, 4, 2, 0), "num_gpus", "num_gpus=0"),
        (README_WEIGHT, (16.0, 4, 2, 8), "num_replicas", "num_replicas=16.0"),
        (README_WEIGHT, (16, True, 2, 8), "num_groups", "num_groups=True"),
        (README_WEIGHT[0], (16, 4, 2, 8), "weight", "rank 1"),
        (README_WEIGHT[None], (16, 4, 2, 8), "weight", "rank 3"),
        (torch.zeros(0, 12), (16, 4, 2, 8), "weight", "at least one layer"),
        (torch.tensor([[1.0, -2.0, 3.0, 4.0]]), (4, 1, 1, 1), "weight", "-2.0"),
        (torch.tensor([[1.0, float("nan"), 3.0, 4.0]]), (4, 1, 1, 1), "weight", "finite"),
        (torch.tensor([[1.0, float("inf"), 3.0, 4.0]]), (4, 1, 1, 1), "weight", "finite"),
        (torch.ones(1, 4, dtype=torch.complex64), (4, 1, 1, 1), "weight", "complex"),
    ],
)
def test_bad_input_names_the_argument(weight, layout, argument, fragment):
    with pytest.raises(ValueError) as info:
        rebalance_experts(weight, *layout)
    assert isinstance(info.value, EplbArgumentError) and info.value.argument == argument
    assert argument in str(info.value) and fragment in str(info.value)
    assert "allowed" in str(info.value) or "must" in str(info.value)


def test_global_mode_ignores_groups_and_nodes_constraints():
    # 3 nodes do not divide 4 groups: global, and P = 8 need not be a multiple of 3.
    phy2log, _, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 3, 8)
    assert logcnt.sum(1).tolist() == [16, 16]


@pytest.mark.parametrize(
    "previous,fragment",
    [
        (torch.zeros(2, 15, dtype=torch.int64), "shape (2, 15)"),
        (torch.full((2, 16), 12), "=12"),
        (torch.full((2, 16), -1), "=-1"),
        (torch.zeros(2, 16), "dtype torch.float32"),
    ],
)
def test_bad_previous_placement(previous, fragment):
    with pytest.raises(ValueError, match="previous_phy2log") as info:
        rebalance_experts(README_WEIGHT, 16, 4, 2, 8, previous_phy2log=previous)
    assert fragment in str(info.value)


# --------------------------------------------------------------------------- helpers


def _check_consistent(phy2log, log2phy, logcnt):
    layers, replicas = phy2log.shape
    assert torch.equal(logcnt, torch.stack([torch.bincount(row, minlength=logcnt.size(1)) for row in phy2log]))
    assert log2phy.size(2) == logcnt.max()
    for layer in range(layers):
        seen = []
        for expert in range(logcnt.size(1)):
            row = log2phy[layer, expert].tolist()
            count = logcnt[layer, expert].item()
            assert all(s >= 0 for s in row[:count]) and all(s == -1 for s in row[count:])
            assert all(phy2log[layer, s].item() == expert for s in row[:count])
            seen += row[:count]
        assert sorted(seen) == list(range(replicas))


def _check_groups_stay_on_a_node(phy2log, num_experts, num_groups, num_nodes, num_gpus):
    layers, replicas = phy2log.shape
    node_of_slot = torch.arange(replicas) // (replicas // num_nodes)
    group_size = num_experts // num_groups
    for layer in range(layers):
        nodes_of_group = {}
        for slot, expert in enumerate(phy2log[layer].tolist()):
            nodes_of_group.setdefault(expert // group_size, set()).add(int(node_of_slot[slot]))
        assert all(len(n) == 1 for n in nodes_of_group.values())


def test_report_rejects_a_mismatched_placement():
    with pytest.raises(ValueError, match="phy2log"):
        balance_report(README_WEIGHT, torch.zeros(2, 15, dtype=torch.int64), 8)


def test_import_needs_only_torch():
    import os
    import subprocess
    import sys
    from pathlib import Path

    import twinpipe

    src = str(Path(twinpipe.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    code = "import sys, twinpipe.eplb; print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'rich'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- size limits


@pytest.mark.parametrize(
    "shape,layout,options,argument,fragment",
    [
        ((1, 12), (10**8, 4, 2, 8), {}, "num_replicas", "at most 65536"),
        ((2000, 4096), (4608, 8, 3, 64), {}, "weight", "greedy work"),
        ((2000, 4096), (4096, 8, 8, 64), {"refine": True}, "refine", "swap search"),
        ((58, 256), (2048, 8, 4, 256), {"previous_phy2log": torch.zeros(58, 2048, dtype=torch.int64)},
         "previous_phy2log", "migration work"),
    ],
)
def test_absurd_sizes_fail_at_once(shape, layout, options, argument, fragment):
    with pytest.raises(EplbArgumentError) as info:
        rebalance_experts(torch.ones(shape), *layout, **options)
    assert info.value.argument == argument and fragment in str(info.value) and "allowed" in str(info.value)


def test_a_too_large_log2phy_is_refused():
    # All-zero loads: all 64 copies go to expert 0, so log2phy would be [1024, 1024, 65] (0.5 GiB).
    with pytest.raises(EplbArgumentError, match="log2phy would have 1024 x 1024 x 65") as info:
        rebalance_experts(torch.zeros(1024, 1024), 1088, 1, 1, 1)
    assert info.value.argument == "num_replicas"


def test_refine_searches_rows_in_chunks_with_the_same_result(monkeypatch):
    import twinpipe.eplb.refine as refine

    weight = torch.rand(6, 64, generator=torch.Generator().manual_seed(3)) * 100
    whole = rebalance_experts(weight, 96, 4, 3, 8, refine=True)
    monkeypatch.setattr(refine, "_MAX_PAIRS", 1)  # one row at a time
    assert all(torch.equal(a, b) for a, b in zip(rebalance_experts(weight, 96, 4, 3, 8, refine=True), whole))


def test_docs_state_the_size_limits_of_the_code():
    from pathlib import Path

    from twinpipe.eplb import limits

    doc = (Path(__file__).resolve().parents[1] / "docs" / "eplb.md").read_text()
    table = doc[doc.index("## Size limits") :]
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in table.splitlines()[:20] if "|" in line}

    def power(text):
        return 2 ** int(text.split()[0].removeprefix("2^"))

    assert int(rows["replicas per layer"].replace(",", "")) == limits.MAX_REPLICAS
    assert power(rows["greedy"]) == limits.MAX_GREEDY_WORK
    assert power(rows["`refine` swap search"]) == limits.MAX_REFINE_WORK
    assert power(rows["`previous_phy2log`"]) == limits.MAX_MIGRATION_WORK
    assert power(rows["`log2phy` entries"]) == limits.MAX_LOG2PHY_ENTRIES
