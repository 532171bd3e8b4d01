"""What the training tests share: a case (schedule, mesh, optimizer) and a tiny GPT with its data,
dense (``experts=0``) or MoE."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    dp: int
    optimizer: str  # "sgd" (momentum) | "adamw"
    max_norm: float | None = None
    dp_reduce: str = "all-reduce"
    steps: int | None = None  # None: the test module's own count
    overlap_dp: bool = True  # data-parallel reduction started inside the pipeline step (TrainConfig)

    @property
    def id(self) -> str:
        clip = f"-clip{self.max_norm}" if self.max_norm is not None else ""
        ordered = "-ordered" if self.dp_reduce == "ordered" else ""
        steps = f"-{self.steps}steps" if self.steps is not None else ""
        serial = "" if self.overlap_dp else "-no-overlap"
        return f"{self.schedule}-pp{self.pp}-dp{self.dp}-{self.optimizer}{clip}{ordered}{steps}{serial}"


def tiny_setup(schedule: str, seed: int = 0, max_norm=None, optimizer: str = "sgd", dp_reduce: str = "all-reduce", experts: int = 0,
               overlap_dp: bool = True, precision: str = "pure", zero: int = 0):
    """Model factory, sampler, criterion, optimizer factory and config of the training tests: a
    6-block dense GPT in micro-batches of 2, or (``experts`` > 0) a 2-block MoE GPT, top-2, in micro-batches of 1."""
    import torch

    from twinpipe.train.data import BatchSampler
    from twinpipe.train.model import GPT, GPTConfig, lm_loss
    from twinpipe.train.trainer import TrainConfig

    moe = dict(layers=2, experts=experts, top_k=2) if experts else dict(layers=6)
    cfg = GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, **moe)
    corpus = torch.randint(0, cfg.vocab, (4096,), generator=torch.Generator().manual_seed(5))
    sampler = BatchSampler(corpus, cfg.seq_len, seed=seed)

    def make_optimizer(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)

    config = TrainConfig(schedule=schedule, batch_size=8, microbatch_size=1 if experts else 2, max_norm=max_norm, seed=seed,
                         dp_reduce=dp_reduce, overlap_dp=overlap_dp, precision=precision, zero=zero)
    return (lambda: GPT(cfg)), sampler, lm_loss, make_optimizer, config


def gather_state(trainer) -> tuple[dict, dict] | None:
    """Every model parameter of ``trainer`` (by name) and its optimizer state, from the rank that owns
    it, on global rank 0 (None elsewhere). Collective: every rank calls it."""
    import torch.distributed as dist

    def clone(v):
        return v.detach().clone() if hasattr(v, "detach") else v

    getattr(trainer, "finish_update", lambda: None)()  # ZeRO-1: the last update's all-gathers

    # What the owner's optimizer updates (the FP32 master under mixed precision) and its state.
    mine = {name: (clone(t), {k: clone(v) for k, v in trainer.optimizer.state.get(t, {}).items()})
            for name, t in ((name, trainer.optimized_tensor(p)) for name, p, owned in trainer.held if owned)}
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if everyone is None:
        return None
    merged = {name: v for part in everyone for name, v in part.items()}
    return {n: p for n, (p, _) in merged.items()}, {n: s for n, (_, s) in merged.items()}


def state_differences(got: tuple[dict, dict], want: tuple[dict, dict]) -> list[str]:
    """Where two ``gather_state`` results differ, bit for bit (parameters, optimizer state entries)."""
    import torch

    problems = []
    params, states = got
    if set(params) != set(want[0]):
        return [f"parameter names differ: {sorted(set(params) ^ set(want[0]))}"]
    for name in want[0]:
        a, b = params[name], want[0][name]
        if a.dtype != b.dtype or not torch.equal(a, b):
            problems.append(f"{name}: differs by {float((a.double() - b.double()).abs().max()):.3g}")
        sa, sb = states.get(name, {}), want[1].get(name, {})
        if set(sa) != set(sb):
            problems.append(f"{name}: optimizer state keys {sorted(sa)} != {sorted(sb)}")
            continue
        for key in sa:
            x, y = sa[key], sb[key]
            same = (x.dtype == y.dtype and torch.equal(x, y)) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
            if not same:
                problems.append(f"{name}: optimizer state {key!r} differs")
    return problems


def reference_state(ref) -> tuple[dict, dict]:
    """A ``ReferenceTrainer``'s parameters (its masters under mixed precision) and optimizer state by
    name, as ``gather_state`` gives them."""
    named = ref.named_masters()
    return ({n: p.detach().clone() for n, p in named.items()},
            {n: {k: v.detach().clone() if hasattr(v, "detach") else v for k, v in ref.optimizer.state.get(p, {}).items()}
             for n, p in named.items()})


def steps_against_reference(trainer, ref, steps: int) -> list[str]:
    """Run ``steps`` steps of ``trainer`` (every rank) and of ``ref`` (the ``ReferenceTrainer`` on
    rank 0, None elsewhere); what differs: losses or norm not bitwise the reference's, mirrored copies
    not equal."""
    import torch
    import torch.distributed as dist

    problems = []
    for step in range(steps):
        got = trainer.step(step)
        want = [ref.step(step) if ref is not None else None]
        dist.broadcast_object_list(want, src=0)
        _, losses, norm = want[0]
        if not torch.equal(got.losses, losses) or got.grad_norm != norm:
            problems.append(f"step {step}: losses {got.losses.tolist()} / norm {got.grad_norm} != reference "
                            f"{losses.tolist()} / {norm}")
        if not trainer.mirrors_equal():
            problems.append(f"step {step}: mirrored copies differ")
    return problems
