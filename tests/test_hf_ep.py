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
from hf_models import EP_BOUND, rel
from hf_models import full_expert_grads as _full_expert_grads

pytest.importorskip("transformers")

ARCHS = ("deepseek_v3", "qwen3_moe", "mixtral")
HIDDEN, BATCH, SEQ = 16, 2, 5
BOUND = EP_BOUND  # reordered float64 sums (tests/hf_models.py says why)
BOUND32 = 1e-5  # the same for DeepSeek-V3's router, which computes in float32
PLACEMENTS = {"plain": None, "redundant": "redundant"}
# twinpipe.hf pipelines: (arch, placement) -> router auxiliary loss on (Mixtral: every layer MoE)
HF_CASES = {("deepseek_v3", "plain"): False, ("qwen3_moe", "plain"): False, ("mixtral", "plain"): True,
            ("mixtral", "redundant"): False}


def config(arch: str, layers: int = 1, implementation: str = "eager"):
    """A tiny config of ``arch``: every layer a MoE layer, top-2, the eager experts code (float64:
    transformers' default ``grouped_mm`` runs in float32 and bfloat16 only)."""
    from transformers import DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=2,
                  num_experts_per_tok=2, experts_implementation=implementation)
    if arch == "deepseek_v3":
        return DeepseekV3Config(**common, intermediate_size=32, moe_intermediate_size=8, num_key_value_heads=2,
                                n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=0,
                                q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                routed_scaling_factor=2.5, norm_topk_prob=True)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_size=32, moe_intermediate_size=8, num_key_value_heads=1, head_dim=8,
                              num_experts=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "olmoe":
        return OlmoeConfig(**common, intermediate_size=8, num_key_value_heads=1, num_experts=8, pad_token_id=1,
                           eos_token_id=2)
    return MixtralConfig(**common, intermediate_size=8, num_key_value_heads=1, num_local_experts=4)


