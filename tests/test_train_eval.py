"""Held-out evaluation (``Trainer.evaluate``, ``twinpipe.train.evaluation``): forward-only steps through
the same pipeline give, bit for bit, the unsplit model's loss on the same rows, and leave training as
it was.

One 2-process gloo world, float64. Exact: the built-in GPT under DualPipe, DualPipeV, 1F1B and ZB-H1
(PP=2) and 1F1B with DP=2, and a tiny transformers Llama with attention dropout (0.3: the unsplit
reference runs in eval mode, so a pipeline evaluating with dropout on would differ) under 1F1B and
DualPipeV: every micro-batch's loss equal to the unsplit model's on its rows. No effect: a MoE GPT
with routing-bias updates (DualPipeV) and the Llama with dropout (1F1B), each trained 3 steps with an
evaluation after every step, give bitwise the losses, gradient norms and weights of the same run
without evaluations (an evaluation that counted expert loads, moved a bias, drew random numbers or
touched a gradient would change them), the step's gradients are as the step left them (no backward
ran), and evaluating twice in a row gives the same result.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from distributed import run_named, run_world

WORLD = 2
TINY_LLAMA = Path(__file__).parent / "data" / "tiny-llama"
VOCAB, SEQ, BATCH, MICRO, EVAL_BATCHES = 64, 8, 4, 1, 2
GPT_EXACT = {"gpt-dualpipe": ("dualpipe", 1), "gpt-dualpipev": ("dualpipev", 1), "gpt-1f1b": ("1f1b", 1),
             "gpt-zb-h1": ("zb-h1", 1), "gpt-1f1b-dp2": ("1f1b", 2)}
HF_EXACT = {"llama-1f1b": ("1f1b", "E,t*2|t*2,L"), "llama-dualpipev": ("dualpipev", "E,t|t|t|t,L")}
NO_EFFECT = ("moe-gpt-dualpipev", "llama-dropout-1f1b")


def _corpus(seed: int, size: int):
    return torch.randint(0, VOCAB, (size,), generator=torch.Generator().manual_seed(seed))


def _held_out():
    from twinpipe.train.evaluation import HeldOutBatches

    return HeldOutBatches(_corpus(1, 200), SEQ)


def _gpt_config(experts: int = 0):
    from twinpipe.train.model import GPTConfig

    return GPTConfig(vocab=VOCAB, seq_len=SEQ, dim=8, heads=2, layers=4, experts=experts, top_k=1 if experts else 2)


def _llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(TINY_LLAMA), local_files_only=True, attention_dropout=0.3, vocab_size=VOCAB)
    return AutoModelForCausalLM.from_config(config)


def _trainer(kind: str, schedule: str, pp: int, dp: int, *, layout: str | None = None, experts: int = 0, gamma: float = 0.0):
    from twinpipe.train.data import BatchSampler
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.model import GPT, lm_loss
    from twinpipe.train.trainer import TrainConfig, Trainer

    config = TrainConfig(schedule=schedule, batch_size=BATCH, microbatch_size=MICRO, seed=0, max_norm=1.0,
                         bias_update_speed=gamma)
    sampler = BatchSampler(_corpus(0, 2000), SEQ, seed=0)
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    if kind == "gpt":
        cfg = _gpt_config(experts)
        return Trainer(lambda: GPT(cfg), sampler, lm_loss, optimizer, build_mesh(dp, pp), config, dtype=torch.float64)
    from twinpipe.hf import HFSource, TokenLoss

    return Trainer(_llama, sampler, TokenLoss(), optimizer, build_mesh(dp, pp), config, dtype=torch.float64,
                   stages=HFSource(str(TINY_LLAMA), layout))


def _reference_losses(model_fn, logits_of) -> torch.Tensor:
    """The unsplit model's (seed 0, float64, eval mode) loss of every micro-batch of the held-out batches."""
    from twinpipe.train.model import lm_loss

    torch.manual_seed(0)
    model = model_fn().to(torch.float64).eval()
    losses = []
    with torch.no_grad():
        for k in range(EVAL_BATCHES):
            x, y = _held_out().batch(k, BATCH)
            for rows in range(0, BATCH, MICRO):
                losses.append(lm_loss(logits_of(model, x[rows : rows + MICRO]), y[rows : rows + MICRO]))
    return torch.stack(losses)


