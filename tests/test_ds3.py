"""DeepSeek-V3's training features (docs/deepseek-v3.md) against one process, in one 4-process world.

- Stage-local auxiliary losses (``twinpipe.runtime.aux_loss``) under every registered schedule:
  losses bitwise, gradients <= 1e-13 against the single-process model (``exactness.run_case``).
- The MoE GPT trained with auxiliary-loss-free balancing (routing biases moved after each step by
  the loads summed over the data-parallel = expert-parallel ranks and mirrored copies), the
  sequence-wise balance loss and multi-token prediction, under dualpipev, 1f1b and dualpipe with
  PP=2 and 4, DP=2: every step's losses, gradient norm, weights, optimizer state and biases
  bitwise the reference's (``ReferenceTrainer``), every copy of a bias equal on every rank, and
  the biases really moved.
- Routing biases saved and loaded with the model (DCP) under another layout.
"""

from __future__ import annotations

import pytest

import exactness
import models
from distributed import run_named, run_world
from train_setup import gather_state, reference_state, state_differences

WORLD = 4
STEPS = 2


class AuxStage(models.MLPStage):
    """The MLP stage with a stage-local auxiliary loss on its hidden layer."""

    def forward(self, x):
        from twinpipe.runtime.aux_loss import with_aux_loss

        first, act, last = self.net
        h = first(x)
        h = with_aux_loss(h, 0.1 * h.pow(2).mean())
        return last(act(h))


exactness.KINDS["aux"] = AuxStage

AUX_CASES = [exactness.Case(name, p, m, "aux", opts) for name, p, m, opts in (
    ("gpipe", 2, 4, ()), ("1f1b", 4, 8, ()), ("interleaved-1f1b", 2, 4, (("stages_per_rank", 2),)), ("zb-h1", 4, 8, ()),
    ("zb-h2", 2, 4, ()), ("zb-auto", 2, 4, ()), ("zbv", 2, 4, ()), ("v-half", 2, 4, ()), ("v-min", 2, 4, ()),
    ("dualpipe", 4, 8, ()), ("dualpipev", 2, 6, ()), ("chimera", 2, 4, ()), ("bitpipe", 2, 4, ()),
)]


def _setup(schedule: str, *, gamma: float = 0.05, alpha: float = 0.01, mtp: int = 1, mtp_weight: float = 0.3,
           max_norm: float | None = 0.5, layers: int = 2):
    """A ``layers``-block MoE GPT (4 experts, top-2, sigmoid scores) and its training pieces."""
    import torch

    from twinpipe.train.data import BatchSampler
    from twinpipe.train.model import GPT, GPTConfig, lm_loss
    from twinpipe.train.trainer import TrainConfig

    cfg = GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=layers, experts=4, top_k=2, score="sigmoid",
                    balance_alpha=alpha, **({"mtp_depth": mtp} if mtp else {}))
    corpus = torch.randint(0, cfg.vocab, (4096,), generator=torch.Generator().manual_seed(5))
    sampler = BatchSampler(corpus, cfg.seq_len, seed=0)
    config = TrainConfig(schedule=schedule, batch_size=8, microbatch_size=1, max_norm=max_norm, bias_update_speed=gamma,
                         **({"mtp_depth": mtp, "mtp_weight": mtp_weight} if mtp else {}))
    return (lambda: GPT(cfg)), sampler, lm_loss, (lambda params: torch.optim.AdamW(params, lr=1e-2)), config


def _trainer(schedule, dp, pp, **kw):
    import torch

    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import Trainer

    fn, sampler, criterion, make_opt, config = _setup(schedule, **kw)
    return Trainer(fn, sampler, criterion, make_opt, build_mesh(dp, pp), config, dtype=torch.float64)


def _reference(rank, schedule, dp, pp, **kw):
    import torch

    from twinpipe.train.reference import ReferenceTrainer

    if rank != 0:
        return None
    fn, sampler, criterion, make_opt, config = _setup(schedule, **kw)
    return ReferenceTrainer(fn, sampler, criterion, make_opt, config, dp, pp, dtype=torch.float64)


