"""MoE blocks with expert parallelism: EP=2 (2 gloo processes) against a single-process reference
with all experts local; PP=1 x EP=2 pipelines; bad input; EP ranks whose blocks differ (every rank
raises, naming the ranks and what differs, before a collective whose sizes would differ)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import moe_models as mm
from distributed import run_world
from exactness import TOL
from models import grad_error
from twinpipe.moe import ExpertLoads, apply_placement_, reduce_dense_grads, reduce_replica_grads

LAYER_CASES = [(v, u) for v in mm.VARIANTS for u in (False, True)] + [("softmax", "starved")]
PIPE_CASES = [("dualpipev", True, "grouped", True), ("dualpipev", False, "shared", False), ("1f1b", False, "softmax", True),
              ("dualpipev", True, "shared", True, (0, 1, 2, 3, 0, 0, 1, 3))]  # redundant expert slots


def _layer_case(group, variant: str, uneven: bool) -> list[str]:
    """Two MoE blocks, EP=2: outputs bitwise, gradients within TOL, counts as the reference's."""
    rank = dist.get_rank(group)
    torch.manual_seed(3)
    full = mm.make_stage(variant, blocks=2, uneven=uneven)
    stage = mm.sharded(full, group)
    xs = [torch.randn(2, mm.SEQ, mm.HIDDEN, dtype=torch.float64) for _ in range(2)]
    labels = [torch.randn_like(x) for x in xs]
    outs = mm.reference_stages([full], xs)
    sum(mm.mse(o, y) for o, y in zip(outs, labels)).backward()
    x = xs[rank].clone().requires_grad_()
    out = stage(x)
    mm.mse(out, labels[rank]).backward()
    problems = [] if torch.equal(out, outs[rank].detach()) else ["output differs from the reference"]
    ref = dict(full.named_parameters())
    reduce_dense_grads(stage, group)
    for name, p in stage.named_parameters():
        err = grad_error(p.grad, ref[mm.reference_name(stage, name)].grad)
        if not err <= TOL:
            problems.append(f"{name}: gradient error {err:.3g}")
    rows = stage.blocks[0].expert_rows
    first = full.blocks[0]

    def picks(x):  # the reference's routing of x in the first block
        return first.router(first.norm2(first.attention(x)).reshape(-1, mm.HIDDEN))[0].reshape(-1)

    routed = sum(torch.bincount(picks(x), minlength=4) for x in xs)
    if not torch.equal(rows, routed[2 * rank : 2 * rank + 2]):
        problems.append(f"expert rows {rows.tolist()} != routed {routed.tolist()}")
    if uneven is True and (routed[-1] != 0 or routed[0] < routed.sum() // 2):
        problems.append(f"routing is not uneven: {routed.tolist()}")
    if uneven == "starved" and routed[2:].any():
        problems.append(f"rank 1's experts were routed tokens: {routed.tolist()}")
    return problems


def _errors_case(group) -> list[str]:
    with pytest.raises(ValueError, match="ep_group"):
        mm.MoEBlock(8, 2, 3, 1, 4, ep_group=group)
    stage = mm.sharded(mm.make_stage(), group)
    with pytest.raises(ValueError, match="shard_experts_"):
        stage.shard_experts_(group)
    return []


def _user_stage_case(group) -> list[str]:
    """The docs' user-declared stage on two ranks: an overlapped F&B op gives what F then BW gives."""
    from twinpipe.overlap import forward_backward

    torch.manual_seed(5)
    runs = {}
    for overlap in (True, False):
        stages = [mm.ExchangeStage(group).double() for _ in range(2)]
        for st in stages:  # same weights in both runs
            torch.manual_seed(6)
            for p in st.parameters():
                p.data.copy_(torch.randn_like(p))
        x0, x1, g1 = (torch.randn(4, 8, dtype=torch.float64) for _ in range(3))
        x1.requires_grad_()
        out1 = stages[1](x1)
        outs, _, events = forward_backward(stages[0], [x0], None, [], stages[1], None, [out1], [g1], overlap=overlap)
        runs[overlap] = (outs[0], x1.grad, [p.grad for p in stages[1].parameters()], mm.interleaved(events))
    (o1, gx1, gp1, inter1), (o2, gx2, gp2, inter2) = runs[True], runs[False]
    problems = []
    if not (torch.equal(o1, o2) and torch.equal(gx1, gx2) and all(torch.equal(a, b) for a, b in zip(gp1, gp2))):
        problems.append("overlapped F&B differs from F then BW")
    if (inter1, inter2) != (True, False):
        problems.append(f"interleaved with overlap on/off: {inter1}/{inter2}")
    return problems


# ---------------------------------------------------------------- EP ranks that differ
# One rank's block or argument differs from its peers' (a user error). Without the check before
# each EP collective, the first five abort both processes inside gloo (buffers of different
# sizes); in "move-current" rank 0 plans no transfer and returns while rank 1 waits for an expert;
# in "move-rejected" rank 0 waits for the rank that rejected its placement until the timeout.
def _raises(fn, *fragments) -> list[str]:
    """``fn()`` must raise a ValueError whose message holds every fragment."""
    try:
        fn()
    except ValueError as exc:
        missing = [f for f in fragments if f not in str(exc)]
        return [f"the error lacks {missing}: {exc}"] if missing else []
    return [f"no error; expected one naming {fragments}"]


def _placed(group, placements, variant: str = "softmax", experts: int = 4) -> mm.MoEStage:
    """A one-block stage sharded over ``group`` with this rank's entry of ``placements``."""
    return mm.sharded(mm.make_stage(variant, experts=experts), group, placements[dist.get_rank(group)])


def _forward_slots_case(group) -> list[str]:
    stage = _placed(group, [[0, 1, 2, 3], [0, 1, 2, 3, 0, 1]])
    x = torch.randn(2, mm.SEQ, mm.HIDDEN, dtype=torch.float64)
    return _raises(lambda: stage(x), "MoEBlock", "num_slots differs over the EP ranks (rank 0: 4; rank 1: 6)", "phy2log")


def _dense_grads_case(group) -> list[str]:
    stage = mm.sharded(mm.make_stage(["softmax", "shared"][dist.get_rank(group)]), group)
    return _raises(lambda: reduce_dense_grads(stage, group), "reduce_dense_grads",
                   "elements differs over the EP ranks (rank 0: 304; rank 1: 400)")


def _replica_grads_case(group) -> list[str]:
    stage = _placed(group, [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 0]])
    return _raises(lambda: reduce_replica_grads(stage), "reduce_replica_grads",
                   "phy2log differs over the EP ranks (rank 0: [[0, 1, 2, 3, 0, 1]]; rank 1: [[0, 1, 2, 3, 0, 0]])")