def model(arch: str, layers: int = 1, implementation: str = "eager", dtype=torch.float64, starved: bool = False):
    """Random weights; ``starved``: DeepSeek-V3's correction bias keeps the second half of the
    experts (EP rank 1's) from being chosen."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config(arch, layers, implementation)).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
        for layer in m.model.layers:  # a non-zero correction bias: it must steer the choice only
            bias = getattr(layer.mlp.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0, 0.1)
                if starved:
                    bias[len(bias) // 2 :] = -10.0
    return m


def placement(kind, experts: int, ep: int):
    """None, or every expert once and then ep*2 - (E % ep) more slots: the first experts twice."""
    if kind is None:
        return None
    extra = 2 * ep
    return list(range(experts)) + list(range(extra))


def block_case(arch: str, kind, ep: int, group=None, implementation: str = "eager", dtype=torch.float64,
               starved: bool = False) -> list[str]:
    """The MoE block of layer 0, EP=``ep`` (``group``: gloo; None: a LocalEPGroup in this process),
    against the unsplit HF block on the batch of every EP rank."""
    from twinpipe.hf.experts import EPMoE, expert_places, shard_experts_
    from twinpipe.moe import local, reduce_dense_grads, reduce_replica_grads

    m = model(arch, implementation=implementation, dtype=dtype, starved=starved)
    block = m.model.layers[0].mlp
    experts = block.experts.gate_up_proj.shape[0]
    phy2log = placement(kind, experts, ep)
    torch.manual_seed(1)
    xs = [torch.randn(BATCH, SEQ, HIDDEN, dtype=dtype) for _ in range(ep)]
    gs = [torch.randn(BATCH, SEQ, HIDDEN, dtype=dtype) for _ in range(ep)]
    ref_block = copy.deepcopy(block)
    x = torch.cat(xs).requires_grad_()
    ref = ref_block(x)
    ref.backward(torch.cat(gs))
    _, _, ref_choice = ref_block.gate(x.detach().view(-1, HIDDEN))

    seen = {}  # rank -> (rows, slot ids) the experts code got

    def watch(r):
        return lambda module, args: seen.__setitem__(r, (args[0].detach().clone(), args[1][:, 0].clone()))

    if group is not None:
        r = dist.get_rank(group)
        ranks = [r]
        blocks = {r: shard_experts_(copy.deepcopy(block), group, phy2log)}
        blocks[r].experts.register_forward_pre_hook(watch(r))
        ins = {r: xs[r].clone().requires_grad_()}
        outs = {r: blocks[r](ins[r])}
        outs[r].backward(gs[r])
        reduce_dense_grads(blocks[r], group)
        reduce_replica_grads(blocks[r])

        def reduce(t):
            dist.all_reduce(t, group=group)
    else:
        assert phy2log is None, "simulated ranks: placements without replicas only"
        lg = local.LocalEPGroup(ep)
        ranks = list(range(ep))
        blocks = {r: EPMoE(copy.deepcopy(block), lg.rank(r), phy2log) for r in ranks}
        for r in ranks:
            blocks[r].experts.register_forward_pre_hook(watch(r))
        ins = {r: xs[r].clone().requires_grad_() for r in ranks}
        got = local.forward([blocks[r] for r in ranks], [ins[r] for r in ranks])
        outs = dict(zip(ranks, got))
        local.backward([outs[r] for r in ranks], [gs[r] for r in ranks])
        for name, p in blocks[0].named_parameters():  # the EP sums reduce_dense_grads would make
            if not name.startswith("experts."):
                total = sum(dict(blocks[r].named_parameters())[name].grad for r in ranks)
                for r in ranks:
                    dict(blocks[r].named_parameters())[name].grad = total.clone()
        holder = {}

        def reduce(t):  # sum over the simulated ranks: collect, add once all are in
            holder.setdefault("parts", []).append(t)

    # float64 arithmetic: BOUND; DeepSeek-V3's float32 router: BOUND32; float32 models: BOUND32.
    bound = BOUND if dtype == torch.float64 else BOUND32
    bitwise = ep == 1  # identical calls on identical rows: the HF block's bits
    problems = []
    tokens = BATCH * SEQ
    eager_rows = torch.nn.functional.one_hot(ref_choice, experts + 1).permute(2, 1, 0)
    for r in ranks:
        b = blocks[r]
        choice = b.gate(ins[r].detach().view(-1, HIDDEN))[2]
        if not torch.equal(choice, ref_choice[r * tokens : (r + 1) * tokens]):
            problems.append(f"rank {r}: routing differs from the unsplit block's")
        if not torch.equal(b.routed_tokens, torch.bincount(choice.reshape(-1), minlength=experts)):
            problems.append(f"rank {r}: routed_tokens {b.routed_tokens.tolist()}")
        if starved and r >= ep // 2 and b.expert_rows.any():
            problems.append(f"rank {r}: starved experts ran on rows {b.expert_rows.tolist()}")
        if kind is None and implementation == "eager":
            # Each expert's product sees the unsplit block's rows, in its order (by choice, then token).
            rows, ids = seen.get(r, (x.new_zeros(0, HIDDEN), torch.zeros(0, dtype=torch.long)))
            for i, e in enumerate(b.rows):
                _, token = torch.where(eager_rows[e])
                if not torch.equal(rows[ids == i], x.detach().view(-1, HIDDEN)[token]):
                    problems.append(f"rank {r}: expert {e} ran on other rows than in the unsplit block")
        want = ref.detach()[r * BATCH : (r + 1) * BATCH]
        if not (torch.equal(outs[r], want) if bitwise else rel(outs[r].detach(), want) <= bound):
            problems.append(f"rank {r}: output off by {rel(outs[r].detach(), want):.3g}")
        err = rel(ins[r].grad, x.grad[r * BATCH : (r + 1) * BATCH])
        if not (err == 0 if bitwise else err <= bound):
            problems.append(f"rank {r}: input gradient off by {err:.3g}")
        ref_params = dict(ref_block.named_parameters())
        for name, p in b.named_parameters():
            if name.startswith("experts."):
                continue
            err = rel(p.grad, ref_params[name].grad)
            if not (err == 0 if bitwise else err <= (BOUND32 if name == "gate.weight" and arch == "deepseek_v3" else bound)):
                problems.append(f"rank {r}: {name} gradient off by {err:.3g}")
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
        # grouped_mm orders an expert's rows by torch.sort, which is not stable: a reordered sum.
        if not (err == 0 if bitwise and implementation == "eager" else err <= bound):
            problems.append(f"experts.{name} gradient off by {err:.3g}")
    return problems


def deepcopy_case(group) -> list[str]:
    """A copy of a sharded model shares the EP group (a process group cannot be copied) and computes
    what the original computes."""
    from twinpipe.hf.experts import shard_experts_

    m = shard_experts_(model("qwen3_moe"), group)
    c = copy.deepcopy(m)
    b0, b1 = m.model.layers[0].mlp, c.model.layers[0].mlp
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    problems = [] if b1.ep_group is group else ["the copy has another EP group"]
    if b1.experts.gate_up_proj is b0.experts.gate_up_proj or not torch.equal(b0(x), b1(x)):
        problems.append("the copy shares the experts' storage or computes otherwise")
    return problems


def deepseek_features_case(group) -> list[str]:
    """DeepSeek-V3's sequence-wise balance loss and auxiliary-loss-free bias updates
    (``twinpipe.moe``) on a model sharded over EP=2, each rank its own batch: the biases move as
    the unsplit model's on both batches (loads summed over the EP group: integers, exact), losses
    within BOUND32 of the unsplit model's on the rank's batch."""
    from twinpipe.hf.experts import shard_experts_
    from twinpipe.moe.balance_loss import install_balance_loss
    from twinpipe.moe.bias import BiasBalancer

    rank = dist.get_rank(group)
    base = model("deepseek_v3", layers=2).train()
    torch.manual_seed(4)
    all_ids = [torch.randint(0, 32, (BATCH, SEQ)) for _ in range(2)]
    ref = copy.deepcopy(base)
    install_balance_loss(ref, 0.01)
    ref_bal = BiasBalancer(ref, 0.001)
    ref_losses = [ref(input_ids=i, labels=i).loss for i in all_ids]
    ref_bal.step()
    ep = shard_experts_(copy.deepcopy(base), group)
    install_balance_loss(ep, 0.01)
    bal = BiasBalancer(ep, 0.001, group=group)
    loss = ep(input_ids=all_ids[rank], labels=all_ids[rank]).loss
    loss.backward()
    bal.step()
    problems = []
    if not rel(loss.detach(), ref_losses[rank].detach()) <= BOUND32:
        problems.append(f"loss off by {rel(loss.detach(), ref_losses[rank].detach()):.3g}")
    for i, (a, b) in enumerate(zip(ep.model.layers, ref.model.layers)):
        if not torch.equal(a.mlp.gate.e_score_correction_bias, b.mlp.gate.e_score_correction_bias):
            problems.append(f"layer {i}: the bias moved otherwise")
    bal.close()
    ref_bal.close()
    return problems


# ---------------------------------------------------------------- docs/hf-ep.md's example
def docs_example() -> str:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "hf-ep.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S)[1]


def docs_case(group) -> list[str]:
    """The example on this rank (Qwen3-MoE, 2 layers, 8 experts, 12 slots), against the unsplit
    model on each rank's batch: loss and every gradient (summed over the ranks) within BOUND."""
    rank = dist.get_rank(group)
    base = model("qwen3_moe", layers=2)
    torch.manual_seed(3)
    all_ids = [torch.randint(0, 32, (BATCH, SEQ)) for _ in range(2)]
    ref = copy.deepcopy(base)
    ref_losses = [ref(input_ids=i, labels=i).loss for i in all_ids]
    sum(ref_losses).backward()
    scope = {"model": copy.deepcopy(base), "group": group, "ids": all_ids[rank]}
    exec(docs_example(), scope)
    m, problems = scope["model"], []
    if not rel(scope["loss"].detach(), ref_losses[rank].detach()) <= BOUND:
        problems.append(f"loss off by {rel(scope['loss'].detach(), ref_losses[rank].detach()):.3g}")
    want = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        if ".experts." in name:
            block = m.get_submodule(name.rsplit(".experts.", 1)[0])
            got = _full_expert_grads(block, name.rsplit(".", 1)[1], lambda t: dist.all_reduce(t, group=group))
        else:
            got = p.grad
        if not rel(got, want[name].grad) <= BOUND:
            problems.append(f"{name} gradient off by {rel(got, want[name].grad):.3g}")
    return problems


