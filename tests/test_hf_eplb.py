"""EPLB in the loop for ``transformers`` MoE layers (``twinpipe.hf.experts.EPMoE``): measured loads,
the ``Balancer`` re-placing experts live (weights and Adam state) with redundant slots, on EP=2
(gloo), for a tiny Qwen3-MoE and a tiny DeepSeek-V3 (float64, random weights).

The exactness claim (docs/eplb.md): training that re-places experts live gives, bit for bit, the
losses, weights and optimizer state of a run that is rebuilt on the same placement computed offline
(from the same measured loads) and given the trained weights and optimizer state by logical expert;
the re-placed model saved as a transformers folder loads, by name, under another placement and
unsplit. One world of two processes.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist

import hf_models
from distributed import run_cases, run_world

pytest.importorskip("transformers")

EP, ROWS, SEQ, LR = 2, 2, 6, 1e-2
# Every expert once, then redundant slots (a multiple of EP): the placement a run starts with.
START = {"qwen3_moe": [0, 1, 2, 3, 0, 1], "deepseek_v3": [0, 1, 2, 3, 4, 5, 6, 7, 6, 7]}


def _model(arch: str):
    return hf_models.model(arch, layers=2)  # layer 0 dense, layer 1 MoE (both archs)


def _batch(step: int, rank: int):
    ids, mask, labels = hf_models.batch(ROWS, SEQ, seed=100 * step + rank, padded=False)
    return ids, labels


def _train_step(model, group, opt, step: int):
    """One step on this rank's rows: forward, backward, the EP gradient sums, Adam."""
    from twinpipe.moe import reduce_dense_grads, reduce_replica_grads

    opt.zero_grad(set_to_none=True)
    ids, labels = _batch(step, dist.get_rank(group))
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    reduce_dense_grads(model, group)
    reduce_replica_grads(model)
    opt.step()
    return loss.detach()


