"""The trainer's ranks agree on their whole configuration, and a non-finite step updates nothing.

One 2-process gloo world, run on two meshes: two data-parallel replicas (dp=2, pp=1) and a
two-rank pipeline (dp=1, pp=2). Agreement: for each setting, rank 1 builds its trainer with another
value; both ranks must raise ``PipelineMismatchError`` naming the setting and each rank's value,
while the trainer is being built (before any collective whose sizes depend on it: such a
difference used to abort the process in gloo, or let the replicas drift apart silently). Non-finite:
rank 1's criterion gives one NaN micro-batch (or a finite loss with a NaN gradient); every rank
skips the update (weights and optimizer state bitwise unchanged, the next step as a run that never
saw the bad batch) or, with ``on_nonfinite="raise"``, raises ``NonFiniteStepError``.
"""

from __future__ import annotations

import pytest

from distributed import run_world
from train_setup import tiny_setup

WORLD = 2
MESHES = ((2, 1), (1, 2))

# (case, what rank 1 changes, the fact named in the error, rank 0's value, rank 1's value)
AGREEMENT = [
    ("batch_size", dict(batch_size=16), "batch_size", "8", "16"),
    ("microbatch_size", dict(microbatch_size=1), "microbatch_size", "2", "1"),
    ("max_norm_set", dict(max_norm=1.0), "max_norm", "None", "1.0"),
    ("max_norm_value", dict(max_norm=2.0, base_max_norm=1.0), "max_norm", "1.0", "2.0"),
    ("balance", dict(balance="time"), "balance", "params", "time"),
    ("seed", dict(seed=1), "seed", "0", "1"),
    ("timeout", dict(timeout=90.0), "timeout", "60.0", "90.0"),
    ("dp_reduce", dict(dp_reduce="ordered"), "dp_reduce", "all-reduce", "ordered"),
    ("overlap_dp", dict(overlap_dp=False), "overlap_dp", "True", "False"),
    ("on_nonfinite", dict(on_nonfinite="raise"), "on_nonfinite", "skip", "raise"),
    ("schedule", dict(schedule="gpipe"), "schedule", "1f1b", "gpipe"),
    ("schedule_options", dict(schedule_options=(("stages_per_rank", 4),), base_schedule="interleaved-1f1b",
                              base_schedule_options=(("stages_per_rank", 2),)),
     "schedule_options", "[('stages_per_rank', 2)]", "[('stages_per_rank', 4)]"),
    ("dtype", dict(dtype="float32"), "dtype", "torch.float64", "torch.float32"),
    ("model_shapes", dict(dim=16), "model parameters", None, None),
    ("model_config", dict(heads=4), "model config.heads", "2", "4"),
    ("criterion", dict(criterion="other"), "criterion", "twinpipe.train.model.lm_loss", "test_train_safety.other_loss"),
    ("optimizer_class", dict(optimizer="sgd"), "optimizer", "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD"),
    ("lr", dict(lr=2e-2), "optimizer param_groups[0].lr", "0.01", "0.02"),
    ("betas", dict(betas=(0.8, 0.999)), "optimizer param_groups[0].betas", "(0.9, 0.999)", "(0.8, 0.999)"),
]


def other_loss(output, labels):
    from twinpipe.train.model import lm_loss

    return lm_loss(output, labels)


def _build(mesh, changes: dict, criterion=None):
    """A trainer of the tiny GPT (1F1B, AdamW, float64, timeout 60 s: room for a busy machine) with ``changes`` applied:
    ``base_<key>`` entries apply to every rank, the others (rank 1's) override them."""
    import dataclasses

    import torch

    from twinpipe.train.model import GPT, GPTConfig
    from twinpipe.train.trainer import Trainer

    c = {k[len("base_"):]: v for k, v in changes.items() if k.startswith("base_")}
    c.update((k, v) for k, v in changes.items() if not k.startswith("base_"))
    optimizer = c.pop("optimizer", "adamw")
    fn, sampler, lm_loss, make_opt, config = tiny_setup(c.pop("schedule", "1f1b"), optimizer=optimizer)
    lr, betas = c.pop("lr", 1e-2), c.pop("betas", (0.9, 0.999))
    if optimizer == "adamw":
        make_opt = lambda ps: torch.optim.AdamW(ps, lr=lr, betas=betas, weight_decay=0.01)  # noqa: E731
    dtype = getattr(torch, c.pop("dtype", "float64"))
    shape = {k: c.pop(k) for k in ("dim", "heads") if k in c}
    if shape:
        fn = lambda: GPT(GPTConfig(**{**dict(vocab=32, seq_len=8, dim=8, heads=2, layers=6), **shape}))  # noqa: E731
    if c.pop("criterion", None) == "other":
        lm_loss = other_loss
    config = dataclasses.replace(config, **{"timeout": 60.0, **c})
    return Trainer(fn, sampler, criterion or lm_loss, make_opt, mesh, config, dtype=dtype)