def _hidden(events) -> set:
    """The streams (F, B) of one F&B op whose comm parts were in flight while the other stream ran
    a compute part (as moe_models.interleaved, for ops where one side may have no comm)."""
    seen, flying = set(), {"F": set(), "B": set()}
    for action, stream, name, *_ in events:
        if action == "start":
            flying[stream].add(name)
        elif action == "wait":
            flying[stream].discard(name)
        elif stream in ("F", "B"):
            other = "B" if stream == "F" else "F"
            if flying[other]:
                seen.add(other)
    return seen


# ---------------------------------------------------------------- twinpipe.hf stages with EP
def hf_pipeline_case(arch: str, kind, mesh, aux: bool, schedule: str = "dualpipev", chunks: int = 4) -> list[str]:
    """``twinpipe.hf.build`` on a model whose MoE blocks are sharded (EP=2, placement ``kind``), on
    one pipeline rank, with the router auxiliary loss when ``aux``. DualPipeV (both stages on that
    rank): built with ``wrap_layer`` (the router logits through the parts' state), or, with a
    redundant placement, built plain and converted by ``part_layers_``; overlap on and off bitwise
    equal, all-to-alls hidden only when on. Another schedule: plain stages, the MoE blocks' parts
    run inside each layer.
    Each EP rank trains on its own batch: losses within BOUND of the unsplit model on the rank's
    batch, gradients of the sum over the EP ranks."""
    import hf_models

    from twinpipe import hf
    from twinpipe.hf.experts import shard_experts_
    from twinpipe.hf.moe_layer import MoEDecoderLayer, part_layers_, wrap_layer
    from twinpipe.moe import reduce_dense_grads, reduce_replica_grads

    pp_group, group = mesh["pp"].get_group(), mesh["ep"].get_group()
    rank = dist.get_rank(group)
    base = hf_models.model(arch, layers=2, aux=aux)
    experts = [m for m in base.modules() if hasattr(m, "gate_up_proj")][0].gate_up_proj.shape[0]
    ids, mask, labels = hf_models.batch(chunks, 8, seed=1 + rank)
    count = torch.tensor(hf.count_items(labels))
    ref = copy.deepcopy(base)
    ref_losses = []
    for j in range(chunks):
        out = ref(input_ids=ids[j : j + 1], attention_mask=mask[j : j + 1], labels=labels[j : j + 1], num_items_in_batch=count)
        out.loss.backward()
        ref_losses.append(out.loss.detach())
    ref_grads = {}
    for name, p in ref.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)  # the EP ranks' batches together
        ref_grads[name] = g
    problems, runs = [], {}
    parted = schedule == "dualpipev"
    for overlap in (True, False) if parted else (False,):
        m = shard_experts_(copy.deepcopy(base), group, placement(kind, experts, 2))
        converted = parted and kind is not None
        stages = hf.build(m, schedule, 1, 0, wrap_layer=wrap_layer if parted and not converted else None)
        for module in stages.modules:
            if converted:
                part_layers_(module)
            module.overlap = overlap
        if parted != any(isinstance(layer, MoEDecoderLayer) for module in stages.modules for layer in module.modules()):
            problems.append(f"MoE layers with parts: {not parted}")
        inputs, labs = stages.batch(ids, mask, labels, num_chunks=chunks)
        with stages.pipeline(pp_group, timeout=60) as pipe:
            loss, _ = pipe.step(*inputs, num_chunks=chunks, criterion=stages.criterion, labels=labs)
            stages.sync_grads(pipe)
            with torch.no_grad():  # forward only: the same losses
                again, _ = pipe.step(*inputs, num_chunks=chunks, criterion=stages.criterion, labels=labs)
            if not torch.equal(again, loss):
                problems.append(f"overlap={overlap}: forward-only losses {again.tolist()} != {loss.tolist()}")
        for module in stages.modules:
            reduce_dense_grads(module, group)
            reduce_replica_grads(module)
        grads = {}
        for module in stages.modules:
            for name, p in module.named_model_parameters():
                if ".experts." in name:
                    block = m.get_submodule(name.rsplit(".experts.", 1)[0])
                    grads[name] = _full_expert_grads(block, name.rsplit(".", 1)[1], lambda t: dist.all_reduce(t, group=group))
                else:
                    grads[name] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        runs[overlap] = (loss, grads)
        if not parted:
            break
        events = [e for module in stages.modules for e in module.fb_events]
        both = [e for e in events if {s for a, s, *_ in e if a == "start"} == {"F", "B"}]
        if not events or (arch == "mixtral" and not both):  # Mixtral: both layers MoE
            problems.append(f"overlap={overlap}: {len(events)} F&B ops, {len(both)} with comm on both sides")
        for e in events:
            # Where both micro-batches communicate, each one's all-to-alls run under the other's
            # compute (overlap on) or never (off). (With one side's stage dense, fb_order runs that
            # side's compute first: nothing to hide it under.)
            communicating = {stream for action, stream, *_ in e if action == "start"}
            if len(communicating) < 2 and overlap:
                continue
            if _hidden(e) != (communicating if overlap else set()):
                problems.append(f"overlap={overlap}: the comm of {sorted(_hidden(e))} ran under the other stream's "
                                f"compute; comm parts in {sorted(communicating)}")
                break
    loss, grads = runs[parted]
    loss_off, grads_off = runs[False]
    if not torch.equal(loss, loss_off) or any(not torch.equal(grads[n], grads_off[n]) for n in grads):
        problems.append("overlap on and off differ")
    bound = BOUND32 if arch == "deepseek_v3" else BOUND
    want = torch.stack(ref_losses)
    if not rel(loss, want) <= bound:
        problems.append(f"losses off by {rel(loss, want):.3g}")
    for name, g in grads.items():
        if not rel(g, ref_grads[name]) <= bound:
            problems.append(f"{name} gradient off by {rel(g, ref_grads[name]):.3g}")
    return problems


