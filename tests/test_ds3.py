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
from distributed import run_world
from train_setup import gather_state, reference_state, state_differences

WORLD = 4
STEPS = 3


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

    problems = []
    for step in steps:
        state, copies = gather_state(trainer), _all_buffers(trainer)
        expected = [None]
        if rank == 0:
            try:
                differ = state_differences(state, reference_state(ref))
                differ += _buffer_problems(copies, {n: b.detach() for n, b in ref.named_buffers().items()}, "before")
                ref.load_state(*state, buffers={n: found[0] for n, found in copies.items()})
                _, losses, norm = ref.step(step)
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
        if trainer.config.bias_update_speed and all(float(b.abs().sum()) == 0 for b in ref.named_buffers().values()):
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
    named += [("checkpoint", lambda: _checkpoint(rank, root))]
    for name, fn in named:
        try:
            results[name] = fn()
        except Exception as exc:
            results[name] = [f"{type(exc).__name__}: {exc}"]
        dist.barrier()
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