def _exact(trainer, model_fn, logits_of) -> list[str]:
    result = trainer.evaluate(_held_out(), EVAL_BATCHES)
    trainer.pipe.close()
    want = _reference_losses(model_fn, logits_of)
    problems = []
    if not torch.equal(result.losses, want):
        problems.append(f"micro-batch losses {result.losses.tolist()} != the unsplit model's {want.tolist()}")
    if result.loss != float(want.mean()) or result.perplexity != pytest.approx(float(want.mean().exp()), rel=1e-15):
        problems.append(f"loss {result.loss}, perplexity {result.perplexity}: the unsplit model's mean is {float(want.mean())}")
    return problems


def _gpt_exact(schedule: str, dp: int) -> list[str]:
    from twinpipe.train.model import GPT

    cfg = _gpt_config()
    return _exact(_trainer("gpt", schedule, WORLD // dp, dp), lambda: GPT(cfg), lambda m, x: m(x))


def _hf_exact(schedule: str, layout: str) -> list[str]:
    return _exact(_trainer("hf", schedule, WORLD, 1, layout=layout), _llama, lambda m, x: m(x).logits)


def _no_effect(name: str) -> list[str]:
    """Three steps with an evaluation after each against three without: bitwise alike."""
    make = {"moe-gpt-dualpipev": lambda: _trainer("gpt", "dualpipev", WORLD, 1, experts=2, gamma=0.01),
            "llama-dropout-1f1b": lambda: _trainer("hf", "1f1b", WORLD, 1, layout="E,t*2|t*2,L")}[name]
    runs, problems = [], []
    for evaluating in (True, False):
        trainer = make()
        results = []
        for step in range(3):
            results.append(trainer.step(step))
            if evaluating:
                grads = [_grad(p) for p in trainer.params]
                first, again = (trainer.evaluate(_held_out(), EVAL_BATCHES) for _ in range(2))
                if any(not _same(a, _grad(p)) for a, p in zip(grads, trainer.params)):
                    problems.append(f"step {step}: an evaluation changed the step's gradients (a backward ran?)")
                if not torch.equal(first.losses, again.losses):
                    problems.append(f"step {step}: two evaluations in a row differ: {first.loss} then {again.loss}")
        runs.append(([r.losses for r in results], [r.grad_norm for r in results],
                     [p.detach().clone() for p in trainer.params], [b.clone() for _, b, _ in trainer.held_buffers]))
        trainer.pipe.close()
    (losses, norms, params, biases), (losses0, norms0, params0, biases0) = runs
    if not all(torch.equal(a, b) for a, b in zip(losses, losses0)) or norms != norms0:
        problems.append(f"with evaluations: losses {[l.tolist() for l in losses]}, norms {norms}; without: "
                        f"{[l.tolist() for l in losses0]}, {norms0}")
    if not all(torch.equal(a, b) for a, b in zip(params, params0)):
        problems.append("the weights after 3 steps differ with evaluations")
    if not all(torch.equal(a, b) for a, b in zip(biases, biases0)):
        problems.append("the routing biases after 3 steps differ with evaluations")
    if name.startswith("moe") and not biases:
        problems.append("no routing bias on this rank: the case does not test them")
    return problems


def _grad(p):
    grad = getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
    return None if grad is None else grad.clone()


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _world(rank: int, world: int) -> dict:
    cases = [(name, lambda a=args: _gpt_exact(*a)) for name, args in GPT_EXACT.items()]
    cases += [(name, lambda a=args: _hf_exact(*a)) for name, args in HF_EXACT.items()]
    cases += [(name, lambda n=name: _no_effect(n)) for name in NO_EFFECT]
    return run_named(cases)


@pytest.fixture(scope="module")
def outcomes():
    pytest.importorskip("transformers")
    return run_world(WORLD, _world, timeout=300)


@pytest.mark.parametrize("case", [*GPT_EXACT, *HF_EXACT])
def test_evaluation_is_bitwise_the_unsplit_models_loss(outcomes, case):
    assert all(o[case] == [] for o in outcomes), [o[case] for o in outcomes]


@pytest.mark.parametrize("case", NO_EFFECT)
def test_evaluation_leaves_training_bitwise_as_it_was(outcomes, case):
    assert all(o[case] == [] for o in outcomes), [o[case] for o in outcomes]
