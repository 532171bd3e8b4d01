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
               overlap_dp: bool = True):
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
                         dp_reduce=dp_reduce, overlap_dp=overlap_dp)
    return (lambda: GPT(cfg)), sampler, lm_loss, make_optimizer, config