def _all_buffers(trainer) -> dict | None:
    """Every copy of every routing bias on every rank, on rank 0: name -> list of tensors."""
    import torch.distributed as dist

    mine = [(name, b.detach().clone()) for name, b, _ in trainer.held_buffers]
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if everyone is None:
        return None
    copies: dict = {}
    for part in everyone:
        for name, b in part:
            copies.setdefault(name, []).append(b)
    return copies


def _buffer_problems(copies: dict, want: dict, what: str) -> list[str]:
    import torch

    problems = []
    if set(copies) != set(want):
        return [f"{what}: bias names {sorted(copies)} != reference {sorted(want)}"]
    for name, found in copies.items():
        if not all(torch.equal(b, found[0]) for b in found):
            problems.append(f"{what}: the copies of {name} differ over the ranks")
        if not torch.equal(found[0], want[name]):
            problems.append(f"{what}: {name} {found[0].tolist()} != reference {want[name].tolist()}")
    return problems


def _follow(rank, trainer, ref, steps, what) -> list[str]:
    """Each step from the pipeline's own state (adopted by the reference): losses, norm, state and
    biases bitwise the reference's; every copy of a bias the same."""
    import torch
    import torch.distributed as dist

    problems, moved = [], False
    for step in steps:
        state, copies = gather_state(trainer), _all_buffers(trainer)
        expected = [None]
        if rank == 0:
            try:
                differ = state_differences(state, reference_state(ref))
                differ += _buffer_problems(copies, {n: b.detach() for n, b in ref.named_buffers().items()}, "before")
                ref.load_state(*state, buffers={n: found[0] for n, found in copies.items()})
                _, losses, norm = ref.step(step)
                moved |= any(float(b.abs().sum()) > 0 for b in ref.named_buffers().values())
                expected = [(differ, losses, norm)]
            except Exception as exc:
                expected = [f"the reference failed at step {step}: {type(exc).__name__}: {exc}"]
        dist.broadcast_object_list(expected, src=0)
        if isinstance(expected[0], str):
            return problems + [f"{what}: {expected[0]}"]
        differ, losses, norm = expected[0]
        if differ:
            problems.append(f"{what}: before step {step}: {differ[:4]}")
        got = trainer.step(step)
        if not torch.equal(got.losses, losses):
            problems.append(f"{what}: step {step}: losses {got.losses.tolist()} != reference {losses.tolist()}")
        if got.grad_norm != norm:
            problems.append(f"{what}: step {step}: gradient norm {got.grad_norm!r} != reference {norm!r}")
        if not trainer.mirrors_equal():
            problems.append(f"{what}: step {step}: mirrored copies differ")
    state, copies = gather_state(trainer), _all_buffers(trainer)
    differ = [None]
    if rank == 0:
        differ = [state_differences(state, reference_state(ref))
                  + _buffer_problems(copies, {n: b.detach() for n, b in ref.named_buffers().items()}, "after")]
        if trainer.config.bias_update_speed and not moved:
            differ[0].append("no bias moved")
        for main, copy in getattr(ref.model, "tied_copies", ()):  # the MTP head's embedding copy stays the embedding
            if not torch.equal(state[0][main], state[0][copy]):
                differ[0].append(f"{copy} differs from {main}")
    dist.broadcast_object_list(differ, src=0)
    if differ[0]:
        problems.append(f"{what}: after step {steps[-1]}: {differ[0][:4]}")
    return problems


TRAIN_CASES = [  # (schedule, dp, pp, options)
    ("dualpipev", 2, 2, {}),
    ("1f1b", 2, 2, {"mtp": 2}),
    ("dualpipev", 1, 4, {"layers": 6}),
    ("1f1b", 1, 4, {}),
    ("dualpipe", 2, 2, {}),
]


def _case_id(case) -> str:
    schedule, dp, pp, options = case
    return f"{schedule}-dp{dp}-pp{pp}" + "".join(f"-{k}{v}" for k, v in options.items())


def _train_case(rank, case) -> list[str]:
    schedule, dp, pp, options = case
    trainer = _trainer(schedule, dp, pp, **options)
    ref = _reference(rank, schedule, dp, pp, **options)
    return _follow(rank, trainer, ref, range(STEPS), _case_id(case))