def _loads_case(group) -> list[str]:
    stage = mm.sharded(mm.make_stage("softmax", experts=[4, 6][dist.get_rank(group)]), group)
    return _raises(lambda: ExpertLoads(stage).record(), "num_experts differs over the EP ranks (rank 0: [4]; rank 1: [6])")


def _move_slots_case(group) -> list[str]:
    placements = [[0, 1, 2, 3], [0, 1, 2, 3, 0, 1]]
    stage = _placed(group, placements)
    new = placements[dist.get_rank(group)][::-1]  # each rank's own slot count: valid where it runs
    return _raises(lambda: apply_placement_(stage.blocks[0], new, timeout=10), "apply_placement_",
                   "num_slots differs over the EP ranks (rank 0: 4; rank 1: 6)")


def _move_current_case(group) -> list[str]:
    """Same new placement, but the ranks were built with different ones: their move plans differ."""
    stage = _placed(group, [[0, 1, 2, 3, 0, 1], [0, 1, 3, 2, 0, 1]])
    return _raises(lambda: apply_placement_(stage.blocks[0], [0, 1, 2, 3, 0, 1], timeout=10),
                   "current phy2log differs over the EP ranks (rank 0: [0, 1, 2, 3, 0, 1]; rank 1: [0, 1, 3, 2, 0, 1])")


