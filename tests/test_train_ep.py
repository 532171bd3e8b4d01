"""One expert-parallel rule for both model sources: ``--ep N`` (``TrainConfig.ep``) for any N dividing
the data-parallel size, experts spread over EP groups of N consecutive data-parallel ranks and their
gradients summed over the expert-data-parallel groups (``TrainMesh.expert_groups``).

One 4-process gloo world runs every case:
* the built-in MoE GPT with ``dp=4, ep=2`` (1F1B, AdamW, clipping; also with bf16-mixed and ZeRO-1) and
  ``pp=2, dp=2, ep=1`` (DualPipeV, mirrored copies): losses, norms and the state after each step bitwise the one-process reference
  (``ReferenceTrainer`` with the same ``ep``: each EP group's experts its own copy, summed over the
  groups as the trainer sums them); every replica of an expert holds the same weights after the steps;
* a checkpoint written with ``ep=2`` loads with ``ep=1`` and ``ep=4``, bitwise the saved state, and
  the next step is the reference's of the loading layout;
* ``twinpipe train`` (its own checks and training, in this world): the built-in GPT with ``--dp 4 --ep 2``
  against ``--dp 4`` (ep = dp, today's default); the tiny Qwen3-MoE with ``--dp 4 --ep 2`` against ``--dp 4`` (ep = 1, its default). The runs differ
  in how many rows each expert's matrix product takes at once (its EP group's), which a BLAS may round
  differently, and in the order of the expert-data-parallel sums: the losses agree to ``BOUND``
  (``HF_BOUND``: its loss is float32) relative, not bit for bit. Leaving out the expert-data-parallel
  sum (an expert gradient off by the dp/ep factor) moved the second step's loss by 6.5e-4 (GPT) and
  5e-5 (Qwen3-MoE) relative, and failed every case of this module but the bad input.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from distributed import run_named, run_world
from train_setup import gather_state, reference_state, state_differences, steps_against_reference, tiny_setup

WORLD = 4
STEPS = 3
# float64 losses of runs whose expert products see other row counts (above): rounding of a few
# hundred terms, grown over 3 steps of routing (what leaving out a sum gives is 1e6 times more, above).
BOUND = 1e-10
HF_BOUND = 1e-6  # TokenLoss computes the cross entropy in float32: a few ulps
DATA = __import__("pathlib").Path(__file__).parent / "data"
GPT_ARGS = ["--layers", "2", "--dim", "8", "--heads", "2", "--seq-len", "8", "--batch-size", "8", "--microbatch-size", "1",
            "--corpus-bytes", "4096", "--experts", "4", "--top-k", "2", "--dtype", "float64", "--steps", str(STEPS),
            "--schedule", "1f1b", "--lr", "0.01"]


def _trainer(schedule: str, dp: int, pp: int, ep: int, experts: int = 4, **options):
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import Trainer

    fn, sampler, criterion, make_opt, config = tiny_setup(schedule, experts=experts, **options)
    config = dataclasses.replace(config, ep=ep)
    return Trainer(fn, sampler, criterion, make_opt, build_mesh(dp, pp), config, dtype=_dtype(options))


def _dtype(options: dict):
    """The model's dtype: float64, or as built (float32) for bf16-mixed's FP32 masters."""
    import torch

    return None if options.get("precision") == "bf16-mixed" else torch.float64


def _reference(rank: int, schedule: str, dp: int, pp: int, ep: int, **options):
    from twinpipe.train.reference import ReferenceTrainer

    if rank != 0:
        return None
    fn, sampler, criterion, make_opt, config = tiny_setup(schedule, experts=4, **options)
    return ReferenceTrainer(fn, sampler, criterion, make_opt, dataclasses.replace(config, ep=ep), dp, pp, dtype=_dtype(options))


def _replicas_agree(trainer) -> list[str]:
    """Every holder of an expert (one per EP group) holds the same weights: gathered on rank 0."""
    import torch
    import torch.distributed as dist

    mine = {name: p.detach().clone() for name, p, _ in trainer.held if ".experts." in name}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first: dict = {}
    problems = []
    for rank, held in enumerate(everyone):
        for name, t in held.items():
            if name in first and not torch.equal(first[name][1], t):
                problems.append(f"{name}: rank {rank}'s copy differs from rank {first[name][0]}'s")
            first.setdefault(name, (rank, t))
    return problems


def _against_reference(rank: int, schedule: str, dp: int, pp: int, ep: int, **options) -> list[str]:
    import torch.distributed as dist

    trainer = _trainer(schedule, dp, pp, ep, **options)
    ref = _reference(rank, schedule, dp, pp, ep, **options)
    problems = steps_against_reference(trainer, ref, STEPS)
    state = gather_state(trainer)
    differ = [state_differences(state, reference_state(ref)) if rank == 0 else None]
    dist.broadcast_object_list(differ, src=0)
    if differ[0]:
        problems.append(f"after {STEPS} steps the state differs from the reference's: {differ[0][:4]}")
    held = {int(name.split(".experts.")[1].split(".")[0]) for name, _, _ in trainer.held if ".experts." in name}
    ep_rank = trainer.mesh.dp_rank % ep
    if held and held != set(range(ep_rank * 4 // ep, (ep_rank + 1) * 4 // ep)):  # pp=2: a rank may hold no MoE block
        problems.append(f"rank dp={trainer.mesh.dp_rank} holds experts {sorted(held)} with ep={ep}")
    return problems + _replicas_agree(trainer)


def _checkpoint(rank: int, root: str) -> list[str]:
    """ep=2 (dp=4) saves after 2 steps; ep=1 and ep=4 (dp=4) load it: the loaded state is bitwise the
    saved one, and the next step is the reference's of the loading layout."""
    import torch.distributed as dist

    from twinpipe.train.checkpoint import load_checkpoint, save_checkpoint

    options = dict(optimizer="adamw", max_norm=0.3, dp_reduce="ordered")  # 4 replicas: summed left to right
    problems = []
    a = _trainer("1f1b", 4, 1, 2, **options)
    for step in range(2):
        a.step(step)
    save_checkpoint(a, f"{root}/ep2", 2)
    saved = gather_state(a)
    for ep in (1, 4):
        b = _trainer("1f1b", 4, 1, ep, **options)
        if (start := load_checkpoint(b, f"{root}/ep2")) != 2:
            problems.append(f"ep={ep}: loaded step {start}, saved 2")
        state = gather_state(b)
        differ = [state_differences(state, saved) if rank == 0 else None]
        dist.broadcast_object_list(differ, src=0)
        if differ[0]:
            problems.append(f"ep={ep} loading ep=2's checkpoint: the loaded state differs: {differ[0][:4]}")
        ref = _reference(rank, "1f1b", 4, 1, ep, **options)
        if rank == 0:
            ref.load_state(*saved)
        got = b.step(2)
        want = [ref.step(2) if rank == 0 else None]
        dist.broadcast_object_list(want, src=0)
        if got.losses.tolist() != want[0][1].tolist() or got.grad_norm != want[0][2]:
            problems.append(f"ep={ep} after loading: step 2 {got.losses.tolist()} / {got.grad_norm} != reference "
                            f"{want[0][1].tolist()} / {want[0][2]}")
        problems += _replicas_agree(b)
    return problems