def _checkpoint(rank, root) -> list[str]:
    """Biases moved under dualpipev PP=2 x DP=2, saved, loaded under 1f1b PP=4: the same biases."""
    import torch
    import torch.distributed as dist

    from twinpipe.train.checkpoint import load_checkpoint, save_checkpoint

    a = _trainer("dualpipev", 2, 2)
    for step in range(3):
        a.step(step)
    save_checkpoint(a, f"{root}/a", 3)
    saved = _all_buffers(a)
    b = _trainer("1f1b", 1, 4)
    load_checkpoint(b, f"{root}/a")
    loaded = _all_buffers(b)
    problems = [None]
    if rank == 0:
        problems = [[f"{n}: loaded {loaded[n][0].tolist()} != saved {saved[n][0].tolist()}" for n in saved
                     if not torch.equal(loaded[n][0], saved[n][0])]]
        if all(float(v[0].abs().sum()) == 0 for v in saved.values()):
            problems[0].append("no bias had moved before the save")
    dist.broadcast_object_list(problems, src=0)
    return problems[0]


def _hf_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=3,
                            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                            topk_group=1, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
                            qk_nope_head_dim=4, v_head_dim=4, n_shared_experts=1, max_position_embeddings=64,
                            experts_implementation="eager")


def _hf_bias(rank, group) -> list[str]:
    """HF DeepSeek-V3 on 2 data-parallel ranks: ``BiasBalancer`` moves every gate's
    ``e_score_correction_bias`` by the loads of both ranks' tokens, the same on both, as one
    process holding both ranks' batches moves them."""
    import copy

    import torch
    import torch.distributed as dist
    from transformers import DeepseekV3ForCausalLM

    from twinpipe.moe.bias import HF_BIAS, BiasBalancer

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(_hf_config()).double()
    whole = copy.deepcopy(model)
    batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 + r)) for r in range(2)]
    balancer = BiasBalancer(model, 0.01, group=group)
    one = BiasBalancer(whole, 0.01)
    problems, moved = [], False
    for _ in range(2):
        model(batches[rank], labels=batches[rank]).loss.backward()
        loads = balancer.step()
        moved |= any(float(getattr(m, HF_BIAS).abs().sum()) > 0 for m in model.modules() if hasattr(m, HF_BIAS))
        for x in batches:
            whole(x, labels=x).loss.backward()
        want = one.step()
        if any(not torch.equal(a, b) for a, b in zip(loads, want)):
            problems.append(f"loads {[t.tolist() for t in loads]} != one process's {[t.tolist() for t in want]}")
    mine = [getattr(m, HF_BIAS).clone() for m in model.modules() if hasattr(m, HF_BIAS)]
    theirs = [None, None]
    dist.all_gather_object(theirs, mine, group=group)
    ref = [getattr(m, HF_BIAS) for m in whole.modules() if hasattr(m, HF_BIAS)]
    if not all(torch.equal(a, b) for a, b in zip(theirs[0], theirs[1])):
        problems.append("the ranks' biases differ")
    if not all(torch.equal(a, b) for a, b in zip(mine, ref)):
        problems.append(f"biases {[t.tolist() for t in mine]} != one process's {[t.tolist() for t in ref]}")
    if not moved or len(mine) != 2:
        problems.append(f"{len(mine)} gates, moved: {moved}; expected 2 gates whose biases moved")
    balancer.close()
    return problems


def _disagree(rank) -> list[str]:
    """Ranks built with different DeepSeek-V3 settings refuse together, naming the setting."""
    problems = []
    for field, mine in (("bias_update_speed", {"gamma": 0.05 if rank % 2 else 0.01}), ("mtp_weight", {"mtp_weight": 0.3 + rank % 2})):
        try:
            _trainer("1f1b", 1, 4, **mine)
            problems.append(f"different {field} accepted")
        except Exception as exc:  # noqa: BLE001  (the agreement's error, whatever its class)
            if field not in str(exc):
                problems.append(f"different {field}: the error does not name it: {exc}")
    import dataclasses

    import torch

    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.model import GPT, GPTConfig
    from twinpipe.train.trainer import Trainer

    fn, sampler, criterion, make_opt, config = _setup("1f1b", mtp=0)
    dense = lambda: GPT(GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=2))  # noqa: E731
    for model_fn, changes, want in ((dense, {}, "bias_update_speed=0.05: must be 0 for a model without MoE routers"),
                                    (fn, {"mtp_depth": 1, "mtp_weight": 0.3}, "mtp_depth=1: must be the number of MTP modules")):
        try:
            Trainer(model_fn, sampler, criterion, make_opt, build_mesh(1, 4), dataclasses.replace(config, **changes),
                    dtype=torch.float64)
            problems.append(f"accepted: {want}")
        except ValueError as exc:
            if want not in str(exc):
                problems.append(f"unclear error {exc}, expected {want}")
    return problems


