"""Check a parallel plan on a small float64 copy of the user's model: ``twinpipe check``.

``check_plan`` builds the small copy of the model of a folder's ``config.json`` that the self-check
builds (``twinpipe.hf.self_check.small_copy``: widths shrunk, every layer kept, float64, random
weights from a seed; DeepSeek-V3's routing biases drawn too), and trains one step of it with
``twinpipe.train.Trainer`` on CPU ranks it starts itself (gloo), split as asked: ``pp`` pipeline
ranks under ``schedule``, ``dp`` data-parallel replicas, the MoE experts spread over them with
``ep = dp``: the very code ``twinpipe train --model`` runs. Every rank also runs the unsplit copy
on each micro-batch of the same global batch, in order, adds the gradients up and divides them by
the number of micro-batches, as the trainer defines its step. Per group of parameters it reports
the largest difference of the gradients, relative to the largest magnitude of the unsplit model's
gradient in the group, and the same for the micro-batches' losses; ``BOUNDS`` says how far each
may be (the one place; docs/hf.md shows it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import MappingProxyType

from twinpipe.checks import DEFAULT_TIMEOUT

__all__ = ["BOUNDS", "GROUPS", "PlanRequest", "PlanRow", "check_plan", "combine", "format_report", "group_of", "rank_differences", "small_model"]

# Float64 throughout: a split run adds the same float64 numbers as the unsplit model in another order
# (DualPipe's two copies after each its own micro-batches, the data-parallel all-reduce, expert
# parallelism's all-to-all handing an expert the rows of several replicas in one product). A reordered
# sum of n float64 terms moves by at most about n * 2**-53 of the sum of their magnitudes; the sums
# of a small copy have at most a few hundred terms: 1e-12 of the largest value leaves a margin, and
# a wrong scaling (a factor 2 or 1/2) misses it by eleven orders of magnitude.
BOUNDS = MappingProxyType({"loss": 1e-12, "gradients": 1e-12})

# The parameter groups, in the order the report lists them: the first pattern a parameter's name
# (in the unsplit model) matches names its group.
GROUPS = (
    ("embeddings", r"embed_tokens"),
    ("head", r"^lm_head\."),
    ("routed experts", r"\.experts\.|\.experts$"),
    ("shared experts", r"shared_expert"),
    ("router", r"\.(gate|router)\.(weight|bias)$|\.router\."),
    ("attention", r"\.self_attn\."),
    ("norms", r"norm\.(weight|bias)$|norm$"),
    ("dense MLP", r"\.mlp\.|\.block_sparse_moe\."),
)


def group_of(name: str) -> str:
    """The group of a parameter of the unsplit model, by its name (``GROUPS``); ``"other"`` when none fits."""
    return next((group for group, pattern in GROUPS if re.search(pattern, name)), "other")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to check: the model folder, the schedule on ``pp`` ranks, ``dp`` replicas with the experts
    spread over them when ``ep == dp > 1``, micro-batches per pipeline, rows per micro-batch, tokens per
    row, the seed of the weights and the batch, each wait's limit in seconds."""

    folder: str
    schedule: str
    pp: int
    dp: int = 1
    ep: int = 1
    microbatches: int = 4
    rows: int = 1
    seq_len: int = 8
    seed: int = 0
    timeout: float = DEFAULT_TIMEOUT


@dataclass(frozen=True)
class PlanRow:
    """One line of the report: a group, its largest relative difference, the bound, the parameters counted."""

    group: str
    difference: float
    bound: float
    parameters: int

    @property
    def within(self) -> bool:
        return self.difference <= self.bound  # NaN is not within


def check_plan(request: PlanRequest) -> list[PlanRow]:
    """Train one step of the small copy split as ``request`` asks and unsplit; the report's rows
    (``"loss"`` first, then each group of parameters present). Starts ``pp * dp`` local ranks."""
    from twinpipe.launch import run_local

    return combine(run_local(request.pp * request.dp, rank_differences, request, timeout=request.timeout * 4 + 60))


def combine(results: list) -> list[PlanRow]:
    """The report's rows from every rank's ``rank_differences``: per group the largest difference
    over the largest magnitude of the unsplit model's values, on any rank."""
    worst: dict[str, list] = {}  # group -> [largest difference, largest reference magnitude, parameter names]
    for rank_rows in results:
        for group, difference, scale, names in rank_rows:
            entry = worst.setdefault(group, [0.0, 0.0, set()])
            entry[0] = difference if math.isnan(difference) else max(entry[0], difference)  # NaN stays NaN
            entry[1] = max(entry[1], scale)
            entry[2].update(names)
    order = ["loss", *(group for group, _ in GROUPS), "other"]
    return [PlanRow(g, worst[g][0] / (worst[g][1] or 1.0), BOUNDS["loss" if g == "loss" else "gradients"], len(worst[g][2]))
            for g in order if g in worst]


def format_report(request: PlanRequest, rows: list[PlanRow]) -> str:
    """The report as text: one line per row, the verdict last."""
    plan = f"--schedule {request.schedule} --pp {request.pp} --dp {request.dp} --ep {request.ep}"
    lines = [f"twinpipe check: {request.folder}, {plan}, {request.microbatches} micro-batches, float64",
             f"{'group':<16} {'largest difference':>19} {'bound':>8}  verdict"]
    for row in rows:
        what = "loss" if row.group == "loss" else f"{row.group} ({row.parameters})"
        lines.append(f"{what:<16} {row.difference:>19.3g} {row.bound:>8.0e}  {'ok' if row.within else 'EXCEEDED'}")
    bad = [row.group for row in rows if not row.within]
    lines.append(f"exceeded: {', '.join(bad)}" if bad else "every difference is within its bound")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ one rank
