"""``Trainer(stages=HFSource(...))`` on 2 ranks: a ``transformers`` causal LM with tied input/output
embeddings trains as the unsplit model does, under a V schedule (one rank holds both ends: one
tensor, ``tie="shared"``) and 1F1B (the ends on two ranks: the head has its own copy, ``"split"``);
its checkpoint stores the tied weight once and loads under either tie (AdamW: resumed bitwise).
One world for the module; each case's outcome comes back as data."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.distributed import run_world  # noqa: E402

TINY_LLAMA = Path(__file__).parent / "data" / "tiny-llama"
TIED_SCHEDULES = ("dualpipev", "1f1b")
LAYOUTS = {"dualpipev": "E,t|t|t|t,L", "1f1b": "E,t*2|t*2,L"}
STEPS, BATCH, MICRO, SEQ = 3, 4, 1, 8


def _tied_model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(TINY_LLAMA), local_files_only=True, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config).to(torch.float64)


def _sampler():
    import torch

    from twinpipe.train.data import BatchSampler

    corpus = torch.randint(0, 128, (3000,), generator=torch.Generator().manual_seed(3))
    return BatchSampler(corpus, SEQ, seed=0)


def _reference() -> tuple[list[float], list[float], dict]:
    """The unsplit model, SGD on the whole batch's mean cross entropy (the micro-batches are equal):
    losses, gradient norms (the tied weight once) and the final weights."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = _tied_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sampler, losses, norms = _sampler(), [], []
    for step in range(STEPS):
        x, y = sampler.batch(step, BATCH)
        logits = model(x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(torch.stack([p.grad.norm() for p in model.parameters()]).norm()))
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _tied_trainer(schedule: str, adam: bool = False):
    import torch

    from twinpipe.hf import HFSource, TokenLoss
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import TrainConfig, Trainer

    config = TrainConfig(schedule=schedule, batch_size=BATCH, microbatch_size=MICRO, seed=0, max_norm=1e9)
    optimizer = (lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if adam else (lambda ps: torch.optim.SGD(ps, lr=0.5))
    return Trainer(_tied_model, _sampler(), TokenLoss(), optimizer, build_mesh(1, 2), config,
                   dtype=torch.float64, stages=HFSource(str(TINY_LLAMA), LAYOUTS[schedule]))


def _adam_resumed(root: str) -> list:
    """1F1B (the head a copy on the last rank) with AdamW: a run resumed from the checkpoint of step 1
    takes step 1 bitwise as the run that did not stop (the copy's optimizer state: the embedding's)."""
    from twinpipe.train.checkpoint import load_checkpoint, save_checkpoint

    trainer = _tied_trainer("1f1b", adam=True)
    trainer.step(0)
    save_checkpoint(trainer, f"{root}/adam", 1)
    trainer.step(1)
    want = {name: p.detach().clone() for name, p, _ in trainer.held}
    trainer.pipe.close()
    trainer = _tied_trainer("1f1b", adam=True)
    load_checkpoint(trainer, f"{root}/adam")
    trainer.step(1)
    problems = [name for name, p, _ in trainer.held if not p.detach().equal(want[name])]
    trainer.pipe.close()
    return problems or "ok"


def _trained(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from twinpipe.train.checkpoint import load_checkpoint, save_checkpoint

    out, embeds = {}, {}
    for schedule in TIED_SCHEDULES:
        trainer = _tied_trainer(schedule)
        results = [trainer.step(step) for step in range(STEPS)]
        held = {}
        for name, p, _ in trainer.held:
            held.setdefault(name, p.detach().clone())
        mine = [held, trainer.stages.built.tie, len(trainer.params), len(trainer.held)]
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        save_checkpoint(trainer, f"{root}/{schedule}", STEPS)
        embeds[schedule] = next(h["model.embed_tokens.weight"] for h, *_ in everyone if "model.embed_tokens.weight" in h)
        trainer.pipe.close()
        if rank == 0:
            out[schedule] = {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
                             "ranks": everyone}
    # Each checkpoint into the other schedule's trainer (the tied ends one tensor there, or two): both
    # names hold the saved weight.
    loaded = {}
    for saved, into in zip(TIED_SCHEDULES, reversed(TIED_SCHEDULES)):
        trainer = _tied_trainer(into)
        load_checkpoint(trainer, f"{root}/{saved}")
        loaded[f"{saved} into {into}"] = [name for name, p, _ in trainer.held if name in ("model.embed_tokens.weight", "lm_head.weight")
                                          and not p.detach().equal(embeds[saved])] or "ok"
        trainer.pipe.close()
    out["loaded"] = loaded
    out["adam"] = _adam_resumed(root)
    if rank == 0:
        from torch.distributed.checkpoint import FileSystemReader

        out["stored"] = {s: sorted(k for k in FileSystemReader(f"{root}/{s}").read_metadata().state_dict_metadata
                                   if "embed_tokens" in k or "lm_head" in k) for s in TIED_SCHEDULES}
    return out


@pytest.fixture(scope="module")
def tied_world(tmp_path_factory):
    world = run_world(2, _trained, str(tmp_path_factory.mktemp("tied")), timeout=300)
    world[0]["loaded by rank"] = [r["loaded"] for r in world]
    world[0]["adam by rank"] = [r["adam"] for r in world]
    return world[0], _reference()


def test_a_tied_weight_is_stored_once_and_loads_under_either_tie(tied_world):
    """The checkpoint holds the tied weight once, under the embedding's name; a checkpoint of the
    V schedule (one tensor) loads into 1F1B's two ends and the other way round, both names bitwise."""
    got, _ = tied_world
    assert got["stored"] == {s: ["model.model.embed_tokens.weight"] for s in TIED_SCHEDULES}
    assert got["loaded by rank"] == [{"dualpipev into 1f1b": "ok", "1f1b into dualpipev": "ok"}] * 2
    assert got["adam by rank"] == ["ok", "ok"]


@pytest.mark.parametrize("schedule", TIED_SCHEDULES)
def test_tied_embeddings_train_as_the_unsplit_model(tied_world, schedule):
    import torch

    got, (losses, norms, weights) = tied_world
    run = got[schedule]
    # TokenLoss's cross entropy is float32 (the model float64): agreement to float32's precision
    assert run["losses"] == pytest.approx(losses, rel=1e-6, abs=0)
    assert run["norms"] == pytest.approx(norms, rel=1e-6, abs=0)  # the tied weight counted once
    ranks = run["ranks"]
    tie = {r[1] for r in ranks}
    assert tie == {"shared" if schedule == "dualpipev" else "split"}
    merged = {}
    for held, *_ in ranks:
        for name, value in held.items():
            merged.setdefault(name, []).append(value)
    embed, head = merged["model.embed_tokens.weight"], merged["lm_head.weight"]
    assert all(torch.equal(embed[0], t) for t in embed + head)  # the two ends are one weight, bitwise
    for name, values in merged.items():
        want = weights["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert torch.allclose(values[0], want, rtol=0, atol=1e-6), name
    if schedule == "dualpipev":  # rank 0 holds one tensor under two names, updated once
        params, held = ranks[0][2], ranks[0][3]
        assert params == held - 1