def _world(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    groups = {p: dist.new_group(list(range(p))) for p in (2, 4)}
    results = {}
    for case in AUX_CASES:
        if rank < case.ranks:
            try:
                results[case.id] = exactness.run_case(rank, groups[case.ranks], case)
            except Exception as exc:
                results[case.id] = [f"{type(exc).__name__}: {exc}"]
        dist.barrier()
    named = [(_case_id(c), lambda c=c: _train_case(rank, c)) for c in TRAIN_CASES]
    named += [("checkpoint", lambda: _checkpoint(rank, root)), ("disagree", lambda: _disagree(rank))]
    try:
        import transformers  # noqa: F401  (the optional extra)

        two = groups[2]
        named.append(("hf_bias", lambda: _hf_bias(rank, two) if rank < 2 else []))
    except ImportError:
        pass
    results.update(run_named(named))
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return run_world(WORLD, _world, str(tmp_path_factory.mktemp("ds3")), timeout=300)


def _check(outcomes, name):
    problems = {r: outcomes[r][name] for r in range(WORLD) if outcomes[r].get(name)}
    assert not problems, problems


def test_every_schedule_has_an_aux_loss_case():
    from twinpipe.schedule.registry import names

    assert {c.schedule for c in AUX_CASES} == set(names())


@pytest.mark.parametrize("case", AUX_CASES, ids=lambda c: c.id)
def test_stage_local_aux_loss_matches_one_process(outcomes, case):
    _check(outcomes, case.id)


@pytest.mark.parametrize("case", TRAIN_CASES, ids=_case_id)
def test_balancing_training_matches_reference(outcomes, case):
    _check(outcomes, _case_id(case))


def test_routing_biases_checkpointed(outcomes):
    _check(outcomes, "checkpoint")


def test_ranks_agree_on_ds3_settings(outcomes):
    _check(outcomes, "disagree")


def test_hf_deepseek_bias_moved_by_both_ranks_loads(outcomes):
    pytest.importorskip("transformers")
    _check(outcomes, "hf_bias")


def test_bias_step_is_the_sign_rule():
    import torch

    from twinpipe.moe.bias import bias_step, update_bias_

    loads = torch.tensor([5, 3, 4, 0])  # mean 3: over, at, over, under
    assert bias_step(loads, 0.5).tolist() == [-0.5, 0.0, -0.5, 0.5]
    bias = torch.zeros(4, dtype=torch.float32)
    update_bias_(bias, loads, 0.25)
    assert bias.tolist() == [-0.25, 0.0, -0.25, 0.25] and bias.dtype == torch.float32
    with pytest.raises(ValueError, match="loads has shape"):
        update_bias_(bias, torch.zeros(3), 0.1)


def test_sequence_balance_loss_is_the_papers_formula():
    import torch

    from twinpipe.moe.router import sequence_balance_loss

    torch.manual_seed(0)
    b, t, e, k = 3, 5, 4, 2
    scores = torch.rand(b * t, e, dtype=torch.float64)
    experts = scores.topk(k, dim=-1).indices
    want = 0.0
    for s in range(b):
        rows = range(s * t, (s + 1) * t)
        for i in range(e):
            f = e / (k * t) * sum(int(i in experts[r].tolist()) for r in rows)
            p = sum(float(scores[r, i] / scores[r].sum()) for r in rows) / t
            want += f * p / b
    assert abs(float(sequence_balance_loss(scores, experts, t)) - want) < 1e-12
    with pytest.raises(ValueError, match="seq_len=4"):
        sequence_balance_loss(scores, experts, 4)


def test_hf_balance_loss_hook_adds_alpha_times_the_loss():
    """The hook's gradient is that of ``loss + alpha * sum over gates of the sequence balance loss``."""
    pytest.importorskip("transformers")
    import copy

    import torch
    from transformers import DeepseekV3ForCausalLM

    from twinpipe.moe.balance_loss import install_balance_loss
    from twinpipe.moe.bias import HF_BIAS
    from twinpipe.moe.router import sequence_balance_loss

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(_hf_config()).double()
    manual = copy.deepcopy(model)
    x = torch.randint(0, 64, (2, 8))
    handles = install_balance_loss(model, 0.1)
    model(x, labels=x).loss.backward()
    seen = []
    gates = [m for m in manual.modules() if hasattr(m, HF_BIAS)]
    hooks = [g.register_forward_hook(lambda g, i, o: seen.append(sequence_balance_loss(o[0].sigmoid(), o[2], i[0].shape[1])))
             for g in gates]
    loss = manual(x, labels=x).loss
    (loss + 0.1 * sum(seen)).backward()
    for (name, p), q in zip(model.named_parameters(), manual.parameters()):
        if p.grad is not None or q.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-13), name
    gate = gates[0].weight
    assert float(next(p for n, p in model.named_parameters() if n.endswith("gate.weight")).grad.abs().sum()) > 0
    for h in handles + hooks:
        h.remove()
    with pytest.raises(ValueError, match="alpha=0"):
        install_balance_loss(model, 0)
    del gate


