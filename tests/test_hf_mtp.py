"""twinpipe.hf with DeepSeek-V3's multi-token prediction: ``build(..., mtp_depth=D)`` exact against the
unsplit model plus the same MTP layers in one process (losses bitwise, gradients within 1e-13, float64)
under dualpipev, dualpipe and 1f1b on 2 ranks; the MTP tensors saved under DeepSeek-V3's checkpoint
names and read back; ``Trainer(stages=HFSource(..., mtp_depth=D))``'s first loss equal to the
reference. One 2-rank world for the module."""

from __future__ import annotations

import copy
from pathlib import Path

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


def _reference(depth: int = DEPTH, weight: float = WEIGHT, seed: int = 1) -> tuple[list, dict]:
    """The unsplit model on each micro-batch (of the batch drawn from ``seed``), plus the same MTP
    layers (``mtp_layers``, seed 0) run on its last hidden state before ``model.norm``: per
    micro-batch ``L_main + weight / D * sum_k L_k``, and every gradient by name (the embedding copy's
    is the embedding's)."""
    from twinpipe.hf.mtp import depth_context, mtp_layers

    model = _model()
    layers = mtp_layers(model, depth)
    ids, mask, labels = hf_models.batch(CHUNKS, SEQ, seed=seed)
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


def _ep(group, schedule: str = "dualpipev") -> str:
    """MTP depth 1 with expert parallelism: the model's experts spread over the 2 ranks (EP=2,
    ``shard_experts_``), each rank a one-rank DualPipeV pipeline (both stages; the layers in parts,
    F&B ops running their all-to-alls) training its own batch; or a one-rank ``schedule`` (zb-h1:
    B and W apart, no F&B op). The MTP layer's MoE block holds half of the experts too (the build
    spreads them as the main layers'), and runs as parts of the last stage (tests/test_mtp_fb.py:
    in the F&B ops' part order). Losses and gradients within EP_BOUND (tests/hf_models.py: the
    all-to-all reorders sums) of the unsplit model plus the same MTP layer, losses on the rank's
    batch, gradients summed over the two batches (dense ones summed over the EP pair, experts'
    assembled from both ranks)."""
    import torch.distributed as dist

    from twinpipe.hf.experts import EPMoE, shard_experts_
    from twinpipe.hf.moe_layer import wrap_layer
    from twinpipe.moe import reduce_dense_grads

    rank = dist.get_rank(group)
    pp_group = [dist.new_group([0]), dist.new_group([1])][rank]
    ref_losses, ref_grads = _reference(depth=1, seed=1 + rank)
    for g in {id(g): g for g in ref_grads.values()}.values():  # (the embedding copy's is the embedding's tensor)
        dist.all_reduce(g, group=group)  # the two ranks' batches together
    model = shard_experts_(_model(), group)
    stages = hf.build(model, schedule, 1, 0, mtp_depth=1, mtp_weight=WEIGHT, wrap_layer=wrap_layer)
    last = next(m for m in stages.modules if m.last)
    problems = []
    block = last.mtp[0].mlp
    if not isinstance(block, EPMoE) or block.rows != tuple(range(4 * rank, 4 * rank + 4)):
        problems.append(f"the MTP layer's MoE block: {type(block).__name__} with experts {getattr(block, 'rows', 'all')}")
    if not all(isinstance(m, hf.HFPartedStage) for m in stages.modules):
        problems.append(f"stages {[type(m).__name__ for m in stages.modules]}, not in parts")
    ids, mask, labels = hf_models.batch(CHUNKS, SEQ, seed=1 + rank)
    with stages.pipeline(pp_group, timeout=60) as pipe:
        inputs, labs = stages.batch(ids, mask, labels, num_chunks=CHUNKS)
        loss, _ = pipe.step(*inputs, num_chunks=CHUNKS, criterion=stages.criterion, labels=labs)
        stages.sync_grads(pipe)
    events = [e for m in stages.modules for e in m.fb_events]
    if schedule == "dualpipev" and not any(action == "start" for e in events for action, *_ in e):
        problems.append(f"{len(events)} F&B ops, none with an all-to-all")
    want = torch.stack(ref_losses)
    if not hf_models.rel(loss, want) <= hf_models.EP_BOUND:
        problems.append(f"losses off by {hf_models.rel(loss, want):.3g}")
    reduce_dense_grads(torch.nn.ModuleList(stages.modules), group)  # once each: both stages hold the embedding

    def summed(t):
        dist.all_reduce(t, group=group)
        return t

    layers = [layer for m in stages.modules for layer in [*m.layers.values(), *getattr(m, "mtp", ())]]
    blocks = {f"model.layers.{layer.index}.mlp": layer.mlp for layer in layers}
    for module in stages.modules:
        for name, p in module.named_model_parameters():
            if ".experts." in name:
                got = hf_models.full_expert_grads(blocks[name.rsplit(".experts.", 1)[0]], name.rsplit(".", 1)[1], summed)
            else:
                got = p.grad if p.grad is not None else torch.zeros_like(p)
            if not hf_models.rel(got, ref_grads[name]) <= hf_models.EP_BOUND:
                problems.append(f"{name} gradient off by {hf_models.rel(got, ref_grads[name]):.3g}")
    return "; ".join(problems[:6]) or "ok"