def _bad_trainer_ep(rank: int) -> list[str]:
    """``TrainConfig.ep`` not dividing dp or the experts: ValueError naming ``ep`` on every rank."""
    problems = []
    for dp, pp, ep, experts, want in ((4, 1, 3, 4, "ep=3: must divide dp=4 (allowed are 1, 2, 4)"),
                                      (2, 2, 2, 3, "ep=2: must divide 3 (allowed are 1, 3)")):
        try:
            _trainer("1f1b", dp, pp, ep, experts)
            problems.append(f"dp={dp} ep={ep} with {experts} experts was accepted")
        except ValueError as exc:
            if want not in str(exc):
                problems.append(f"dp={dp} ep={ep} with {experts} experts: unclear error {exc}")
    return problems


def _cli_losses(root: str, name: str, *argv: str) -> list[float]:
    """``twinpipe train`` with ``argv`` in this world's 4 processes (its checks, then one rank's run):
    the losses of its log, on every rank."""
    import torch
    import torch.distributed as dist

    import twinpipe.train_command.cli as cli

    parser = cli.argparse.ArgumentParser()
    cli._add_arguments(parser)
    args = parser.parse_args([*argv, "--out", f"{root}/{name}", "--save-every", "0"])
    cli._check(args)
    cli._train(args, torch.device("cpu"))
    dist.barrier()
    log = json.loads((__import__("pathlib").Path(root) / name / "train-log.json").read_text())
    return [e["loss"] for e in log["steps"]]


def _cli_close(root: str, label: str, a: list[str], b: list[str], bound: float = BOUND) -> list[str]:
    """The losses of ``twinpipe train a`` and ``b``, ``bound`` apart (relative) at most."""
    first, second = _cli_losses(root, label + "-a", *a), _cli_losses(root, label + "-b", *b)
    if len(first) != STEPS or len(first) != len(second):
        return [f"{label}: {len(first)} and {len(second)} logged steps, {STEPS} expected"]
    worst = max(abs(x - y) / abs(y) for x, y in zip(first, second))
    return [f"{label}: losses {first} and {second}: {worst:.3g} apart (relative), above {bound}"] if worst > bound else []


def _hf_tokens(root: str) -> str:
    import numpy as np
    import torch.distributed as dist

    path = f"{root}/tokens.npy"
    if dist.get_rank() == 0:
        np.save(path, np.random.default_rng(0).integers(0, 128, 4000).astype(np.uint16))
    dist.barrier()
    return path


