"""Training a MoE GPT (expert parallelism over each stage's data-parallel ranks) against one process.

One 4-process gloo world runs every case. The reference (``ReferenceTrainer``) runs the replicas
side by side in one process with their experts spread as the trainer spreads them (a local EP
group): each expert runs once per micro-batch on every replica's rows, in replica order, as on
its rank, so every loss, norm, weight and optimizer state is bitwise the pipeline's, on any CPU.
(Run a replica at a time instead and an expert sees fewer rows: on the AVX-512 CI machine MKL
computes the last ``rows % 4`` rows of a double-precision product with another kernel, and five
steps of MoE routing amplified those last bits to 0.02-0.6.)

The reference starts every step from the pipeline's own weights and optimizer state, after
checking them bitwise against its own: a difference is reported where it arises, one step's worth,
never amplified by later steps. Checkpoints written under one schedule, pp and dp load under
another: the loaded state is bitwise the saved one, and the next steps are the reference's.
"""

from __future__ import annotations

import pytest

from distributed import run_named, run_world
from train_setup import Case, gather_state, predicted_from_sizes, reference_state, state_differences, tiny_setup

WORLD = 4
STEPS = 5
MOE_BOUND = 3.0  # the MoE activation bound (twinpipe.sim.gpt_moe) over the measured peak, at most (docs/memory.md)


def trainer_model_config():
    """The model ``tiny_setup(..., experts=4)`` trains."""
    from twinpipe.train.model import GPTConfig

    return GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=2, experts=4, top_k=2)


CASES = [
    Case("1f1b", 2, 2, "sgd"),
    Case("dualpipev", 2, 2, "adamw", max_norm=0.3),
    Case("dualpipe", 2, 2, "sgd", max_norm=0.3),
    Case("1f1b", 1, 4, "adamw", dp_reduce="ordered"),  # EP=4: one expert per rank
    Case("dualpipe", 4, 1, "adamw", max_norm=0.3),  # EP=1
    Case("zb-h1", 2, 2, "adamw", overlap_dp=False),
]


def _follow(rank: int, trainer, ref, steps, what: str) -> list[str]:
    """Run ``trainer`` on ``steps``; before each, the reference (rank 0) checks the pipeline's state
    against its own, adopts it, and runs the step too: losses, norm and the state after it must be
    bitwise equal. Returns the problems (the same list on every rank)."""
    import torch
    import torch.distributed as dist

    problems, clipped = [], 0
    for step in steps:
        state = gather_state(trainer)
        expected = [None]
        if rank == 0:
            try:
                differ = state_differences(state, reference_state(ref))
                ref.load_state(*state)  # one step's difference, never amplified
                _, losses, norm = ref.step(step)
                expected = [(differ, losses, norm)]
            except Exception as exc:  # every rank reports it and stops here, together
                expected = [f"the reference failed at step {step}: {type(exc).__name__}: {exc}"]
        dist.broadcast_object_list(expected, src=0)
        if isinstance(expected[0], str):
            return problems + [f"{what}: {expected[0]}"]
        differ, losses, norm = expected[0]
        if differ:
            problems.append(f"{what}: before step {step}, the pipeline's state differs from the reference's: {differ[:4]}")
        got = trainer.step(step)
        if not torch.equal(got.losses, losses):
            problems.append(f"{what}: step {step}: losses {got.losses.tolist()} != reference {losses.tolist()}")
        if got.grad_norm != norm:
            problems.append(f"{what}: step {step}: gradient norm {got.grad_norm!r} != reference {norm!r}")
        if norm is not None and norm > trainer.config.max_norm:
            clipped += 1
        if not trainer.mirrors_equal():
            problems.append(f"{what}: step {step}: DualPipe's mirrored copies differ")
    state = gather_state(trainer)
    differ = [state_differences(state, reference_state(ref)) if rank == 0 else None]
    dist.broadcast_object_list(differ, src=0)
    if differ[0]:
        problems.append(f"{what}: after step {steps[-1]}, the pipeline's state differs from the reference's: {differ[0][:4]}")
    if trainer.config.max_norm is not None and clipped == 0:
        problems.append(f"{what}: clipping never acted: lower max_norm")
    return problems


def _reference(rank: int, schedule: str, dp: int, pp: int, **options):
    import torch

    from twinpipe.train.reference import ReferenceTrainer

    if rank != 0:
        return None
    model_fn, sampler, criterion, make_opt, config = tiny_setup(schedule, experts=4, **options)
    return ReferenceTrainer(model_fn, sampler, criterion, make_opt, config, dp, pp, dtype=torch.float64)