def aux_ep1_case(pp_group) -> list[str]:
    """The router auxiliary loss through layers in parts at EP=1 (every expert local), DualPipeV on
    one rank, overlap on and off: losses the unsplit model's bit for bit, and losses and gradients
    the bits of the same model built without expert parallelism (whose gradients test_hf_stages
    checks against the unsplit model's)."""
    import hf_models

    from twinpipe import hf
    from twinpipe.hf.experts import shard_experts_
    from twinpipe.hf.moe_layer import wrap_layer

    chunks, problems = 4, []
    ids, mask, labels = hf_models.batch(chunks, 8, seed=1)
    count = torch.tensor(hf.count_items(labels))
    for arch in ("qwen3_moe",):  # a dense layer, then a MoE one (Mixtral's aux loss: the EP=2 case)
        base = hf_models.model(arch, layers=2, aux=True)
        ref = torch.stack([base(input_ids=ids[j : j + 1], attention_mask=mask[j : j + 1], labels=labels[j : j + 1],
                                num_items_in_batch=count).loss.detach() for j in range(chunks)])
        runs = {}
        for ep, overlap in ((False, False), (True, True), (True, False)):
            m = shard_experts_(copy.deepcopy(base), None) if ep else copy.deepcopy(base)
            stages = hf.build(m, "dualpipev", 1, 0, wrap_layer=wrap_layer if ep else None)
            if ep != all(isinstance(module, hf.HFPartedStage) for module in stages.modules):
                problems.append(f"{arch}: stages {[type(module).__name__ for module in stages.modules]}")
            for module in stages.modules:
                module.overlap = overlap
            inputs, labs = stages.batch(ids, mask, labels, num_chunks=chunks)
            with stages.pipeline(pp_group, timeout=60) as pipe:
                loss, _ = pipe.step(*inputs, num_chunks=chunks, criterion=stages.criterion, labels=labs)
                stages.sync_grads(pipe)
            if ep and overlap and not any(module.fb_events for module in stages.modules):
                problems.append(f"{arch}: no F&B op overlapped the parts")
            runs[ep, overlap] = loss, {name: p.grad if p.grad is not None else torch.zeros_like(p)
                                       for module in stages.modules for name, p in module.named_model_parameters()}
        plain_loss, plain_grads = runs[False, False]
        if not torch.equal(plain_loss, ref):
            problems.append(f"{arch}: losses without EP {plain_loss.tolist()} != {ref.tolist()}")
        for overlap in (True, False):
            loss, grads = runs[True, overlap]
            if not torch.equal(loss, ref):
                problems.append(f"{arch} overlap={overlap}: losses {loss.tolist()} != {ref.tolist()}")
            differ = [n for n, g in grads.items() if not torch.equal(g, plain_grads[n])]
            if differ:
                problems.append(f"{arch} overlap={overlap}: gradients of {differ[:3]} differ from those without EP")
    return problems