def test_hf_mtp_module_runs_a_deepseek_layer_with_the_shared_embedding_and_head():
    """``hf_mtp_module`` + ``mtp_losses`` on a Hugging Face DeepSeek-V3: finite losses, gradients
    into the module, the embedding and the head."""
    pytest.importorskip("transformers")
    import torch
    import torch.nn.functional as F
    from transformers import DeepseekV3ForCausalLM
    from transformers.masking_utils import create_causal_mask

    from twinpipe.train.mtp import hf_mtp_module, mtp_losses

    torch.manual_seed(0)
    cfg = _hf_config()
    model = DeepseekV3ForCausalLM(cfg).double()
    modules = [hf_mtp_module(model), hf_mtp_module(model, cfg.num_hidden_layers + 1)]
    x = torch.randint(0, 64, (2, 9))
    ids, labels = x[:, :-1], x[:, 1:]
    h = model.model(ids).last_hidden_state

    def block_kwargs(length):
        e = torch.zeros(2, length, cfg.hidden_size, dtype=torch.float64)
        pos = torch.arange(length).unsqueeze(0)
        return {"position_embeddings": model.model.rotary_emb(e, pos),
                "attention_mask": create_causal_mask(config=cfg, inputs_embeds=e, attention_mask=None, cache=None, position_ids=pos)}

    losses = mtp_losses(modules, h, labels, model.model.embed_tokens, model.lm_head,
                        lambda lg, t: F.cross_entropy(lg.reshape(-1, lg.shape[-1]), t.reshape(-1)), block_kwargs)
    assert len(losses) == 2 and all(0 < v.item() < 10 for v in (loss.detach() for loss in losses))
    sum(losses).backward()
    for p in (modules[0].proj.weight, modules[1].proj.weight, model.model.embed_tokens.weight, model.lm_head.weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0


def test_with_aux_loss_adds_the_term_to_the_gradient_only():
    import torch

    from twinpipe.runtime.aux_loss import with_aux_loss

    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, dtype=torch.float64)
    h = x @ w
    out = with_aux_loss(h, 0.5 * h.pow(2).mean())
    assert torch.equal(out, h)
    out.sum().backward()
    got = w.grad.clone()
    w.grad = None
    h = x @ w
    (h.sum() + 0.5 * h.pow(2).mean()).backward()
    assert torch.allclose(got, w.grad, rtol=0, atol=1e-15) and not torch.allclose(got, (x.sum(0, keepdim=True).t()).expand(3, 3))
    with pytest.raises(ValueError, match="aux="):
        with_aux_loss(h, h)