def _is_mtp(name: str, n: int) -> bool:
    return name.startswith("model.layers.") and int(name.split(".")[2]) >= n


def _saved(root: Path, group) -> str:
    """Stages with D MTP layers (values unlike their initial ones) saved from 2 ranks: DeepSeek-V3's
    checkpoint names on disk, ``from_pretrained`` loads the main model bitwise, and stages built with
    other initial MTP weights read every tensor back bitwise."""
    import zlib

    import torch.distributed as dist
    from safetensors import safe_open

    from twinpipe.hf.mtp import load_places, save_tensors
    from twinpipe.hf.weights import load, save

    rank = dist.get_rank(group)
    model = _model()
    n = model.config.num_hidden_layers
    config = copy.deepcopy(model.config)
    config.num_nextn_predict_layers = DEPTH  # the depths a checkpoint stores
    stages = hf.build(model, "1f1b", 2, rank, mtp_depth=DEPTH)
    with torch.no_grad():
        for m in stages.modules:
            for name, p in m.named_model_parameters():
                if _is_mtp(name, n) and not name.endswith("embed_tokens.weight"):
                    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    mine = save_tensors(stages.modules)
    out = root / "saved"
    save(out, mine, config, group=group, timeout=120)
    problems = []
    if rank == 0:
        keys = set()
        for file in out.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                keys |= set(f.keys())
        for k in range(DEPTH):
            for sub in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
                        "embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight", "mlp.experts.0.gate_proj.weight",
                        "mlp.gate.e_score_correction_bias"):
                if f"model.layers.{n + k}.{sub}" not in keys:
                    problems.append(f"no key model.layers.{n + k}.{sub} on disk")
        from transformers import AutoModelForCausalLM

        back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64)
        ref = dict(_model().named_parameters())
        differ = [name for name, p in back.named_parameters() if not torch.equal(p, ref[name])]
        if differ:
            problems.append(f"from_pretrained: {len(differ)} tensors differ (first {differ[0]})")
    dist.barrier(group)
    again = hf.build(_model(), "1f1b", 2, rank, mtp_depth=DEPTH, mtp_seed=1)
    names = [name for m in again.modules for name, _ in m.named_model_parameters()]
    tensors = load(out, load_places(out, names, DEPTH))
    for name in names:
        if not torch.equal(tensors[name], mine[name]):
            problems.append(f"{name}: read back differs")
    if any(m.last for m in again.modules):
        head = mine["lm_head.weight"]
        extra = load(out, [f"model.layers.{n + k}.shared_head.head.weight" for k in range(DEPTH)])
        if not all(torch.equal(t, head) for t in extra.values()):
            problems.append("shared_head.head on disk is not lm_head")
    return "; ".join(problems[:6]) or "ok"