def _world(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    group = dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "ep"))
    results = {}
    for arch in ARCHS:
        results[("ep1", arch)] = _guard(lambda: block_case(arch, None, 1))
        for label, kind in PLACEMENTS.items():
            results[("ep2", arch, label)] = _guard(lambda: block_case(arch, kind, 2, group))
            if rank == 0 and label == "plain":
                results[("ep4", arch, label)] = _guard(lambda: block_case(arch, kind, 4))
            if (arch, label) in HF_CASES:
                results[("hf", arch, label)] = _guard(lambda: hf_pipeline_case(arch, kind, mesh, HF_CASES[arch, label]))
                dist.barrier()
    results["hf-1f1b"] = _guard(lambda: hf_pipeline_case("qwen3_moe", None, mesh, True, "1f1b"))
    if rank == 0:
        results["aux-ep1"] = _guard(lambda: aux_ep1_case(mesh["pp"].get_group()))
    results["docs"] = _guard(lambda: docs_case(group))
    results["deepcopy"] = _guard(lambda: deepcopy_case(group))
    results["deepseek-features"] = _guard(lambda: deepseek_features_case(group))
    results["starved"] = _guard(lambda: block_case("deepseek_v3", None, 2, group, starved=True))
    for ep in (1, 2, 4):  # OLMoE: its own router (softmax, top-k, no renormalisation), through the same exchange
        results[("olmoe", ep)] = _guard(lambda: block_case("olmoe", None, ep, group if ep == 2 else None))
    results["grouped_mm"] = _guard(lambda: block_case("qwen3_moe", None, 2, group, "grouped_mm", torch.float32))
    results["grouped_mm-ep1"] = _guard(lambda: block_case("mixtral", None, 1, None, "grouped_mm", torch.float32))
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