def _by_expert(block, tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` [local slots, ...] of ``block`` gathered over the EP group, one row per logical
    expert (its first replica); ValueError if two replicas of an expert differ."""
    every = [torch.empty_like(tensor) for _ in range(block.ep)]
    dist.all_gather(every, tensor.contiguous(), group=group)
    slots, phy2log = torch.cat(every), block.phy2log
    for e in range(block.num_experts):
        same = slots[phy2log == e]
        if not all(torch.equal(same[0], s) for s in same[1:]):
            raise ValueError(f"the replicas of expert {e} differ")
    return torch.stack([slots[phy2log == e][0] for e in range(block.num_experts)])


def _rebuilt(arch: str, trained, opt, group, phy2log):
    """A fresh model sharded on ``phy2log`` holding ``trained``'s weights and Adam state, the experts'
    passed by logical expert (as a checkpoint holds them): the offline run."""
    from twinpipe.hf.experts import FUSED, ep_blocks, shard_experts_

    model = shard_experts_(_model(arch), group, phy2log)
    new_opt = torch.optim.Adam(model.parameters(), lr=LR)
    old_params = dict(trained.named_parameters())
    old_blocks = dict(ep_blocks(trained))
    with torch.no_grad():
        for name, p in model.named_parameters():
            q, state = old_params[name], opt.state[old_params[name]]
            block_name, _, fused = name.rpartition(".experts.")
            if fused in FUSED:
                old, new = old_blocks[block_name], dict(ep_blocks(model))[block_name]
                mine = new.phy2log[new.first_slot : new.first_slot + new.local]
                p.copy_(_by_expert(old, q, group)[mine])
                new_opt.state[p] = {k: (_by_expert(old, v, group)[mine] if v.shape == q.shape else v.clone())
                                    for k, v in state.items()}
            else:
                p.copy_(q)
                new_opt.state[p] = {k: v.clone() for k, v in state.items()}
    return model, new_opt


def _live_equals_offline(arch: str, group) -> list[str]:
    """Three Adam steps; the Balancer re-places the experts after step 2 from the loads it measured.
    The offline run computes the placement from the routers' own choices, rebuilds on it and takes
    the weights and state: step 3's loss, the weights and the Adam state are the live run's bitwise."""
    from twinpipe.eplb import Balancer, rebalance_experts
    from twinpipe.hf.experts import ep_blocks, shard_experts_

    rank, problems = dist.get_rank(group), []
    live = shard_experts_(_model(arch), group, START[arch])
    opt = torch.optim.Adam(live.parameters(), lr=LR)
    balancer = Balancer(live, optimizer=opt, interval=2, threshold=1.0)
    offline = shard_experts_(_model(arch), group, START[arch])
    offline_opt = torch.optim.Adam(offline.parameters(), lr=LR)
    [(name, block)] = list(ep_blocks(offline))
    routed = torch.zeros(block.num_experts, dtype=torch.long)
    report = None
    for step in range(2):
        losses = [_train_step(live, group, opt, step), _train_step(offline, group, offline_opt, step)]
        if not torch.equal(*losses):
            problems.append(f"step {step}: live loss {losses[0].item()!r} != offline {losses[1].item()!r}")
        routed += block.routed_tokens  # this rank's router choices, counted by the block
        block.reset_counts()
        report = balancer.step()
    dist.all_reduce(routed, group=group)
    [measured] = balancer.loads.window_sum()
    if not torch.equal(measured, routed):
        problems.append(f"loads measured {measured.tolist()} != routed {routed.tolist()}")
    [(_, moved)] = list(ep_blocks(live))
    want = rebalance_experts(routed[None].double(), block.num_slots, 1, 1, EP, previous_phy2log=block.phy2log[None])[0][0]
    if not torch.equal(moved.phy2log, want):
        problems.append(f"live placement {moved.phy2log.tolist()} != offline {want.tolist()}")
    if report is None or report.bytes_sent == 0 or torch.equal(want, torch.tensor(START[arch])):
        problems.append(f"the rebalance moved nothing: {report}")
    if moved.rows != tuple(want[moved.first_slot : moved.first_slot + moved.local].tolist()):
        problems.append(f"rank {rank}: local slots {moved.rows} after the move")
    rebuilt, rebuilt_opt = _rebuilt(arch, offline, offline_opt, group, want)
    losses = [_train_step(live, group, opt, 2), _train_step(rebuilt, group, rebuilt_opt, 2)]
    if not torch.equal(*losses):
        problems.append(f"step 2 after the move: live loss {losses[0].item()!r} != offline {losses[1].item()!r}")
    theirs = dict(rebuilt.named_parameters())
    for pname, p in live.named_parameters():
        q = theirs[pname]
        if not torch.equal(p, q):
            problems.append(f"rank {rank} {pname}: weights differ")
        for key, value in opt.state[p].items():
            if not torch.equal(value, rebuilt_opt.state[q][key]):
                problems.append(f"rank {rank} {pname}: Adam {key} differs")
    return problems + _saved_by_name(arch, live, group)


def _saved_by_name(arch: str, model, group) -> list[str]:
    """``model`` (re-placed) written as a transformers folder (``twinpipe.hf.weights.save``, experts by
    logical name) loads into a model sharded on another placement and into the unsplit model: every
    weight, by name, is the re-placed model's."""
    import shutil
    import tempfile

    from twinpipe.hf.experts import FUSED, ep_blocks, expert_places, shard_experts_
    from twinpipe.hf.weights import Place, load_into, save

    folder = [tempfile.mkdtemp(prefix="hf-eplb-") if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(folder, src=0, group=group)
    out = f"{folder[0]}/hf"
    places = expert_places(model)
    save(out, {n: (places.get(n, Place(n)), t.detach()) for n, t in model.state_dict().items()}, model.config,
         group=group, timeout=60)
    [(name, block)] = list(ep_blocks(model))
    want = {f"{name}.experts.{n}": _by_expert(block, getattr(block.experts, n).detach(), group) for n in FUSED}
    want |= {n: t for n, t in model.state_dict().items() if n not in want}
    other = shard_experts_(_model(arch), group, START[arch])  # another placement
    unsplit = _model(arch)
    load_into(other, out, expert_places(other))
    load_into(unsplit, out)
    problems = []
    [(_, other_block)] = list(ep_blocks(other))
    for n, t in other.state_dict().items():
        got = _by_expert(other_block, t, group) if n.rpartition(".")[2] in FUSED else t
        if not torch.equal(got, want[n]):
            problems.append(f"{n}: loaded under placement {START[arch]} differs from the saved model's")
    for n, t in unsplit.state_dict().items():
        if not torch.equal(t, want[n]):
            problems.append(f"{n}: loaded into the unsplit model differs from the saved model's")
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        shutil.rmtree(folder[0])
    return problems


def _counts_case(group) -> list[str]:
    """``expert_counts`` reads an EPMoE's routed copies per expert and rows per slot, as a MoEBlock's."""
    from twinpipe.hf.experts import shard_experts_
    from twinpipe.moe import expert_counts

    model = shard_experts_(_model("qwen3_moe"), group, START["qwen3_moe"])
    ids, _ = _batch(0, dist.get_rank(group))
    model(input_ids=ids)
    [(name, counts)] = list(expert_counts(model).items())
    block = model.get_submodule(name)
    rows = torch.zeros(block.num_slots, dtype=torch.long)
    rows[counts["first_slot"] : counts["first_slot"] + block.local] = counts["expert_rows"]
    dist.all_reduce(rows, group=group)
    served = torch.zeros(block.num_experts, dtype=torch.long).index_add_(0, block.phy2log, rows)
    routed = counts["routed"].clone()
    dist.all_reduce(routed, group=group)
    problems = [] if torch.equal(served, routed) else [f"rows served per expert {served.tolist()} != routed {routed.tolist()}"]
    if int(routed.sum()) != EP * ROWS * SEQ * block.top_k or int(block.routed_tokens.sum()) != 0:
        problems.append(f"routed {routed.tolist()} (then {block.routed_tokens.tolist()} after the reset)")
    return problems


def _masters_refused_case(group) -> list[str]:
    """An optimizer over copies of the weights (FP32 masters) keeps state a move could
    not find: the Balancer and apply_placement_ refuse it on every rank, and nothing moves."""
    from twinpipe.eplb import Balancer
    from twinpipe.hf.experts import ep_blocks, shard_experts_
    from twinpipe.moe import apply_placement_

    model = shard_experts_(_model("qwen3_moe"), group, START["qwen3_moe"])
    [(_, block)] = list(ep_blocks(model))
    masters = torch.optim.Adam([p.detach().clone().requires_grad_() for p in model.parameters()])
    problems = []
    for what, call in [("Balancer", lambda: Balancer(model, optimizer=masters)),
                       ("apply_placement_", lambda: apply_placement_(block, [2, 3, 0, 1, 2, 3], masters))]:
        try:
            call()
            problems.append(f"{what}: accepted an optimizer that does not hold the experts")
        except ValueError as exc:
            if "must update the MoE block's expert parameters themselves" not in str(exc):
                problems.append(f"{what}: {exc}")
    if block.phy2log.tolist() != START["qwen3_moe"]:
        problems.append(f"moved anyway: {block.phy2log.tolist()}")
    return problems


CASES = {
    "live-equals-offline-qwen3_moe": (EP, partial(_live_equals_offline, "qwen3_moe")),
    "live-equals-offline-deepseek_v3": (EP, partial(_live_equals_offline, "deepseek_v3")),
    "counts-qwen3_moe": (EP, _counts_case),
    "masters-refused": (EP, _masters_refused_case),
}


@pytest.fixture(scope="module")
def outcomes():
    return run_world(EP, run_cases, CASES, timeout=300)


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(outcomes, name):
    assert [o[name] for o in outcomes] == [[]] * EP