def _world(rank: int, world: int, root: str) -> dict:
    hf = ["--model", str(DATA / "tiny-qwen3-moe"), "--seq-len", "8", "--batch-size", "4", "--microbatch-size", "1",
          "--dtype", "float64", "--steps", str(STEPS), "--schedule", "1f1b", "--pp", "1", "--lr", "0.01"]
    named = [
        ("dp4-ep2", lambda: _against_reference(rank, "1f1b", 4, 1, 2, optimizer="adamw", max_norm=0.3, dp_reduce="ordered")),
        ("pp2-dp2-ep1", lambda: _against_reference(rank, "dualpipev", 2, 2, 1, max_norm=0.3)),
        ("dp4-ep2-mixed-zero1", lambda: _against_reference(rank, "1f1b", 4, 1, 2, optimizer="adamw", max_norm=0.3,
                                                           dp_reduce="ordered", precision="bf16-mixed", zero=1)),
        ("checkpoint", lambda: _checkpoint(rank, root)),
        ("bad-ep", lambda: _bad_trainer_ep(rank)),
        ("cli-gpt-dp4", lambda: _cli_close(root, "gpt-dp4", [*GPT_ARGS, "--pp", "1", "--dp", "4", "--ep", "2"],
                                           [*GPT_ARGS, "--pp", "1", "--dp", "4"])),
        ("cli-hf-dp4", lambda: _cli_close(root, "hf-dp4", [*hf, "--data", _hf_tokens(root), "--dp", "4", "--ep", "2"],
                                          [*hf, "--data", _hf_tokens(root), "--dp", "4"], HF_BOUND)),
    ]
    return run_named(named)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return run_world(WORLD, _world, str(tmp_path_factory.mktemp("ep")), timeout=400)


def _check(outcomes, name):
    problems = {r: outcomes[r][name] for r in range(WORLD) if outcomes[r][name]}
    assert not problems, problems


@pytest.mark.parametrize("case", ["dp4-ep2", "pp2-dp2-ep1", "dp4-ep2-mixed-zero1"])
def test_gpt_ep_below_dp_is_the_reference_bitwise(outcomes, case):
    _check(outcomes, case)


def test_checkpoint_written_with_ep2_loads_with_ep1_and_ep4(outcomes):
    _check(outcomes, "checkpoint")


def test_trainer_refuses_an_ep_not_dividing_dp_or_the_experts(outcomes):
    _check(outcomes, "bad-ep")


@pytest.mark.parametrize("case", ["cli-gpt-dp4", "cli-hf-dp4"])
def test_train_command_ep_matches_the_default_layout(outcomes, case):
    _check(outcomes, case)


# ---------------------------------------------------------------- bad --ep, before any rank starts
@pytest.mark.parametrize("argv, message", [
    (["--experts", "4", "--dp", "4", "--ep", "3", "--batch-size", "8"],
     "--ep=3: must divide --dp=4 (allowed are 1, 2, 4)"),
    (["--experts", "6", "--dp", "4", "--ep", "4", "--batch-size", "8"], "--ep=4: must divide --experts=6"),
    (["--dp", "2", "--ep", "2"], "--ep=2: must be 1 for a dense model (--experts 0)"),
    (["--experts", "6", "--dp", "4", "--batch-size", "8"], "--experts=6: must be a multiple of --dp=4"),
    (["--model", str(DATA / "tiny-qwen3-moe"), "--dp", "8", "--ep", "8", "--batch-size", "16", "--pp", "1"],
     "--ep=8: must divide the 4 experts"),
    (["--model", str(DATA / "tiny-llama"), "--dp", "2", "--ep", "2", "--pp", "1"], "has no MoE layers to spread"),
])
def test_bad_ep_is_refused_in_one_line_before_any_rank_starts(argv, message, capsys, tmp_path):
    import argparse

    from twinpipe.train_command.cli import add_train_parser, run_train

    args = add_train_parser(argparse.ArgumentParser().add_subparsers()).parse_args([*argv, "--out", str(tmp_path / "out")])
    assert run_train(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("twinpipe train: error:") and message in err and err.count("\n") == 1, err


def test_memory_prediction_counts_the_experts_of_an_ep_group():
    """``twinpipe train`` checks the fit before any rank starts from ``GPTRun.predict``: with ``ep`` below
    ``dp`` a rank holds experts/ep of each block, as with ``dp = ep``, more than with ``ep = dp``."""
    from twinpipe.sim.gpt import GPTRun
    from twinpipe.train.model import GPTConfig

    run = GPTRun.of(GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=2, experts=4, top_k=2), 1, dtype="float64")

    def params(dp, ep=None):
        return [r.parts.params for r in run.predict("1f1b", 1, 2, dp, ep=ep)]

    assert params(4, ep=2) == params(2) and params(4, ep=2)[0] > params(4)[0]
    with pytest.raises(ValueError, match="ep=3: must divide experts=4"):
        run.predict("1f1b", 1, 2, 6, ep=3)