@pytest.mark.parametrize("arch,label", list(HF_CASES))
def test_hf_stages_with_ep2_under_dualpipev_overlap_on_and_off(outcomes, arch, label):
    assert [o[("hf", arch, label)] for o in outcomes] == [[], []]


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_olmoe_block_matches_unsplit(outcomes, ep):
    assert [o[("olmoe", ep)] for o in outcomes] == [[], []]


def test_docs_example_on_two_ranks(outcomes):
    assert [o["docs"] for o in outcomes] == [[], []]


@pytest.mark.parametrize("arch", ARCHS)
def test_ep1_block_is_the_hf_block_bitwise(outcomes, arch):
    assert outcomes[0][("ep1", arch)] == []


def test_an_ep_rank_whose_experts_get_no_token(outcomes):
    assert [o["starved"] for o in outcomes] == [[], []]


def test_grouped_mm_experts_code_float32(outcomes):
    assert [o["grouped_mm"] for o in outcomes] == [[], []]
    assert outcomes[0]["grouped_mm-ep1"] == []


# ---------------------------------------------------------------- bad input (no process group)
def _raises(fn, *fragments):
    with pytest.raises(ValueError) as info:
        fn()
    missing = [f for f in fragments if f not in str(info.value)]
    assert not missing, f"the error lacks {missing}: {info.value}"