def _run_case(rank: int, case: Case) -> list[str]:
    import torch

    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import Trainer

    options = dict(optimizer=case.optimizer, max_norm=case.max_norm, dp_reduce=case.dp_reduce, overlap_dp=case.overlap_dp)
    model_fn, sampler, criterion, make_opt, config = tiny_setup(case.schedule, experts=4, **options)
    ref = _reference(rank, case.schedule, case.dp, case.pp, **options)
    trainer = Trainer(model_fn, sampler, criterion, make_opt, build_mesh(case.dp, case.pp), config, dtype=torch.float64)
    problems = _follow(rank, trainer, ref, range(STEPS), case.id)
    from twinpipe.train.memory import measured_step

    _, memory = measured_step(trainer, STEPS)  # one more step, its memory measured and predicted (docs/memory.md)
    measured, predicted = memory.measured.activations_peak, memory.predicted.activations_peak
    if not abs(measured - predicted) <= 0.1 * predicted:
        problems.append(f"activations: measured {measured} B, predicted {predicted} B, more than 10% apart")
    # From the sizes alone (twinpipe simulate --gpt --experts 4): the state exact, the activations bounded.
    cfg = trainer_model_config()
    problems += [f"from the sizes: {p}" for p in predicted_from_sizes(trainer, memory, cfg, 1, "float64", bound=MOE_BOUND)]
    if "dualpipe" in case.schedule and not any(m.fb_events for m in trainer.pipe.module):
        problems.append("no F&B op ran through the overlap engine")
    held: dict[str, set] = {}  # MoE block -> the experts this rank holds of it
    for name, _, _ in trainer.held:
        if ".experts." in name:
            block, rest = name.split(".experts.")
            held.setdefault(block, set()).add(int(rest.split(".")[0]))
    lo = trainer.mesh.dp_rank * 4 // case.dp
    for block, experts in held.items():
        if experts != set(range(lo, lo + 4 // case.dp)):
            problems.append(f"{block}: this rank holds experts {sorted(experts)}; expected {lo}..{lo + 4 // case.dp - 1}")
    return problems


def _checkpoints(rank: int, root: str) -> list[str]:
    """DualPipeV PP=2 x DP=2 saves; 1F1B PP=4 x DP=1 loads (experts gathered), saves again; DualPipe
    PP=2 x DP=2 loads that (experts spread): each loaded state is bitwise the saved one (weights and
    optimizer state), and each run goes on as the reference of its own layout goes on from it."""
    import torch
    import torch.distributed as dist

    from twinpipe.train.checkpoint import load_checkpoint, save_checkpoint
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import Trainer

    def make(schedule, dp, pp):
        fn, sampler, criterion, make_opt, config = tiny_setup(schedule, optimizer="adamw", max_norm=0.3, experts=4)
        return Trainer(fn, sampler, criterion, make_opt, build_mesh(dp, pp), config, dtype=torch.float64)

    def same_state(trainer, saved, what):
        state = gather_state(trainer)
        differ = [state_differences(state, saved) if rank == 0 else None]
        dist.broadcast_object_list(differ, src=0)
        return [f"{what}: the loaded state differs from the saved one: {differ[0][:4]}"] if differ[0] else []

    problems = []
    a = make("dualpipev", 2, 2)
    for step in range(2):
        a.step(step)
    save_checkpoint(a, f"{root}/a", 2)
    saved_a = gather_state(a)

    b = make("1f1b", 1, 4)
    if (start := load_checkpoint(b, f"{root}/a")) != 2:
        problems.append(f"loaded step {start}, saved 2")
    problems += same_state(b, saved_a, "dp=1 loading dp=2's checkpoint")
    ref = _reference(rank, "1f1b", 1, 4, optimizer="adamw", max_norm=0.3)
    if rank == 0:
        ref.load_state(*saved_a)
    problems += _follow(rank, b, ref, range(2, 4), "dp=1 after loading dp=2's checkpoint")
    save_checkpoint(b, f"{root}/b", 4)
    saved_b = gather_state(b)

    c = make("dualpipe", 2, 2)
    load_checkpoint(c, f"{root}/b")
    problems += same_state(c, saved_b, "dp=2 loading dp=1's checkpoint")
    ref = _reference(rank, "dualpipe", 2, 2, optimizer="adamw", max_norm=0.3)
    if rank == 0:
        ref.load_state(*saved_b)
    problems += _follow(rank, c, ref, range(4, 5), "dp=2 after loading dp=1's checkpoint")
    return problems


def _bad_input(rank: int, root: str) -> list[str]:
    """Errors that name the argument: dp not dividing the experts; a MoE checkpoint into a dense model."""
    import torch

    from twinpipe.train.checkpoint import load_checkpoint
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.model import GPT, GPTConfig
    from twinpipe.train.trainer import Trainer

    problems = []
    for dp, pp, experts, want in ((4, 1, 6, "dp=4: must divide 6 (allowed are 1, 2, 3, 6): the model's MoE blocks have 6 experts"),
                                  (2, 2, 3, "dp=2: must divide 3 (allowed are 1, 3): the model's MoE blocks have 3 experts")):
        fn, sampler, criterion, make_opt, config = tiny_setup("1f1b", experts=experts)
        try:
            Trainer(fn, sampler, criterion, make_opt, build_mesh(dp, pp), config, dtype=torch.float64)
            problems.append(f"dp={dp} with {experts} experts was accepted")
        except ValueError as exc:
            if want not in str(exc):
                problems.append(f"dp={dp} with {experts} experts: unclear error {exc}")
    fn, sampler, criterion, make_opt, config = tiny_setup("1f1b", optimizer="adamw", max_norm=0.3, experts=4)
    dense = Trainer(lambda: GPT(GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=2)), sampler, criterion, make_opt,
                    build_mesh(1, 4), config, dtype=torch.float64)
    try:
        load_checkpoint(dense, f"{root}/a")
        problems.append("a MoE checkpoint loaded into a dense model")
    except ValueError as exc:
        if "holds a different model" not in str(exc) or "experts" not in str(exc):
            problems.append(f"MoE checkpoint into a dense model: unclear error {exc}")
    return problems


def _world(rank: int, world: int, root: str) -> dict:
    results = {}
    named = [(case.id, lambda case=case: _run_case(rank, case)) for case in CASES]
    named += [("checkpoints", lambda: _checkpoints(rank, root)), ("bad_input", lambda: _bad_input(rank, root))]
    results.update(run_named(named))
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return run_world(WORLD, _world, str(tmp_path_factory.mktemp("moe-ckpt")), timeout=300)


def _check(outcomes, name):
    problems = {r: outcomes[r][name] for r in range(WORLD) if outcomes[r][name]}
    assert not problems, problems


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_moe_training_matches_one_process(outcomes, case):
    _check(outcomes, case.id)


def test_moe_checkpoint_loads_under_another_schedule_pp_and_dp(outcomes):
    _check(outcomes, "checkpoints")


def test_moe_bad_dp_and_checkpoint_refused_naming_the_argument(outcomes):
    _check(outcomes, "bad_input")


@pytest.mark.parametrize("kwargs, named", [
    (dict(experts=-1), "experts=-1"), (dict(experts=True), "experts=True"), (dict(experts=2.0), "experts=2.0"),
    (dict(experts=2, top_k=3), "top_k=3"), (dict(experts=4, top_k=0), "top_k=0"),
])
def test_gpt_config_refuses_bad_experts(kwargs, named):
    from twinpipe.train.model import GPTConfig

    with pytest.raises(ValueError, match=named):
        GPTConfig(**kwargs)


def test_moe_gpt_splits_into_parted_stages_that_run_it_bitwise():
    import torch

    from twinpipe.moe import MoEBlock
    from twinpipe.train.model import GPT, Block, GPTConfig
    from twinpipe.train.stages import PartedStage, Stage, split

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=2, experts=4)).double()
    assert all(isinstance(b, MoEBlock) for b in model.blocks)
    stages = split(model, 3)
    assert all(type(s) is PartedStage for s in stages)
    x = torch.randint(0, 32, (4, 8))
    out = x
    for s in stages:
        out = s(out)
    assert torch.equal(out, model(x))
    dense = GPT(GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=2))
    assert all(type(b) is Block for b in dense.blocks) and all(type(s) is Stage for s in split(dense, 2))