def _world(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.model import lm_loss

    results: dict = {}
    meshes = {shape: build_mesh(*shape) for shape in MESHES}

    def case(name, fn):
        try:
            results[name] = fn()
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}"
        dist.barrier()

    def long_facts():  # more than one frame on one rank only: every rank runs as many rounds as the longest
        from twinpipe.train.agreement import gather_json

        mine = {"rank": rank, "text": "x" * (7000 if rank == 1 else 10)}
        said = gather_json(dist.group.WORLD, mine, 60.0, "test")
        return "ok" if said == [{"rank": 0, "text": "x" * 10}, {"rank": 1, "text": "x" * 7000}] else f"gathered {str(said)[:200]}"

    case("long_facts", long_facts)
    for (dp, pp), mesh in meshes.items():
        case(f"alike-dp{dp}pp{pp}", lambda: _build(mesh, {}).step(0).loss > 0 and "ok")
        # The same values written differently (an int and a float) are the same setting.
        same = dict(timeout=60, max_norm=1, lr=1) if rank == 0 else dict(timeout=60.0, max_norm=1.0, lr=1.0)
        case(f"equivalent-dp{dp}pp{pp}", lambda: _build(mesh, same).step(0).loss > 0 and "ok")
        for name, changes, *_ in AGREEMENT:
            base = {k: v for k, v in changes.items() if k.startswith("base_")}
            case(f"{name}-dp{dp}pp{pp}", lambda: _build(mesh, changes if rank == 1 else base) and "built")

    # Non-finite steps: rank 1's criterion spoils one micro-batch of step 1.
    armed = {"on": False, "how": "nan"}

    def criterion(output, labels):
        loss = lm_loss(output, labels)
        if armed["on"] and rank == 1:
            armed["on"] = False
            if armed["how"] == "nan":
                return loss * float("nan")
            return loss + 0.0 * torch.sqrt(output - output.detach()).sum()  # finite, but its gradient is NaN
        return loss

    def held(trainer):
        return {name: p.detach().clone() for name, p, _ in trainer.held}

    def opt_state(trainer):
        return [{k: v.clone() for k, v in trainer.optimizer.state[p].items()} for p in trainer.params]

    def nonfinite(mesh, how, **changes):
        trainer = _build(mesh, changes, criterion=criterion)
        trainer.step(0)
        before, state = held(trainer), opt_state(trainer)
        armed.update(on=True, how=how)
        problems = []
        try:
            result = trainer.step(1)
        except Exception as exc:
            result = f"{type(exc).__name__}: {exc}"
        if isinstance(result, str):
            problems.append(result)
        elif not getattr(result, "skipped", False) or getattr(trainer, "skipped_steps", None) != 1:
            problems.append(f"step 1 not skipped (skipped={getattr(result, 'skipped', '?')}, "
                            f"skipped_steps={getattr(trainer, 'skipped_steps', '?')})")
        if any(not torch.equal(p, before[n]) for n, p in held(trainer).items()):
            problems.append("weights changed")
        if any(set(a) != set(b) or any(not torch.equal(a[k], b[k]) for k in a) for a, b in zip(opt_state(trainer), state)):
            problems.append("optimizer state changed")
        after = trainer.step(2)
        twin = _build(mesh, changes, criterion=criterion)  # a run that never saw step 1
        twin.step(0)
        expected = twin.step(2)
        if getattr(after, "skipped", False) or after.loss != expected.loss or any(not torch.equal(p, held(twin)[n]) for n, p in held(trainer).items()):
            problems.append(f"the next step differs from a run without the bad step ({after.loss!r} vs {expected.loss!r})")
        out = {"problems": problems}
        if not isinstance(result, str):
            out.update(loss=result.loss, grad_norm=result.grad_norm)
        return out

    for (dp, pp), mesh in meshes.items():
        case(f"nan-loss-dp{dp}pp{pp}", lambda: nonfinite(mesh, "nan"))
        case(f"nan-loss-clipped-dp{dp}pp{pp}", lambda: nonfinite(mesh, "nan", max_norm=1.0))
        case(f"nan-grad-dp{dp}pp{pp}", lambda: nonfinite(mesh, "grad"))
        case(f"raise-dp{dp}pp{pp}", lambda: nonfinite(mesh, "nan", on_nonfinite="raise"))
        case(f"raise-grad-clipped-dp{dp}pp{pp}", lambda: nonfinite(mesh, "grad", on_nonfinite="raise", max_norm=1.0))
    return results