def test_bad_input_is_named():
    from twinpipe.hf.experts import EPMoE, shard_experts_
    from twinpipe.hf.layer import DecoderLayer
    from twinpipe.hf.moe_layer import MoEDecoderLayer
    from twinpipe.moe.local import LocalEPGroup

    m = model("qwen3_moe", layers=2)
    block = m.model.layers[0].mlp
    _raises(lambda: shard_experts_(torch.nn.Linear(2, 2), None), "module='Linear'", "MoE block")
    _raises(lambda: EPMoE(torch.nn.Linear(2, 2)), "block='Linear'", "gate")
    _raises(lambda: EPMoE(copy.deepcopy(block), None, [0, 1, 2, 3, 4, 5, 6, 6]), "phy2log", "no slot to experts [7]")
    _raises(lambda: EPMoE(copy.deepcopy(block), LocalEPGroup(3).rank(0)), "ep_group has 3 ranks", "8 expert slots")
    _raises(lambda: shard_experts_(copy.deepcopy(m), None, torch.arange(8).repeat(3, 1)), "phy2log", "one row per MoE block",
            "model.layers.0.mlp")
    _raises(lambda: shard_experts_(copy.deepcopy(m), None, {"model.layers.9.mlp": list(range(8))}), "phy2log",
            "'model.layers.9.mlp'")
    gated = copy.deepcopy(block)
    gated.shared_expert_gate = torch.nn.Linear(HIDDEN, 1)  # Qwen2-MoE's gated shared expert: not supported
    _raises(lambda: EPMoE(gated), "block='Qwen3MoeSparseMoeBlock'", "shared_expert_gate")
    _raises(lambda: MoEDecoderLayer(m.model.layers[1], 1), "layer=", "EPMoE")
    layer = DecoderLayer(copy.deepcopy(m.model.layers[1]), 1)
    assert not hasattr(layer, "parts")
    import hf_models

    from twinpipe import hf
    from twinpipe.hf.moe_layer import part_layers_

    stage = hf.build(hf_models.model("mixtral", layers=2, aux=True), "1f1b", 1, 0).modules[0]
    _raises(lambda: part_layers_(stage), "module='HFStage with layers [0, 1]'", "shard_experts_", "auxiliary loss")


def test_shard_experts_replaces_every_moe_block_with_per_block_placements():
    from twinpipe.hf.experts import EPMoE, expert_places, shard_experts_

    m = shard_experts_(model("qwen3_moe", layers=2), None, {"model.layers.1.mlp": [7, 6, 5, 4, 3, 2, 1, 0, 0]})
    blocks = [layer.mlp for layer in m.model.layers]
    assert all(isinstance(b, EPMoE) for b in blocks)
    assert blocks[0].rows == tuple(range(8)) and blocks[1].rows == (7, 6, 5, 4, 3, 2, 1, 0, 0)
    places = expert_places(m)
    assert places["model.layers.1.mlp.experts.gate_up_proj"].rows == (7, 6, 5, 4, 3, 2, 1, 0, 0)
    assert places["model.layers.1.mlp.experts.gate_up_proj"].name == "model.layers.1.mlp.experts.gate_up_proj"
    assert dict(m.named_parameters())["model.layers.1.mlp.experts.down_proj"].shape[0] == 9


def test_replica_gradients_under_bf16_mixed_are_summed_in_main_grad():
    """Redundant slots of a transformers MoE block with ``twinpipe.train.precision``'s FP32
    ``main_grad`` (bf16-mixed): ``reduce_replica_grads`` sums each replicated expert's rows where the
    gradients accumulate (``grad_of``), in FP32, and gives every replica the sum; ``.grad`` stays empty."""
    from twinpipe.hf.experts import shard_experts_
    from twinpipe.moe import reduce_replica_grads
    from twinpipe.train import precision

    block = shard_experts_(model("mixtral", dtype=torch.float32).model.layers[0].mlp, None, [0, 1, 2, 3, 0, 1])
    precision.to_compute([block])
    torch.manual_seed(2)
    block(torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16)).float().sum().backward()
    fused = [block.experts.gate_up_proj, block.experts.down_proj]
    before = [p.main_grad.clone() for p in fused]
    reduce_replica_grads(block)
    for p, g in zip(fused, before):
        assert p.grad is None
        for a, b in ((0, 4), (1, 5)):
            assert g[a].abs().sum() > 0 and g[b].abs().sum() > 0  # both replicas ran on some rows
            assert torch.equal(p.main_grad[a], g[a] + g[b]) and torch.equal(p.main_grad[b], g[a] + g[b])


def test_a_copy_shares_the_ep_group(outcomes):
    assert [o["deepcopy"] for o in outcomes] == [[], []]