# ---------------------------------------------------------------- twinpipe train --experts
def _cli_args(*argv):
    import argparse

    from twinpipe.train_command.cli import add_train_parser

    return add_train_parser(argparse.ArgumentParser().add_subparsers()).parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--experts", "3", "--dp", "2", "--batch-size", "4"], "--experts=3: must be a multiple of --dp=2"),
    (["--experts", "-2"], "--experts=-2: must be >= 0"),
    (["--experts", "4", "--top-k", "5"], "--top-k=5: must be in 1..--experts (4)"),
    (["--experts", "4", "--top-k", "0"], "--top-k=0: must be in 1..--experts (4)"),
])
def test_cli_refuses_bad_experts_before_any_process_starts(argv, message, capsys):
    from twinpipe.train_command.cli import run_train

    assert run_train(_cli_args(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("twinpipe train: error:") and message in err, err


def test_cli_trains_a_moe_model():
    import json

    from documented_commands import TRAIN_MOE
    from typed import run_typed_once

    # The line tests/test_documented_commands.py runs for docs/train.md's MoE commands: typed, at the
    # console script, in a fresh folder; one run for both modules.
    done, folder = run_typed_once(TRAIN_MOE, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 experts (top-2)" in done.stdout and "bits per byte" in done.stdout, done.stdout
    log = json.loads((folder / "twinpipe-train" / "train-log.json").read_text())["steps"]
    assert [e["step"] for e in log] == [0, 1] and all(e["loss"] > 0 for e in log)
    assert (folder / "twinpipe-train" / "checkpoint-final" / ".metadata").exists()
