"""Held-out evaluation: the model's next-token loss on batches it does not train on, through the same
pipeline (forward-only steps under ``torch.no_grad()``: only the schedule's F ops run).

Nothing of training moves: no gradient, no optimizer state, no routing bias or expert load (routers
count loads only in training mode with grad on), no random number drawn (dropout is off: every
stage module is in eval mode for the call, its mode restored after). The loss is the mean next-token
cross entropy over every token of the batches (every micro-batch holds as many tokens, so the mean of
the micro-batches' means), the plain language-model loss: no MTP, balance or auxiliary term;
perplexity is ``exp(loss)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from twinpipe.checks import check_int
from twinpipe.train.data import BatchSampler, replica_rows
from twinpipe.train.grads import sum_across
from twinpipe.train.model import lm_loss

__all__ = ["HeldOutBatches", "EvalResult", "evaluate", "next_token_loss"]


class HeldOutBatches(BatchSampler):
    """Batch ``k`` of ``rows`` sequences: the file's consecutive windows ``k * rows`` .. ``(k + 1) * rows - 1``
    (window ``i`` starts at token ``i * seq_len``): the same batches every time, none drawn at random."""

    def batch(self, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        last = (step + 1) * rows * self.seq_len  # the last window's label is token ``last``
        if last >= self.size:
            raise ValueError(f"held-out batch {step} of {rows} rows x {self.seq_len} tokens needs {last + 1} tokens; "
                             f"the data has {self.size}")
        return self.windows(torch.arange(step * rows, (step + 1) * rows) * self.seq_len)

    @staticmethod
    def tokens_needed(batches: int, rows: int, seq_len: int) -> int:
        """Tokens ``batches`` batches of ``rows`` windows read."""
        return batches * rows * seq_len + 1


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean next-token cross entropy (nats) over every held-out token
    perplexity: float  # exp(loss)
    losses: torch.Tensor  # per global micro-batch of every batch, in order (float64)


def next_token_loss(logits: torch.Tensor, *rest) -> torch.Tensor:
    """One micro-batch's mean next-token cross entropy: the last stage's logits against the labels
    (``rest[-1]``), whatever else the stage outputs (MTP hidden states, router sums)."""
    return lm_loss(logits, rest[-1])


def evaluate(trainer, batches: BatchSampler, count: int) -> EvalResult:
    """The mean next-token loss of ``trainer``'s model on ``batches.batch(k, batch_size)`` for k in
    ``0..count-1`` (collective: every rank of the mesh calls it alike, between steps)."""
    check_int(count, "count", low=1)
    mesh, m = trainer.mesh, trainer.num_chunks
    size, pipe = trainer.config.batch_size, trainer.pipe
    rows = replica_rows(size, mesh.dp, mesh.dp_rank)
    per_batch = mesh.dp * m
    losses = torch.zeros(count * per_batch, dtype=torch.float64, device=pipe.device)
    mine = torch.tensor(list(trainer.layout.label_microbatches), dtype=torch.long) + mesh.dp_rank * m
    trainer.finish_update()  # ZeRO-1: the last update's weights gathered
    with _eval_mode(pipe.module), torch.no_grad():
        for k in range(count):
            x, y = batches.batch(k, size)
            inputs, labels = trainer.source.batch(trainer.layout, x[rows].to(pipe.device), y[rows].to(pipe.device))
            loss, _ = pipe.step(*inputs, num_chunks=m, criterion=next_token_loss, labels=labels)
            if loss is not None:
                losses[(mine + k * per_batch).to(pipe.device)] = loss.to(torch.float64)
    where = f"{trainer.rank_name}: held-out evaluation"
    sum_across(losses, mesh.pp_group, trainer.timeout, f"{where}: losses over the pipeline")
    sum_across(losses, mesh.dp_group, trainer.timeout, f"{where}: losses over data-parallel replicas")
    losses = losses.cpu()
    loss = float(losses.mean())
    return EvalResult(loss, math.exp(loss) if loss < 700 else math.inf, losses)


class _eval_mode:
    """Every module of ``module`` in eval mode inside the block, each back to its own mode after."""

    def __init__(self, module: nn.Module):
        self.modes = [(m, m.training) for m in module.modules()]

    def __enter__(self):
        for m, _ in self.modes:
            m.training = False

    def __exit__(self, *exc):
        for m, training in self.modes:
            m.training = training