def _saved_ep(root: Path, group) -> str:
    """Stages with D MTP layers and their experts spread over EP=2 (each rank a one-rank pipeline;
    values unlike the initial ones) saved from 2 ranks, each writing its expert rows: every expert of
    every MoE layer, the MTP layers' included, on disk under DeepSeek-V3's names with the values
    trained; ``from_pretrained`` loads the main model bitwise; ``HFSource(..., ep_group=, mtp_depth=D,
    weights=True)`` (the trainer's) reads each rank's rows back bitwise."""
    import zlib

    import torch.distributed as dist

    from twinpipe.hf import HFSource
    from twinpipe.hf.experts import EPMoE, expert_places, shard_experts_
    from twinpipe.hf.mtp import save_tensors
    from twinpipe.hf.weights import load, save
    from twinpipe.schedule.spec import resolve

    rank = dist.get_rank(group)
    model = _model()
    n = model.config.num_hidden_layers
    config = copy.deepcopy(model.config)
    config.num_nextn_predict_layers = DEPTH
    stages = hf.build(shard_experts_(model, group), "1f1b", 1, 0, mtp_depth=DEPTH)
    (stage,) = stages.modules
    rows = {id(stage.get_parameter(local)): place.rows for local, place in expert_places(stage).items()}
    full = {}  # name -> the whole tensor this test gives every rank alike
    with torch.no_grad():
        for name, p in stage.named_model_parameters():
            if _is_mtp(name, n) and not name.endswith("embed_tokens.weight"):
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                shape = (model.config.n_routed_experts, *p.shape[1:]) if id(p) in rows else p.shape
                full[name] = torch.randn(shape, generator=g, dtype=p.dtype)
                p.add_(full[name][list(rows[id(p)])] if id(p) in rows else full[name])
    problems = []
    if sum(isinstance(b, EPMoE) and b.local == 4 for b in stage.mtp.modules()) != DEPTH:
        problems.append("the MTP layers' experts are not spread")
    mine = save_tensors(stages.modules)
    out = root / "saved-ep"
    save(out, mine, config, group=group, timeout=120)
    if rank == 0:
        initial = dict(mtp_layers_state(_model()))
        names = [f"model.layers.{n + k}.mlp.experts.{t}" for k in range(DEPTH) for t in ("gate_up_proj", "down_proj")]
        disk = load(out, names)
        for name in names:
            if not torch.equal(disk[name], initial[name] + full[name]):
                problems.append(f"{name}: on disk differs from the trained experts")
        from transformers import AutoModelForCausalLM

        back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64)
        ref = dict(_model().named_parameters())
        differ = [name for name, p in back.named_parameters() if not torch.equal(p, ref[name])]
        if differ:
            problems.append(f"from_pretrained: {len(differ)} tensors differ (first {differ[0]})")
    dist.barrier(group)
    again = HFSource(str(out), weights=True, ep_group=group, mtp_depth=DEPTH)
    (read,) = again.build(hf_models.model("deepseek_v3", layers=2, seed=7), resolve("1f1b", 1), 0)  # other weights
    for name, p in read.named_model_parameters():
        t = mine[name][1] if isinstance(mine[name], tuple) else mine[name]
        if not torch.equal(p, t):
            problems.append(f"{name}: read back differs")
    return "; ".join(problems[:6]) or "ok"