def _move_rejected_case(group) -> list[str]:
    """Rank 1 passes a placement its block refuses: rank 0 hears why instead of waiting."""
    stage = _placed(group, [[0, 1, 2, 3, 0, 1]] * 2)
    new = [[0, 1, 2, 3, 1, 0], [0, 1, 2, 2, 1, 0]][dist.get_rank(group)]
    if dist.get_rank(group) == 1:
        return _raises(lambda: apply_placement_(stage.blocks[0], new, timeout=10), "no slot to experts [3]")
    return _raises(lambda: apply_placement_(stage.blocks[0], new, timeout=10), "EP rank 1 rejected", "no slot to experts [3]")


FAULT_CASES = {
    "forward-slots": _forward_slots_case,
    "dense-grads": _dense_grads_case,
    "replica-grads": _replica_grads_case,
    "loads": _loads_case,
    "move-slots": _move_slots_case,
    "move-current": _move_current_case,
    "move-rejected": _move_rejected_case,
}


def _world(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    group = dist.new_group([0, 1])
    results = {}
    for variant, uneven in LAYER_CASES:
        results[("layer", variant, uneven)] = _layer_case(group, variant, uneven)
    results["errors"] = _errors_case(group)
    results["user"] = _user_stage_case(group)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "ep"))
    results.update(mm.run_pipeline_cases(mesh, PIPE_CASES))
    for name, case in FAULT_CASES.items():
        results[("fault", name)] = case(group)
    return results


@pytest.fixture(scope="module")
def outcomes():
    return run_world(2, _world, timeout=300)


@pytest.mark.parametrize("variant,uneven", LAYER_CASES)
def test_ep2_layer_matches_reference(outcomes, variant, uneven):
    assert [o[("layer", variant, uneven)] for o in outcomes] == [[], []]


