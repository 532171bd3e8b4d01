"""DeepSeek-V3's balancing on a ``transformers`` DeepSeek-V3 through ``Trainer(stages=HFSource(...))``:
``TrainConfig(bias_update_speed=gamma)`` moves every gate's ``e_score_correction_bias`` and
``balance_alpha`` adds the sequence-wise balance loss, as one process does on the unsplit model
(``BiasBalancer`` and ``install_balance_loss``): the biases bitwise after 2-3 steps under dualpipev
and dualpipe on 2 pipeline ranks and with 2 expert-parallel ranks, every copy alike; the first step's
losses bitwise and gradients within 1e-13; the biases in the DCP checkpoint (a resumed run bitwise the
uninterrupted one) and in the safetensors ``save`` writes; ``twinpipe train --model DIR
--bias-update-speed --balance-alpha`` end to end; the trainer's and the command line's refusals;
and (twinpipe's GPT) the biases a checkpoint writes under bf16-mixed are the moved ones. One 2-rank
world for the module."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="twinpipe.hf needs transformers (pip install twinpipe[hf])")

import torch  # noqa: E402

import hf_models  # noqa: E402
from distributed import run_named, run_world  # noqa: E402
from models import grad_error  # noqa: E402

DATA = Path(__file__).parent / "data"
GAMMA, ALPHA, LR, TOL = 0.01, 0.1, 0.5, 1e-13
BATCH, MICRO, SEQ, STEPS = 4, 1, 8, 3
BIAS = "e_score_correction_bias"
V_LAYOUT = "E|t|t|t,L"  # DualPipeV on 2 ranks: rank 0 holds layer 2 (MoE), rank 1 layers 0 (dense) and 1 (MoE)
_MODEL: list = []


def _model():
    """DeepSeek-V3 of 3 layers (layer 0 dense, 1 and 2 MoE: 8 experts in 4 groups, top-2 of 2 groups),
    float64 with random routing biases."""
    if not _MODEL:
        _MODEL.append(hf_models.model("deepseek_v3", layers=3).to(torch.float64))
    return copy.deepcopy(_MODEL[0])


def _sampler():
    from twinpipe.train.data import BatchSampler

    corpus = torch.randint(0, hf_models.VOCAB, (3000,), generator=torch.Generator().manual_seed(3))
    return BatchSampler(corpus, SEQ, seed=0)


def _biases(model) -> dict:
    return {name: t.tolist() for name, t in model.named_buffers() if name.endswith(BIAS)}


def _reference(steps: int, alpha: float) -> dict:
    """The unsplit model, one process: per step every micro-batch's ``TokenLoss`` backward, the sum
    divided by their number (the trainer's rule), SGD, then ``BiasBalancer.step()``."""
    from twinpipe.hf import TokenLoss
    from twinpipe.moe.balance_loss import install_balance_loss
    from twinpipe.moe.bias import BiasBalancer

    model = _model()
    if alpha:
        install_balance_loss(model, alpha)
    balancer = BiasBalancer(model, GAMMA)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler, criterion = _sampler(), TokenLoss()
    out = {"losses": [], "biases": []}
    for step in range(steps):
        x, y = sampler.batch(step, BATCH)
        optimizer.zero_grad()
        losses = []
        for j in range(BATCH // MICRO):
            rows = slice(j * MICRO, (j + 1) * MICRO)
            loss = criterion(model(input_ids=x[rows], attention_mask=torch.ones_like(x[rows])).logits, y[rows])
            loss.backward()
            losses.append(float(loss.detach().double()))
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(BATCH // MICRO)
        if step == 0:
            out["grads"] = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        balancer.step()
        out["losses"].append(losses)
        out["biases"].append(_biases(model))
    out["weights"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return out


def _trainer(schedule: str, dp: int, pp: int, *, alpha: float = ALPHA, ep: bool = False, gamma: float = GAMMA,
             layout: str | None = None):
    from twinpipe.hf import HFSource, TokenLoss
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import TrainConfig, Trainer

    mesh = build_mesh(dp, pp)
    config = TrainConfig(schedule=schedule, batch_size=BATCH, microbatch_size=MICRO, seed=0, bias_update_speed=gamma,
                         **({"balance_alpha": alpha} if alpha else {}))
    stages = HFSource("unused: no weights read", layout, ep_group=mesh.dp_group if ep else None)
    return Trainer(_model, _sampler(), TokenLoss(), lambda ps: torch.optim.SGD(ps, lr=LR), mesh, config,
                   dtype=torch.float64, stages=stages)


def _held_biases(trainer) -> list:
    """``(name, values)`` of every copy of a bias this rank holds (mirrored copies too)."""
    return [(name, t.tolist()) for name, t, _ in trainer.held_buffers]


def _against(trainer, ref: dict, steps: int, grads: bool) -> list[str]:
    """Run ``steps`` steps; problems against the reference: losses of step 0 bitwise, its gradients
    within ``TOL`` (``grads``), this rank's biases after each step bitwise."""
    problems = []
    if not trainer.held_buffers:
        problems.append("this rank holds no routing bias")
    for step in range(steps):
        result = trainer.step(step)
        if step == 0 and result.losses.tolist() != ref["losses"][0]:
            problems.append(f"step 0 losses {result.losses.tolist()} != reference {ref['losses'][0]}")
        if step == 0 and grads:
            for name, p, _ in trainer.held:
                err = grad_error(p.grad, ref["grads"][name])
                if not err <= TOL:
                    problems.append(f"{name}: gradient error {err:.3g}")
        for name, values in _held_biases(trainer):
            if values != ref["biases"][step][name]:
                problems.append(f"step {step}: {name} = {values} != reference {ref['biases'][step][name]}")
    return problems[:6]


def _dualpipev(root: Path, ref: dict) -> list[str]:
    """3 steps with gamma and alpha, a DCP checkpoint after 2, the safetensors of the end (rank 0 reads
    them back with ``from_pretrained``)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from twinpipe.hf.mtp import save_tensors
    from twinpipe.hf.weights import load, save
    from twinpipe.train.checkpoint import save_checkpoint

    trainer = _trainer("dualpipev", 1, 2, layout=V_LAYOUT)
    problems = _against(trainer, ref, 2, grads=True)
    save_checkpoint(trainer, str(root / "ckpt"), 2)
    trainer.step(2)
    for name, values in _held_biases(trainer):
        if values != ref["biases"][2][name]:
            problems.append(f"step 2: {name} differs from the reference")
    for name, p, _ in trainer.held:
        if not torch.allclose(p, ref["weights"][name], rtol=0, atol=1e-10):
            problems.append(f"{name}: weight differs from the reference")
    save(root / "saved", save_tensors(trainer.pipe.module), _MODEL[0].config, timeout=120)
    dist.barrier()
    if dist.get_rank() == 0:
        want = ref["biases"][2]
        on_disk = {name: t.tolist() for name, t in load(root / "saved", list(want)).items()}
        if on_disk != want:
            problems.append(f"the saved biases {on_disk} != the trained {want}")
        # transformers keeps the bias in float32 whatever the model's dtype: the trained values, rounded
        back = AutoModelForCausalLM.from_pretrained(str(root / "saved"), dtype=torch.float64)
        if _biases(back) != {name: torch.tensor(v).float().tolist() for name, v in want.items()}:
            problems.append(f"from_pretrained's biases {_biases(back)} != the trained {want}")
    final = {"weights": {n: p.detach().clone() for n, p, _ in trainer.held}, "biases": dict(_held_biases(trainer))}
    trainer.pipe.close()
    return problems[:6], final


def _resumed(root: Path, final: dict) -> list[str]:
    """A fresh trainer (gamma 0 would keep its initial biases) loads the checkpoint and runs step 2:
    biases and weights bitwise those of the run that did not stop."""
    from twinpipe.train.checkpoint import load_checkpoint

    trainer = _trainer("dualpipev", 1, 2, layout=V_LAYOUT)
    start = load_checkpoint(trainer, str(root / "ckpt"))
    problems = [] if start == 2 else [f"load_checkpoint returned {start}"]
    trainer.step(start)
    for name, values in _held_biases(trainer):
        if values != final["biases"][name]:
            problems.append(f"{name}: {values} != the uninterrupted run's {final['biases'][name]}")
    for name, p, _ in trainer.held:
        if not torch.equal(p, final["weights"][name]):
            problems.append(f"{name}: weight differs from the uninterrupted run's")
    trainer.pipe.close()
    return problems[:6]


def _dualpipe(ref: dict) -> list[str]:
    """DualPipe (gamma alone): each layer on two ranks (mirrored copies), both counted, both moved alike."""
    trainer = _trainer("dualpipe", 1, 2, alpha=0.0)
    problems = _against(trainer, ref, 2, grads=False)
    if all(owned for *_, owned in trainer.held_buffers):
        problems.append("this rank holds no mirrored copy of a bias")
    trainer.pipe.close()
    return problems


def _expert_parallel(ref: dict) -> list[str]:
    """2 data-parallel ranks with the experts spread over them (EP=2; gamma alone): each rank's gate
    counts its own tokens' choices of the global experts, the sum counts each token once."""
    trainer = _trainer("1f1b", 2, 1, ep=True, alpha=0.0)
    problems = [] if trainer.row_shards else ["the experts are not spread"]
    problems += _against(trainer, ref, 2, grads=False)
    trainer.pipe.close()
    return problems


def _cli(root: Path) -> list[str]:
    """``twinpipe train --model tests/data/tiny-deepseek-v3 --bias-update-speed 0.001 --balance-alpha 0.1``
    (1F1B on 2 ranks, 1 step): its final checkpoint holds every gate's bias, moved by the unsplit model's
    loads of the same batch from the same initial weights, and its gradient norm is the unsplit model's
    with the balance loss (float32: 1e-5 relative; without the loss it differs by more)."""
    import json

    import numpy as np
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import twinpipe.train_command.cli as cli
    from twinpipe.hf import TokenLoss
    from twinpipe.moe.balance_loss import install_balance_loss
    from twinpipe.moe.bias import BiasBalancer
    from twinpipe.train.data import BatchSampler
    from twinpipe.train.stopping import StopOnSignals

    tokens = root / "tokens.npy"
    if dist.get_rank() == 0:
        np.save(tokens, np.random.default_rng(0).integers(0, 128, 4000).astype(np.uint16))
    dist.barrier()
    parser = cli.argparse.ArgumentParser()
    cli._add_arguments(parser)
    args = parser.parse_args(["--model", str(DATA / "tiny-deepseek-v3"), "--data", str(tokens), "--pp", "2",
                              "--schedule", "1f1b", "--bias-update-speed", "0.001", "--balance-alpha", "0.1", "--steps", "1", "--seq-len", str(SEQ),
                              "--batch-size", "2", "--microbatch-size", "1", "--out", str(root / "cli")])
    cli._check(args)
    cli._train(args, torch.device("cpu"), StopOnSignals())  # no signal comes: nothing asks it to stop
    dist.barrier()
    if dist.get_rank() != 0:
        return []
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(root / "cli" / "checkpoint-final"), str(root / "final.pt"))
    saved = torch.load(root / "final.pt", weights_only=True)
    torch.manual_seed(0)  # the trainer's seed, then the model, as the command builds it
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(DATA / "tiny-deepseek-v3"))).train()
    x, y = BatchSampler(torch.from_numpy(np.load(tokens).astype(np.int64)), SEQ, seed=0).batch(0, 2)

    def norm() -> float:  # of the mean of the two micro-batches' gradients (the balance loss's gradient has
        model.zero_grad()  # factor 1 in each micro-batch's backward, as the trainer's: divided after the sum)
        for rows in (slice(0, 1), slice(1, 2)):
            TokenLoss()(model(x[rows]).logits, y[rows]).backward()
        return float(torch.stack([p.grad.double().norm() for p in model.parameters() if p.grad is not None]).norm()) / 2

    plain = norm()
    install_balance_loss(model, 0.1)
    balancer = BiasBalancer(model, 0.001)
    with_loss = norm()
    balancer.step()
    logged = json.loads((root / "cli" / "train-log.json").read_text())["steps"][0]["grad_norm"]
    problems = [] if logged == pytest.approx(with_loss, rel=1e-5) else [f"gradient norm {logged} != reference {with_loss} (without the loss {plain})"]
    if abs(plain - with_loss) < 1e-4 * with_loss:
        problems.append(f"the balance loss hardly changes the norm ({plain} vs {with_loss})")
    want = {f"buffer.{name}": t for name, t in model.named_buffers() if name.endswith(BIAS)}
    problems += [f"{key}: {saved.get(key)} != {t}" for key, t in want.items() if not torch.equal(saved.get(key, torch.zeros(0)), t)]
    if not want or not any(t.abs().sum() > 0 for t in want.values()):
        problems.append("no bias moved in the reference")
    return problems


def _refused() -> list[str]:
    """``Trainer`` refuses gamma or alpha for a model without DeepSeek-V3 gates (a Llama), and alpha for
    a twinpipe.moe model (its routers take their own), on every rank alike."""
    from twinpipe.hf import HFSource, TokenLoss
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import TrainConfig, Trainer

    mesh, problems = build_mesh(1, 2), []
    llama = lambda: hf_models.model("llama", layers=2)  # noqa: E731
    for field, message in (("bias_update_speed", "bias_update_speed=0.01: must be 0 for a model without DeepSeek-V3 gates "
                                                 "(LlamaForCausalLM: no module with an e_score_correction_bias buffer)"),
                           ("balance_alpha", "balance_alpha=0.01: must be 0 for a model without DeepSeek-V3 gates")):
        config = TrainConfig(schedule="1f1b", batch_size=BATCH, microbatch_size=MICRO, **{field: 0.01})
        try:
            Trainer(llama, _sampler(), TokenLoss(), lambda ps: torch.optim.SGD(ps, lr=LR), mesh, config, dtype=torch.float64,
                    stages=HFSource("unused"))
            problems.append(f"{field}: not refused")
        except ValueError as error:
            if message not in str(error):
                problems.append(f"{field}: {error}")
    from twinpipe.train.model import GPT, GPTConfig, lm_loss

    config = TrainConfig(schedule="1f1b", batch_size=BATCH, microbatch_size=MICRO, balance_alpha=0.01)
    try:
        Trainer(lambda: GPT(GPTConfig(vocab=64, seq_len=SEQ, dim=16, heads=2, layers=2, experts=2, top_k=1)), _sampler(),
                lm_loss, lambda ps: torch.optim.SGD(ps, lr=LR), mesh, config)
        problems.append("twinpipe.moe model with balance_alpha: not refused")
    except ValueError as error:
        if "balance_alpha=0.01: must be 0 for a model cut by split: a twinpipe.moe router takes its own" not in str(error):
            problems.append(f"twinpipe.moe model: {error}")
    return problems


def _mixed_gpt_biases() -> list[str]:
    """Under ``precision="bf16-mixed"`` (the modules cast to bf16 after the trainer is built, their
    buffers replaced) ``held_buffers``, what checkpoints write, are the biases the step moved."""
    import dataclasses

    from tests.train_setup import tiny_setup
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import Trainer

    model_fn, sampler, criterion, optimizer_fn, config = tiny_setup("1f1b", experts=4, precision="bf16-mixed")
    trainer = Trainer(model_fn, sampler, criterion, optimizer_fn, build_mesh(1, 2),
                      dataclasses.replace(config, bias_update_speed=0.25))
    trainer.step(0)
    live = {id(r.bias) for r in trainer.routing.routers}
    held = trainer.held_buffers
    trainer.pipe.close()
    problems = [] if held and all(id(t) in live for _, t, _ in held) else ["held_buffers are not the routers' biases"]
    return problems + [f"{name}: not moved ({t.tolist()})" for name, t, _ in held if not t.abs().sum() > 0]


def _world(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    ref, plain = _reference(STEPS, ALPHA), _reference(2, 0.0)
    final = {}

    def first():
        problems, done = _dualpipev(root, ref)
        final.update(done)
        return problems

    named = [("dualpipev", first), ("resumed", lambda: _resumed(root, final)), ("dualpipe", lambda: _dualpipe(plain)),
             ("ep", lambda: _expert_parallel(plain)), ("cli", lambda: _cli(root)), ("refused", _refused),
             ("mixed", _mixed_gpt_biases)]
    results = run_named(named)
    # the balance loss changes the gradients (the dualpipev case would not notice its absence otherwise)
    gate = "model.layers.1.mlp.gate.weight"
    results["alpha matters"] = [] if grad_error(plain["grads"][gate], ref["grads"][gate]) > 1e-6 else ["no effect"]
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(2, _world, str(tmp_path_factory.mktemp("hf-balance")), timeout=300)


def _case(world, name):
    return [r.get(name) for r in world if name in r]


def test_biases_move_as_the_unsplit_models_under_dualpipev_with_the_balance_loss(world):
    """Step 0's losses bitwise and gradients within 1e-13 (alpha > 0), every bias bitwise after 3 steps,
    and ``hf.weights.save`` writes them (``from_pretrained`` reads them back)."""
    assert _case(world, "dualpipev") == [[], []]
    assert _case(world, "alpha matters") == [[], []]


def test_resume_carries_the_biases_bitwise(world):
    assert _case(world, "resumed") == [[], []]


def test_mirrored_copies_are_counted_and_moved_alike_under_dualpipe(world):
    assert _case(world, "dualpipe") == [[], []]


def test_expert_parallel_ranks_count_each_token_once(world):
    assert _case(world, "ep") == [[], []]


def test_twinpipe_train_model_bias_update_speed_end_to_end(world):
    assert _case(world, "cli") == [[], []]


def test_trainer_refuses_balancing_a_transformers_model_without_deepseek_v3_gates(world):
    assert _case(world, "refused") == [[], []]


def test_checkpointed_biases_are_the_moved_ones_under_mixed_precision(world):
    assert _case(world, "mixed") == [[], []]


@pytest.mark.parametrize("folder, option, message", [
    ("tiny-llama", ["--bias-update-speed", "0.001"],
     "--bias-update-speed=0.001: must be 0 with --model=.*tiny-llama' \\(model_type='llama'\\): it acts on DeepSeek-V3's "
     "routers \\(their e_score_correction_bias\\), and this model has none"),
    ("tiny-qwen3-moe", ["--balance-alpha", "0.01"], "--balance-alpha=0.01: must be 0 with --model=.*model_type='qwen3_moe'"),
    ("mixtral", ["--bias-update-speed", "0.001"], "--bias-update-speed=0.001: must be 0 with --model=.*model_type='mixtral'"),
    ("tiny-deepseek-v3", ["--score", "sigmoid"], "--score='sigmoid': not with --model: .* a transformers model scores its "
     "experts as its config.json says"),
])
def test_twinpipe_train_refuses_balancing_without_deepseek_v3_gates(tmp_path, capsys, folder, option, message):
    import re

    import numpy as np

    import twinpipe.train_command.cli as cli

    path = DATA / folder
    if folder == "mixtral":
        path = tmp_path / "mixtral"
        hf_models.config("mixtral").save_pretrained(str(path))
    np.save(tmp_path / "tokens.npy", np.arange(400, dtype=np.uint16) % 60)
    parser = cli.argparse.ArgumentParser()
    cli._add_arguments(parser)
    args = parser.parse_args(["--model", str(path), "--data", str(tmp_path / "tokens.npy"), "--pp", "2", "--steps", "1",
                              "--seq-len", "8", "--batch-size", "4", "--microbatch-size", "1", "--out", str(tmp_path / "out"),
                              *option])
    assert cli.run_train(args) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_train_config_checks_balance_alpha():
    from twinpipe.train.trainer import TrainConfig

    assert TrainConfig(balance_alpha=0.1).balance_alpha == 0.1
    with pytest.raises(ValueError, match="balance_alpha=-1: must be a finite number >= 0"):
        TrainConfig(balance_alpha=-1)