def test_a_model_built_on_meta_shards_then_takes_its_rows():
    """Build on the meta device, shard, allocate, copy in each local tensor's Place: the block
    computes what one sharded from real weights computes, its counters at zero."""
    from transformers import AutoModelForCausalLM

    from twinpipe.hf.experts import EPMoE, expert_places, shard_experts_

    phy2log = list(range(8)) + [0, 1, 2, 3]
    real = model("deepseek_v3")
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config("deepseek_v3")).double()
    shard_experts_(m, None, phy2log)
    m.to_empty(device="cpu")
    full, places = real.state_dict(), expert_places(m)
    with torch.no_grad():
        for name, t in m.state_dict(keep_vars=True).items():
            t.copy_(full[name][list(places[name].rows)] if name in places else full[name])
    block = m.model.layers[0].mlp
    assert not block.routed_tokens.any() and not block.expert_rows.any()
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    assert torch.equal(block(x), EPMoE(real.model.layers[0].mlp, None, phy2log)(x))


def test_mixtral_router_jitter_in_training_draws_as_the_hf_block():
    """EP=1, training, jitter on: the same draw on the same tokens, so the HF block's bits."""
    from twinpipe.hf.experts import EPMoE

    m = model("mixtral")
    block = m.model.layers[0].mlp
    block.jitter_noise = 0.1
    ep = EPMoE(copy.deepcopy(block)).train()
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    torch.manual_seed(5)
    want = block.train()(x.clone())
    torch.manual_seed(5)
    got = ep(x.clone())
    assert torch.equal(got, want)
    torch.manual_seed(6)
    assert not torch.equal(ep(x.clone()), want)  # the jitter is drawn


def test_aux_loss_through_parted_layers_at_ep1_is_the_plain_stages_bitwise(outcomes):
    assert outcomes[0]["aux-ep1"] == []


def test_hf_stages_with_ep2_under_1f1b_plain_stages_and_aux_loss(outcomes):
    assert [o["hf-1f1b"] for o in outcomes] == [[], []]


def test_an_eplb_placement_table_places_each_block():
    """twinpipe.eplb.rebalance_experts' [layers, R] output, one row per MoE block, on 2 EP ranks."""
    from twinpipe.eplb import rebalance_experts
    from twinpipe.hf.experts import shard_experts_
    from twinpipe.moe.local import LocalEPGroup

    loads = torch.tensor([[90, 10, 5, 5, 40, 20, 10, 20], [5, 5, 5, 100, 10, 10, 60, 5]], dtype=torch.float)
    phy2log, _, _ = rebalance_experts(loads, 12, 4, 1, 2)
    m = shard_experts_(model("qwen3_moe", layers=2), LocalEPGroup(2).rank(1), phy2log)
    for layer, row in zip(m.model.layers, phy2log):
        assert layer.mlp.rows == tuple(row[6:].tolist()) and torch.equal(layer.mlp.phy2log, row)


def test_deepseek_v3_balance_loss_and_bias_updates_with_ep2(outcomes):
    assert [o["deepseek-features"] for o in outcomes] == [[], []]


def test_deepseek_v3_training_features_at_ep1_are_the_hf_models_bitwise():
    """The balance loss and the bias update on a model sharded with EP=1: loss, every gradient,
    the loads and the moved biases are the unsplit model's bit for bit (the router is called as
    the HF block calls it, with the [B, S, H] hidden states the balance loss needs)."""
    from twinpipe.hf.experts import shard_experts_
    from twinpipe.moe.balance_loss import install_balance_loss
    from twinpipe.moe.bias import BiasBalancer

    base = model("deepseek_v3", layers=2).train()
    ids = torch.randint(0, 32, (BATCH, SEQ))
    runs = []
    for m in (base, shard_experts_(copy.deepcopy(base), None)):
        install_balance_loss(m, 0.01)
        balancer = BiasBalancer(m, 0.001)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        loads = balancer.step()
        runs.append((loss, {n: p.grad for n, p in m.named_parameters()}, loads,
                     [layer.mlp.gate.e_score_correction_bias.clone() for layer in m.model.layers]))
    (loss, grads, loads, bias), (loss1, grads1, loads1, bias1) = runs
    assert torch.equal(loss, loss1) and all(torch.equal(grads[n], grads1[n]) for n in grads)
    assert all(torch.equal(a, b) for a, b in zip(loads, loads1)) and all(torch.equal(a, b) for a, b in zip(bias, bias1))