@pytest.mark.parametrize("case", PIPE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_pp1_ep2_pipeline_matches_reference(outcomes, case):
    assert [o[case] for o in outcomes] == [[], []]


def test_ep_errors(outcomes):
    assert [o["errors"] for o in outcomes] == [[], []]


@pytest.mark.parametrize("name", FAULT_CASES)
def test_ep_ranks_that_differ_raise_on_every_rank(outcomes, name):
    assert [o[("fault", name)] for o in outcomes] == [[], []]


@pytest.mark.parametrize("kwargs,arg", [
    (dict(top_k=5), "top_k"), (dict(score="relu"), "score"), (dict(groups=3), "groups"),
    (dict(groups=2, top_groups=3), "top_groups"), (dict(groups=4, top_groups=1, top_k=2), "top_k"),
    (dict(route_scale=0), "route_scale"),
])
def test_router_rejects_bad_arguments(kwargs, arg):
    args = dict(hidden=8, heads=2, num_experts=4, top_k=2, expert_hidden=4) | kwargs
    with pytest.raises(ValueError, match=arg):
        mm.MoEBlock(**args)


def test_heads_must_divide_hidden():
    with pytest.raises(ValueError, match="heads"):
        mm.MoEBlock(8, 3, 4, 2, 4)


def test_one_rank_block_equals_reference_bitwise():
    torch.manual_seed(0)
    stage = mm.make_stage("grouped", blocks=2, uneven=True)
    ref = copy.deepcopy(stage)
    x = torch.randn(2, mm.SEQ, mm.HIDDEN, dtype=torch.float64)
    label = torch.randn_like(x)
    out = stage(x)
    want = mm.reference_stages([ref], [x])[0]
    assert torch.equal(out, want)
    mm.mse(out, label).backward()
    mm.mse(want, label).backward()
    for (name, p), q in zip(stage.named_parameters(), ref.parameters()):
        assert grad_error(p.grad, q.grad) <= TOL, name


def test_user_declared_stage_on_two_ranks(outcomes):
    assert [o["user"] for o in outcomes] == [[], []]


@pytest.mark.parametrize("names", [("dp", "ep"), ("pp",), None])
def test_mesh_needs_pp_and_ep_dimensions(names):
    from types import SimpleNamespace

    from twinpipe.moe import pp_ep_groups

    with pytest.raises(ValueError, match="mesh has dimensions"):
        pp_ep_groups(SimpleNamespace(mesh_dim_names=names))


def test_stage_blocks_must_share_one_group():
    a, b = mm.MoEBlock(8, 2, 4, 2, 4), mm.MoEBlock(8, 2, 4, 2, 4)
    b.ep_group = object()  # as if built on another mesh
    with pytest.raises(ValueError, match="blocks"):
        mm.MoEStage([a, b])


def test_expert_counts_sum_over_forwards_and_reset():
    from twinpipe.moe import expert_counts

    torch.manual_seed(0)
    stage = mm.make_stage("softmax", blocks=2, uneven=True)
    x = torch.randn(2, mm.SEQ, mm.HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        stage(x)
        stage(x)
    counts = expert_counts(stage)
    assert set(counts) == {"layers.0", "layers.1"}
    first = counts["layers.0"]
    assert int(first["routed"].sum()) == 2 * x.shape[0] * mm.SEQ * 2  # two forwards, top-2
    assert torch.equal(first["routed"], first["expert_rows"]) and first["routed"][-1] == 0  # one rank: all local
    assert int(expert_counts(stage)["layers.0"]["routed"].sum()) == 0  # reset by the first call


# ---------------------------------------------------------------- EP ranks in one process
def test_local_ep_group_runs_the_blocks_in_lock_step():
    """Two EP ranks' blocks in one process: the written-down order's outputs bitwise; a rank
    driven alone stops with an error naming the rank it waits for, not a hang."""
    from twinpipe.moe import local

    torch.manual_seed(4)
    full = mm.make_stage("grouped", blocks=2, uneven=True)
    xs = [torch.randn(2, mm.SEQ, mm.HIDDEN, dtype=torch.float64) for _ in range(2)]
    group = local.LocalEPGroup(2)
    ranks = [mm.sharded(full, group.rank(r)) for r in range(2)]
    outs = local.forward(ranks, xs)
    want = mm.reference_stages([full], xs)
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    local.backward([o.sum() for o in outs], [torch.ones((), dtype=torch.float64)] * 2)
    assert all(p.grad is not None for r in ranks for p in r.parameters())
    alone = mm.sharded(full, local.LocalEPGroup(2).rank(0))
    with pytest.raises(RuntimeError, match=r"rank 0 waits for all-to-all #0, which rank\(s\) \[1\] have not started"):
        alone(xs[0])


def test_local_ep_group_checks_its_arguments_and_splits():
    from twinpipe.moe import local

    with pytest.raises(ValueError, match="size=0"):
        local.LocalEPGroup(0)
    with pytest.raises(ValueError, match="r=2"):
        local.LocalEPGroup(2).rank(2)
    group = local.LocalEPGroup(2)
    a = group.rank(0).all_to_all(torch.zeros(2, 3), [1, 2], [1, 1])
    group.rank(1).all_to_all(torch.zeros(2, 3), [1, 1], [1, 1])
    with pytest.raises(RuntimeError, match="rank 1 sends 1 rows to rank 0, which expects 2"):
        a.wait()


def test_replica_gradients_under_bf16_mixed_are_summed_in_main_grad():
    """Redundant expert slots with ``twinpipe.train.precision``'s FP32 ``main_grad`` (bf16-mixed):
    ``reduce_replica_grads`` sums the replicas' gradients where they accumulate (``grad_of``), in
    FP32, and gives every replica the sum; ``.grad`` stays empty."""
    from twinpipe.moe import MoEBlock
    from twinpipe.train import precision

    torch.manual_seed(0)
    block = MoEBlock(16, 2, 4, 2, 8).shard_experts_(None, [0, 1, 2, 3, 0, 1])
    precision.to_compute([block])
    block(torch.randn(2, 6, 16, dtype=torch.bfloat16)).float().sum().backward()
    before = [[p.main_grad.clone() for p in block.experts[s].parameters()] for s in range(6)]
    reduce_replica_grads(block)
    for a, b in ((0, 4), (1, 5)):
        for pa, pb, ga, gb in zip(block.experts[a].parameters(), block.experts[b].parameters(), before[a], before[b]):
            assert ga.abs().sum() > 0 and gb.abs().sum() > 0  # both replicas ran on some rows
            assert pa.grad is None and pb.grad is None
            assert torch.equal(pa.main_grad, ga + gb) and torch.equal(pb.main_grad, ga + gb)