@pytest.fixture(scope="module")
def outcomes():
    return run_world(WORLD, _world, timeout=500)


def _all(outcomes, name):
    return {r: outcomes[r][name] for r in range(WORLD)}


def test_settings_longer_than_one_frame_are_gathered_whole(outcomes):
    assert set(_all(outcomes, "long_facts").values()) == {"ok"}, _all(outcomes, "long_facts")


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"dp{m[0]}pp{m[1]}")
@pytest.mark.parametrize("name", ["alike", "equivalent"])
def test_trainers_built_alike_agree(outcomes, mesh, name):
    assert set(_all(outcomes, f"{name}-dp{mesh[0]}pp{mesh[1]}").values()) == {"ok"}, _all(outcomes, f"{name}-dp{mesh[0]}pp{mesh[1]}")


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"dp{m[0]}pp{m[1]}")
@pytest.mark.parametrize("name, changes, fact, mine, theirs", AGREEMENT, ids=[a[0] for a in AGREEMENT])
def test_a_rank_configured_differently_is_refused_on_every_rank_naming_the_setting(outcomes, mesh, name, changes, fact, mine, theirs):
    for message in _all(outcomes, f"{name}-dp{mesh[0]}pp{mesh[1]}").values():
        assert message.startswith("PipelineMismatchError: rank dp=") and "building the trainer: the ranks are configured differently" in message, message
        if mine is None:
            assert f"{fact} (rank 0: " in message and "; rank 1: " in message, message
        else:
            assert f"{fact} (rank 0: {mine}; rank 1: {theirs})" in message, message


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"dp{m[0]}pp{m[1]}")
@pytest.mark.parametrize("name", ["nan-loss", "nan-loss-clipped", "nan-grad"])
def test_a_non_finite_step_is_skipped_on_every_rank_and_changes_nothing(outcomes, mesh, name):
    import math

    for outcome in _all(outcomes, f"{name}-dp{mesh[0]}pp{mesh[1]}").values():
        assert isinstance(outcome, dict) and outcome["problems"] == [], outcome
        assert math.isnan(outcome["loss"]) == (name != "nan-grad"), outcome  # a NaN gradient can come from a finite loss
        assert (outcome["grad_norm"] is None) == (name != "nan-loss-clipped") and (outcome["grad_norm"] is None or math.isnan(outcome["grad_norm"]))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"dp{m[0]}pp{m[1]}")
@pytest.mark.parametrize("name, what", [("raise", "the loss of global micro-batch(es) "),
                                        ("raise-grad-clipped", "the gradient norm (nan; not finite in ")])
def test_on_nonfinite_raise_raises_on_every_rank_and_changes_nothing(outcomes, mesh, name, what):
    for outcome in _all(outcomes, f"{name}-dp{mesh[0]}pp{mesh[1]}").values():
        problems = outcome["problems"] if isinstance(outcome, dict) else [outcome]
        assert len(problems) == 1 and problems[0].startswith("NonFiniteStepError: rank dp=") and "step 1: not finite: " in problems[0], problems
        assert what in problems[0] and "Nothing was updated on any rank (on_nonfinite='raise'" in problems[0], problems
