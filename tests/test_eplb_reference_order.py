"""EPLB outputs, log2phy's replica order included, against a literal per-layer loop written from the rule.

The rule (DeepSeek's EPLB): a replica's rank is the number of replicas its expert already had when
the greedy replication created it (0 = the original); in hierarchical mode replication runs within
each node, and the rank travels with the replica through the packing onto GPUs. ``log2phy[l, e, k]``
is the slot of expert e's replica of rank k. The loop below shares nothing with the vectorised code
but torch's float32 arithmetic and its sort (the reference's tie order for equal loads).
"""

import struct

import pytest
import torch

from twinpipe.eplb import rebalance_experts


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _pack(loads: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    """Heaviest first onto the lightest pack with room (lowest index on ties); (pack, place in pack)."""
    n = len(loads)
    per_pack = n // num_packs
    if per_pack == 1:
        return list(range(n)), [0] * n
    order = torch.tensor(loads, dtype=torch.float32).sort(descending=True).indices.tolist()
    pack_load, count = [0.0] * num_packs, [0] * num_packs
    pack, place = [0] * n, [0] * n
    for item in order:
        p = min((q for q in range(num_packs) if count[q] < per_pack), key=pack_load.__getitem__)
        pack[item], place[item] = p, count[p]
        count[p] += 1
        pack_load[p] = _f32(pack_load[p] + loads[item])
    return pack, place


def literal_eplb(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    weight = weight.float()
    num_layers, num_experts = weight.shape
    if num_groups % num_nodes:  # global policy: one node, one group
        num_groups = num_nodes = 1
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    replicas_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_replicas // num_gpus
    group_loads = weight.view(num_layers, num_groups, group_size).sum(-1).tolist()
    phy2log = [[-1] * num_replicas for _ in range(num_layers)]
    slots_by_rank = [[{} for _ in range(num_experts)] for _ in range(num_layers)]
    for layer in range(num_layers):
        w = weight[layer].tolist()
        node_of_group, rank_in_node = _pack(group_loads[layer], num_nodes)
        for node in range(num_nodes):
            # The node's experts: its groups by their place in the node, each group's experts in order.
            groups = sorted(
                (g for g in range(num_groups) if node_of_group[g] == node), key=rank_in_node.__getitem__
            )
            assert len(groups) == groups_per_node
            experts = [g * group_size + t for g in groups for t in range(group_size)]
            # Replicate: each copy to the expert with the largest load per replica (first on ties).
            count = [1] * len(experts)
            per_replica = [w[e] for e in experts]
            replicas = [(j, 0) for j in range(len(experts))]  # (expert in node, rank)
            for _ in range(replicas_per_node - len(experts)):
                j = max(range(len(experts)), key=per_replica.__getitem__)
                replicas.append((j, count[j]))
                count[j] += 1
                per_replica[j] = _f32(w[experts[j]] / count[j])
            # Pack the replicas onto the node's GPUs; each keeps its rank.
            loads = [_f32(w[experts[j]] / count[j]) for j, _ in replicas]
            gpu, place = _pack(loads, gpus_per_node)
            for (j, rank), g, p in zip(replicas, gpu, place):
                slot = node * replicas_per_node + g * slots_per_gpu + p
                phy2log[layer][slot] = experts[j]
                slots_by_rank[layer][experts[j]][rank] = slot
    width = max(len(d) for row in slots_by_rank for d in row)
    log2phy = [[[d.get(k, -1) for k in range(width)] for d in row] for row in slots_by_rank]
    logcnt = [[len(d) for d in row] for row in slots_by_rank]
    return phy2log, log2phy, logcnt


def _loads(kind: str, layers: int, experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "lognormal":  # heavy tail: many replicas for a few experts
        return torch.randn(layers, experts, generator=gen).mul(1.5).exp() * 100
    if kind == "uniform":
        return torch.rand(layers, experts, generator=gen) * 1000
    if kind == "zipf":
        ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(layers)]) + 1
        return 1e4 / ranks.float()
    if kind == "integer":  # ties between experts too
        return torch.randint(0, 8, (layers, experts), generator=gen).float()
    raise ValueError(kind)


def _assert_same(weight, layout):
    phy2log, log2phy, logcnt = rebalance_experts(weight, *layout)
    expected = literal_eplb(weight, *layout)
    assert phy2log.tolist() == expected[0]
    assert logcnt.tolist() == expected[2]
    assert log2phy.tolist() == expected[1]
    return logcnt


@pytest.mark.parametrize("kind", ["lognormal", "integer"])
@pytest.mark.parametrize(
    "layout",
    [(128, 4, 2, 8), (96, 4, 3, 8), (256, 8, 4, 16), (192, 2, 4, 4)],
    ids=["hier-2-nodes", "global", "hier-4-nodes-many", "global-few-gpus"],
)
def test_log2phy_follows_the_creation_rank_rule(kind, layout):
    weight = _loads(kind, 4, 32, seed=len(kind) + layout[0])
    logcnt = _assert_same(weight, layout)
    if kind == "lognormal":
        assert int(logcnt.max()) >= 8  # many replicas of one expert, so many equal loads to order


@pytest.mark.parametrize("kind", ["lognormal", "uniform", "zipf"])
@pytest.mark.parametrize("layout", [(288, 8, 4, 32), (288, 8, 3, 24)], ids=["4-nodes-32-gpus", "3-nodes-24-gpus"])
def test_deepseek_v3_sizes(kind, layout):
    _assert_same(_loads(kind, 58, 256, seed=0), layout)