def _mixed(root: Path) -> str:
    """``Trainer(stages=HFSource(DIR, mtp_depth=1, ep_group=dp group))`` with ``precision="bf16-mixed"``
    and ``zero=1`` on DP=2 (PP=1; DIR: the folder ``_saved`` wrote): the MTP layer's expert rows are
    experts as the main layers' are (row shards, not sharded again by ZeRO-1: this rank updates
    them, from FP32 masters with an FP32 ``main_grad``, and has their optimizer state after a step)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from twinpipe.hf import HFSource, TokenLoss
    from twinpipe.train.data import BatchSampler
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import TrainConfig, Trainer

    folder = str(root / "saved")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    mesh = build_mesh(2, 1)
    corpus = torch.randint(0, hf_models.VOCAB, (2000,), generator=torch.Generator().manual_seed(3))
    train = TrainConfig(schedule="1f1b", batch_size=4, microbatch_size=1, seed=0, precision="bf16-mixed", zero=1,
                        mtp_depth=1, mtp_weight=WEIGHT)
    trainer = Trainer(lambda: AutoModelForCausalLM.from_config(config), BatchSampler(corpus, SEQ, seed=0), TokenLoss(),
                      lambda ps: torch.optim.AdamW(ps, lr=1e-3), mesh, train,
                      stages=HFSource(folder, weights=True, ep_group=mesh.dp_group, mtp_depth=1))
    try:
        result = trainer.step(0)
    finally:
        trainer.pipe.close()
    n = config.num_hidden_layers
    mtp = {name: p for name, p, _ in trainer.held if name.startswith(f"model.layers.{n}.mlp.experts.")}
    problems = [] if len(mtp) == 2 else [f"MTP expert tensors held: {sorted(mtp)}"]
    for name, p in mtp.items():
        master = trainer.optimized_tensor(p)
        if id(p) not in trainer.row_shards or p.shape[0] != 4:
            problems.append(f"{name} {list(p.shape)}: not this rank's expert rows")
        elif master is None or master.dtype != torch.float32 or p.main_grad.dtype != torch.float32:
            problems.append(f"{name}: not updated here from an FP32 master")
        elif not trainer.optimizer.state.get(master):
            problems.append(f"{name}: no optimizer state")
    if not torch.isfinite(result.losses).all():
        problems.append(f"losses {result.losses.tolist()}")
    return "; ".join(problems) or "ok"


def mtp_layers_state(model) -> dict:
    """The initial MTP tensors (``mtp_layers``, seed 0) of ``model`` by their checkpoint names."""
    from twinpipe.hf.mtp import mtp_layers

    return {f"model.layers.{layer.index}.{k}": t for layer in mtp_layers(model, DEPTH) for k, t in layer.state_dict().items()}


def _cli(root: Path, group, mesh: tuple = ("--pp", "2"), out: str = "cli") -> str:
    """``twinpipe train --model DIR --mtp-depth 1`` with ``mesh`` (the command's own checks and training,
    in this world's 2 processes; DIR: the folder ``_saved`` wrote, MTP weights included): its first
    loss is the reference's, the unsplit model plus the checkpoint's MTP layer on the same batch.
    With ``--ep 2 --dp 2`` each rank reads its half of the experts, the MTP layer's too."""
    import json

    import numpy as np
    import torch.distributed as dist
    import torch.nn.functional as F

    import twinpipe.train_command.cli as cli
    from twinpipe.hf.mtp import depth_context, mtp_layers
    from twinpipe.hf.weights import load
    from twinpipe.train.data import BatchSampler

    rank = dist.get_rank(group)
    folder = root / "saved"
    tokens = root / "tokens.npy"
    if rank == 0 and not tokens.exists():
        np.save(tokens, np.random.default_rng(0).integers(0, hf_models.VOCAB, 4000).astype(np.uint16))
    dist.barrier(group)
    parser = cli.argparse.ArgumentParser()
    cli._add_arguments(parser)
    args = parser.parse_args(["--model", str(folder), "--data", str(tokens), *mesh, "--schedule", "1f1b",
                              "--mtp-depth", "1", "--mtp-weight", str(WEIGHT), "--steps", "1", "--seq-len", str(SEQ),
                              "--batch-size", "2", "--microbatch-size", "1", "--out", str(root / out)])
    cli._check(args)
    cli._train(args, torch.device("cpu"))
    dist.barrier(group)
    if rank != 0:
        return "ok"
    first = json.loads((root / out / "train-log.json").read_text())["steps"][0]["loss"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)  # the command's --dtype
    layer = mtp_layers(model, 1)[0]
    n = model.config.num_hidden_layers
    saved = load(folder, [f"model.layers.{n}.{sub}" for sub, _ in layer.named_parameters()])
    with torch.no_grad():
        for sub, p in layer.named_parameters():
            p.copy_(saved[f"model.layers.{n}.{sub}"])
    x, y = BatchSampler(torch.from_numpy(np.load(tokens).astype(np.int64)), SEQ, seed=0).batch(0, 2)
    captured, losses = [], []
    model.model.norm.register_forward_hook(lambda mod, a, out: captured.append(a[0]))
    with torch.no_grad():
        for rows in (slice(0, 1), slice(1, 2)):
            captured.clear()
            logits = model(x[rows]).logits
            h = captured[0]
            ce = lambda z, t: F.cross_entropy(z.reshape(-1, z.shape[-1]).float(), t.reshape(-1))  # noqa: E731
            h1 = layer(h[:, :SEQ - 1], model.model.embed_tokens(y[rows][:, :SEQ - 1]),
                       depth_context(model.config, model.model.rotary_emb, h, SEQ - 1, None))
            losses.append(ce(logits, y[rows]) + WEIGHT * ce(model.lm_head(layer.out_norm(h1)), y[rows][:, 1:]))
    expected = float(torch.stack(losses).double().mean())  # the trainer's float64 vector of losses
    return "ok" if first == expected else f"first loss {first!r} != reference {expected!r}"


def _world(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    reference = _reference()
    group = dist.group.WORLD
    results = {}
    named = [(s, lambda s=s: _exact(s, reference, group)) for s in SCHEDULES]
    named += [("saved", lambda: _saved(Path(root), group)), ("cli", lambda: _cli(Path(root), group))]
    named += [("ep", lambda: _ep(group)), ("ep-zb-h1", lambda: _ep(group, "zb-h1")), ("saved-ep", lambda: _saved_ep(Path(root), group)),
              ("cli-ep", lambda: _cli(Path(root), group, ("--pp", "1", "--dp", "2", "--ep", "2"), "cli-ep")),
              ("mixed", lambda: _mixed(Path(root)))]
    for name, fn in named:
        try:
            results[name] = fn()
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-mtp")
    return run_world(2, _world, str(root), timeout=300)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mtp_stages_are_exact_against_the_unsplit_model(world, schedule):
    assert [r[schedule] for r in world] == ["ok", "ok"]


def test_mtp_with_expert_parallelism_spreads_the_mtp_experts_and_matches_the_unsplit_model(world):
    assert [r["ep"] for r in world] == ["ok", "ok"]


def test_mtp_with_expert_parallelism_and_zb_h1_defers_the_mtp_layers_w_and_matches_the_unsplit_model(world):
    assert [r["ep-zb-h1"] for r in world] == ["ok", "ok"]


def test_mtp_layers_with_expert_parallelism_save_every_expert_and_read_back_their_rows(world):
    assert [r["saved-ep"] for r in world] == ["ok", "ok"]


def test_mtp_layers_save_under_deepseek_v3_names_and_read_back(world):
    assert [r["saved"] for r in world] == ["ok", "ok"]


def test_twinpipe_train_with_mtp_depth_on_a_deepseek_v3_folder_starts_at_the_reference_loss(world):
    assert [r["cli"] for r in world] == ["ok", "ok"]


def test_twinpipe_train_with_mtp_depth_and_ep_starts_at_the_reference_loss(world):
    assert [r["cli-ep"] for r in world] == ["ok", "ok"]


def test_mtp_experts_with_ep_bf16_mixed_and_zero1_are_updated_from_fp32_masters_on_their_rank(world):
    assert [r["mixed"] for r in world] == ["ok", "ok"]


# ---- without a world: what is refused, and "config"

def test_mtp_depth_config_reads_num_nextn_predict_layers_and_the_last_stage_holds_that_many():
    model = _model()
    model.config.num_nextn_predict_layers = 2
    stages = hf.build(model, "1f1b", 2, 1, mtp_depth="config")
    (last,) = stages.modules
    assert stages.mtp_depth == 2 and [layer.index for layer in last.mtp] == [2, 3]
    assert stages._tied_keys == ("embed", "mtp_embed") and last.mtp_embed is not model.model.embed_tokens.weight
    assert isinstance(stages.criterion, hf.mtp.HFMTPLoss)
    with pytest.raises(ValueError, match=r"input_ids=\(4, 3\): must have more than mtp_depth \+ 1 = 3 tokens"):
        stages.batch(*hf_models.batch(4, 3, seed=1), num_chunks=4)


def test_the_mtp_experts_spread_over_the_main_layers_ep_group_one_slot_per_expert():
    """The main layers sharded with redundant slots (``phy2log``) over EP rank 1 of 2 (simulated):
    the MTP layer's block gets the same group, with slot s running expert s; the model's initial
    experts are the rank's rows of the unsharded layer's."""
    from twinpipe.hf.experts import EPMoE, shard_experts_
    from twinpipe.hf.mtp import mtp_layers
    from twinpipe.moe.local import LocalEPGroup

    model = _model()
    whole = mtp_layers(model, 1)[0].mlp.experts.gate_up_proj
    rank = LocalEPGroup(2).rank(1)
    shard_experts_(model, rank, phy2log=[*range(8), 0, 1])
    (last,) = hf.build(model, "1f1b", 2, 1, mtp_depth=1).modules
    block = last.mtp[0].mlp
    assert isinstance(block, EPMoE) and block.ep_group is rank and block.rows == (4, 5, 6, 7)
    assert torch.equal(block.phy2log, torch.arange(8)) and torch.equal(block.experts.gate_up_proj, whole[4:])


def test_a_v_schedule_gives_the_mtp_layers_the_embedding_itself():
    model = _model()
    stages = hf.build(model, "dualpipev", 2, 0, mtp_depth=1)
    last = [m for m in stages.modules if m.last][0]
    assert last.mtp_embed is model.model.embed_tokens.weight and stages._tied_keys == ()


@pytest.mark.parametrize("arch, options, message", [
    ("llama", {}, r"mtp_depth=1: must be 0 for model_type='llama': multi-token prediction is built for DeepSeek-V3"),
    ("deepseek_v3", {"tied": True}, r"mtp_depth=1: must be 0 with tied input/output embeddings"),
])
def test_mtp_on_another_model_is_refused_by_name(arch, options, message):
    with pytest.raises(ValueError, match=message):
        hf.build(hf_models.model(arch, layers=2, **options), "1f1b", 2, 1, mtp_depth=1)


@pytest.mark.parametrize("folder, more, message", [
    ("tiny-llama", [], "--mtp-depth=1: must be 0 for model_type='llama'"),
])
def test_twinpipe_train_refuses_mtp_depth_before_any_process_starts(tmp_path, capsys, folder, more, message):
    import twinpipe.train_command.cli as cli

    parser = cli.argparse.ArgumentParser()
    cli._add_arguments(parser)
    args = parser.parse_args(["--model", str(Path(__file__).parent / "data" / folder), "--pp", "2", "--mtp-depth", "1",
                              "--steps", "1", "--seq-len", "8", "--batch-size", "4", "--microbatch-size", "1",
                              "--out", str(tmp_path / "out"), *more])
    assert cli.run_train(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_twinpipe_train_reads_deepseek_v3_routing_biases_from_a_checkpoint(tmp_path):
    """``HFSource`` with weights fills the persistent buffers too: DeepSeek-V3's
    ``e_score_correction_bias`` (drawn at random here) is the checkpoint's, not its initial zeros."""
    from transformers import AutoModelForCausalLM

    from twinpipe.schedule.spec import resolve
    from twinpipe.hf import HFSource

    saved = hf_models.model("deepseek_v3", layers=2)
    saved.save_pretrained(str(tmp_path))
    fresh = AutoModelForCausalLM.from_config(saved.config, dtype=torch.float64)
    (stage,) = HFSource(str(tmp_path), "E,t|t,L", weights=True).build(fresh, resolve("1f1b", 2), 1)
    bias = stage.layers["1"].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, saved.model.layers[1].mlp.gate.e_score_correction_bias)
    assert list(dict(stage.named_model_buffers())) == ["model.layers.1.mlp.gate.e_score_correction_bias"]


def test_a_checkpoint_without_mtp_layers_leaves_them_at_their_initial_values(tmp_path):
    from transformers import AutoModelForCausalLM

    from twinpipe.hf.mtp import mtp_layers
    from twinpipe.schedule.spec import resolve
    from twinpipe.hf import HFSource

    saved = hf_models.model("deepseek_v3", layers=2)
    saved.save_pretrained(str(tmp_path))  # the main model only
    fresh = AutoModelForCausalLM.from_config(saved.config, dtype=torch.float64)
    (stage,) = HFSource(str(tmp_path), "E,t|t,L", weights=True, mtp_depth=1).build(fresh, resolve("1f1b", 2), 1)
    initial = dict(mtp_layers(fresh, 1)[0].state_dict())
    assert all(torch.equal(t, initial[k]) for k, t in stage.mtp[0].state_dict().items())
    assert torch.equal(stage.mtp_embed, saved.model.embed_tokens.weight)  # the copy: the checkpoint's embedding
    assert torch.equal(stage.lm_head.weight, saved.lm_head.weight)


def test_an_mtp_layer_computes_what_transformers_mtp_layer_computes_with_the_same_weights():
    """The checkpoint's order and norms: ``transformers``' own ``MtpLayer`` (which reads DeepSeek-V3's
    released MTP weights) given our layer's weights gives ``shared_head.norm`` of our h^k, bitwise."""
    modeling_layers = pytest.importorskip("transformers.modeling_layers")
    if not hasattr(modeling_layers, "MtpLayer"):
        pytest.skip("this transformers has no MtpLayer")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    from twinpipe.hf.mtp import depth_context, mtp_layers

    model = _model()
    (ours,) = mtp_layers(model, 1)
    theirs = modeling_layers.MtpLayer(model.config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, model.config.num_hidden_layers,
                                      use_post_norm=True).to(torch.float64)
    renamed = {"shared_head.norm.weight": "post_norm.weight"}
    mine = {renamed.get(k, k if k.split(".")[0] in ("enorm", "hnorm", "eh_proj") else f"mtp_block.{k}"): v
            for k, v in ours.state_dict().items()}
    theirs.load_state_dict(mine)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 6, model.config.hidden_size, generator=g, dtype=torch.float64)
    e = torch.randn(2, 6, model.config.hidden_size, generator=g, dtype=torch.float64)
    ctx = depth_context(model.config, model.model.rotary_emb, h, 6, None)
    with torch.no_grad():
        expected = theirs(e, h, position_embeddings=ctx.position_embeddings, attention_mask=ctx.masks["full_attention"],
                          position_ids=ctx.position_ids, cache=None)
        got = ours.out_norm(ours(h, e, ctx))
    assert torch.equal(got, expected)