def small_model(folder: str, seed: int):
    """The small float64 copy of the folder's model (``self_check.small_copy``, the first of its sizes
    that builds), with DeepSeek-V3's routing biases drawn too; and how it was made."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from twinpipe.hf.self_check import SIZES, small_copy
    from twinpipe.moe.bias import HF_BIAS

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        shape = AutoModelForCausalLM.from_config(config)
    problems = []
    for size in SIZES:
        try:
            tiny, how = small_copy(shape, size, seed=seed)
            break
        except Exception as error:  # this size does not build: try the next
            problems.append(f"hidden_size={size['hidden_size']}: {type(error).__name__}: {error}")
    else:
        raise ValueError(f"--model={folder!r}: no small copy of it builds ({'; '.join(problems)})")
    with torch.no_grad():  # zero at initialisation: they would not steer the group-limited routing
        for name, buffer in tiny.named_buffers():
            if name.endswith(HF_BIAS):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return tiny, how


def rank_differences(rank: int, world: int, request: PlanRequest) -> list:
    """One rank's share of ``check_plan`` (collective: every rank of the world runs it): per group of
    the parameters it holds ``(group, largest difference, largest unsplit magnitude, names)``; the
    losses' too on the first rank."""
    import torch

    from twinpipe.hf import model_parts
    from twinpipe.hf.training import HFSource, TokenLoss
    from twinpipe.train.data import BatchSampler
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import TrainConfig, Trainer

    mesh = build_mesh(request.dp, request.pp, "cpu")
    tiny, _ = small_model(request.folder, request.seed)
    aux = model_parts(tiny, untested=True).aux
    tokens = torch.randint(0, int(tiny.config.vocab_size), (4096,), generator=torch.Generator().manual_seed(request.seed))
    sampler = BatchSampler(tokens, request.seq_len, seed=request.seed)
    batch_size = request.dp * request.microbatches * request.rows
    config = TrainConfig(schedule=request.schedule, batch_size=batch_size, microbatch_size=request.rows,
                         seed=request.seed, timeout=request.timeout, ep=request.ep)
    source = HFSource(request.folder, ep_group=mesh.expert_groups(request.ep).ep_group)
    trainer = Trainer(lambda: small_model(request.folder, request.seed)[0], sampler, TokenLoss(aux),
                      lambda params: torch.optim.SGD(params, lr=0.0), mesh, config, dtype=torch.float64, stages=source)
    result = trainer.step(0)
    want_losses, want_grads = _unsplit(tiny, sampler.batch(0, batch_size), request, TokenLoss(aux))
    rows = [("loss", *_difference(result.losses, want_losses), ())] if rank == 0 else []
    return rows + _grad_rows(trainer.pipe.module, want_grads)


def _unsplit(model, batch, request: PlanRequest, criterion) -> tuple:
    """The unsplit model on each micro-batch of the global batch, in order (replica by replica): its
    losses, and its gradients by name, summed and divided by the number of micro-batches."""
    import torch

    x, y = batch
    count = request.dp * request.microbatches
    losses = []
    for rows in torch.tensor_split(torch.arange(x.shape[0]), count):
        out = model(input_ids=x[rows], attention_mask=torch.ones_like(x[rows]))
        loss = criterion(out.logits, y[rows]) if criterion.aux is None else _with_aux(out, y[rows], criterion)
        loss.backward()
        losses.append(loss.detach().double())
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)) / count
             for name, p in model.named_parameters(remove_duplicate=False)}
    return torch.stack(losses), grads


def _with_aux(out, labels, criterion):
    """``TokenLoss`` with the router auxiliary loss the model's own forward computes."""
    import torch.nn.functional as F

    _, _, coef = criterion.aux
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)) + coef * out.aux_loss


def _grad_rows(modules, want: dict) -> list:
    """``(group, largest |got - want|, largest |want|, names)`` for this rank's stages; a sharded expert
    tensor is compared with its rows of the unsplit one."""
    import torch

    from twinpipe.hf.experts import expert_rows
    from twinpipe.runtime.main_grad import grad_of

    groups: dict[str, list] = {}
    for module in modules:
        rows = expert_rows(module)
        for name, p in module.named_model_parameters():
            got = grad_of(p)
            got = torch.zeros_like(p) if got is None else got
            ref = want[name] if id(p) not in rows else want[name][list(rows[id(p)])]
            difference, scale = _difference(got, ref)
            entry = groups.setdefault(group_of(name), [0.0, 0.0, set()])
            entry[0] = difference if math.isnan(difference) else max(entry[0], difference)
            entry[1] = max(entry[1], scale)
            entry[2].add(name)
    return [(group, *entry) for group, entry in groups.items()]


def _difference(got, want) -> tuple[float, float]:
    """``(largest |got - want|, largest |want|)`` in float64; NaN anywhere in ``got`` gives NaN."""
    got, want = got.double(), want.double()
    difference = (got - want).abs().max() if got.numel() else got.new_zeros(())
    return float(difference), float(want.abs().max()) if want.numel() else 0.0