def test_router_balance_alpha_adds_the_sequence_loss_and_bias_steers_the_choice_only():
    import copy

    import torch

    from twinpipe.moe.router import TopKRouter, sequence_balance_loss

    torch.manual_seed(0)
    router = TopKRouter(8, 4, 2, score="sigmoid", balance_alpha=0.3).double()
    plain = copy.deepcopy(router)
    plain.balance_alpha = 0.0
    tokens = torch.randn(12, 8, dtype=torch.float64)
    experts, weights = router(tokens, seq_len=6)
    weights.pow(2).sum().backward()
    e2, w2 = plain(tokens)
    scores = plain.gate(tokens).sigmoid()
    (w2.pow(2).sum() + 0.3 * sequence_balance_loss(scores, e2, 6)).backward()
    assert torch.equal(experts, e2) and torch.allclose(router.gate.weight.grad, plain.gate.weight.grad, rtol=0, atol=1e-14)
    assert router.loads.tolist() == torch.bincount(experts.reshape(-1), minlength=4).tolist()
    with torch.no_grad():  # a large bias on expert 3 puts it in every choice; the weights stay the unbiased scores'
        router.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64))
        biased, w = router.eval()(tokens)
    assert (biased == 3).any(-1).all()
    raw = router.gate(tokens).sigmoid().gather(1, biased)
    assert torch.allclose(w, raw / raw.sum(-1, keepdim=True), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="balance_alpha=-1"):
        TopKRouter(8, 4, 2, balance_alpha=-1)


def test_mtp_loss_is_main_plus_lambda_over_d_times_the_depth_losses():
    """``MTPLoss`` on the GPT's head, written out by hand for D=2."""
    import torch
    import torch.nn.functional as F

    from twinpipe.train.model import GPT, GPTConfig, lm_loss
    from twinpipe.train.mtp import MTPLoss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=1, mtp_depth=2)).double()
    assert torch.equal(model.head.mtp_embed, model.embed.tokens.weight)
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    logits, hidden = model(x)
    got = MTPLoss(lm_loss, model.head, 0.3)(logits, hidden, y)
    head, emb = model.head, model.embed.tokens.weight
    h1 = head.mtp[0](hidden[:, :7], F.embedding(y[:, 0:7], emb))  # token i+1 is label i
    h2 = head.mtp[1](h1[:, :6], F.embedding(y[:, 1:7], emb))
    want = lm_loss(logits, y) + 0.3 / 2 * (lm_loss(head.logits(h1), y[:, 1:]) + lm_loss(head.logits(h2), y[:, 2:]))
    assert torch.allclose(got, want, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="mtp_depth=8"):
        GPTConfig(seq_len=8, mtp_depth=8)


@pytest.mark.parametrize("kwargs, named", [
    (dict(bias_update_speed=-0.1), "bias_update_speed=-0.1"), (dict(mtp_depth=-1), "mtp_depth=-1"),
    (dict(mtp_weight=0.3), "mtp_weight=0.3: must be 0 without"), (dict(mtp_depth=1, mtp_weight=float("nan")), "mtp_weight=nan"),
])
def test_train_config_refuses_bad_ds3_options(kwargs, named):
    from twinpipe.train.config import TrainConfig

    with pytest.raises(ValueError, match=named):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("argv, message", [
    (["--bias-update-speed", "0.01"], "--bias-update-speed=0.01: needs --experts"),
    (["--experts", "4", "--bias-update-speed", "-1"], "--bias-update-speed=-1.0: must be a finite number >= 0"),
    (["--score", "sigmoid"], "--score='sigmoid': needs --experts"),
    (["--mtp-depth", "64"], "--mtp-depth=64: must be >= 0 and <= 63"),
    (["--experts", "4", "--balance-alpha", "-0.5"], "--balance-alpha=-0.5"),
])
def test_cli_refuses_bad_ds3_options_before_any_process_starts(argv, message, capsys):
    import argparse

    from twinpipe.train_command.cli import add_train_parser, run_train

    args = add_train_parser(argparse.ArgumentParser().add_subparsers()).parse_args(argv)
    assert run_train(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("twinpipe train: error:") and message in err, err


def test_model_record_keeps_ds3_fields_only_when_set():
    """Checkpoints written before the DeepSeek-V3 fields existed still match a default model's record."""
    from twinpipe.train.config import model_record, record_differences
    from twinpipe.train.model import GPT, GPTConfig

    old = {"config": {"vocab": 32, "seq_len": 8, "dim": 8, "heads": 2, "layers": 1, "experts": 0, "top_k": 2}}
    assert record_differences(old, model_record(GPT(GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=1)))) == []
    mtp = model_record(GPT(GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=1, mtp_depth=1)))
    assert record_differences(old, mtp) == ["mtp_depth: '(absent)' in the checkpoint, 1 here"]
