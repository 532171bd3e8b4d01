"""Every model option with ``precision="bf16-mixed"`` and ``zero=1``: tied weights (the MTP head's
embedding copy, a transformers model's tied head) and expert parallelism of a transformers MoE model.

A tied pair's gradients are summed over the pipeline on FP32 ``main_grad`` before the data-parallel
reduce-scatter, each tied tensor in a bucket of its own: both copies get the same sum and stay equal.

One 4-process gloo world: the built-in GPT with multi-token prediction (its head holds a copy of the
embedding) on DualPipe PP=2 x DP=2, 1F1B PP=2 x DP=2 (the reduction started inside the step) and
DualPipeV PP=2 x DP=2 (both ends on rank 0), bf16-mixed and ZeRO-1, bitwise against the
single-process reference (losses, norms, FP32 masters, AdamW state, bf16 weights); a tied
transformers Llama through ``Trainer(stages=HFSource(...))``, bitwise the same run without ZeRO-1,
its two ends bitwise equal. Then ``twinpipe train`` end to end: a tied Llama and the tiny Qwen3-MoE
with ``--ep 2 --dp 2``, each with ``--precision bf16-mixed --zero 1``, resumed on another mesh.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from distributed import run_named, run_world
from in_process import run_in_process
from train_setup import gather_state, predicted_from_sizes, reference_state, state_differences, steps_against_reference

WORLD = 4
STEPS = 2
DATA = Path(__file__).parent / "data"
TINY_LLAMA, TINY_MOE = DATA / "tiny-llama", DATA / "tiny-qwen3-moe"

# Relative: a loss computed with bf16 weights and activations against float32's (about one bf16 rounding,
# 2^-9; measured 3.0e-5 to 4.1e-5), and a gradient norm (bf16 activation gradients; measured 6.1e-4).
BF16_LOSS = 2e-3
BF16_NORM = 1e-2

# (schedule, pp, dp, overlap_dp)
MTP_CASES = {
    "mtp-dualpipe-pp2-dp2": ("dualpipe", 2, 2, True),
    "mtp-1f1b-pp2-dp2-overlap": ("1f1b", 2, 2, True),
    "mtp-dualpipev-pp2-dp2": ("dualpipev", 2, 2, False),
}


def _mtp_setup(schedule: str, overlap_dp: bool, zero: int):
    """A 4-block GPT with 2 MTP depths, AdamW with clipping, bf16-mixed."""
    import torch

    from twinpipe.train.data import BatchSampler
    from twinpipe.train.model import GPT, GPTConfig, lm_loss
    from twinpipe.train.trainer import TrainConfig

    cfg = GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=4, mtp_depth=2)
    corpus = torch.randint(0, cfg.vocab, (4096,), generator=torch.Generator().manual_seed(5))
    config = TrainConfig(schedule=schedule, batch_size=8, microbatch_size=2, max_norm=0.3, seed=0, mtp_depth=2,
                         mtp_weight=0.3, overlap_dp=overlap_dp, precision="bf16-mixed", zero=zero)
    return ((lambda: GPT(cfg)), BatchSampler(corpus, cfg.seq_len, seed=0), lm_loss,
            (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)), config)


def _mtp_case(rank: int, schedule: str, pp: int, dp: int, overlap_dp: bool) -> list[str]:
    import torch
    import torch.distributed as dist

    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.reference import ReferenceTrainer
    from twinpipe.train.trainer import Trainer

    fn, sampler, criterion, make_opt, config = _mtp_setup(schedule, overlap_dp, 1)
    trainer = Trainer(fn, sampler, criterion, make_opt, build_mesh(dp, pp), config)
    ref = ReferenceTrainer(*_mtp_setup(schedule, overlap_dp, 0), dp, pp) if rank == 0 else None
    problems = steps_against_reference(trainer, ref, STEPS)
    state = gather_state(trainer)
    differ = [None]
    if rank == 0:
        differ = [state_differences(state, reference_state(ref))]
        if not torch.equal(state[0]["embed.tokens.weight"], state[0]["head.mtp_embed"]):
            differ[0].append("the MTP head's embedding copy differs from the embedding")
    dist.broadcast_object_list(differ, src=0)
    problems += [f"masters or optimizer state: {d}" for d in differ[0][:4]]
    weights = [{n: p.detach() for n, p in ref.named_parameters().items()} if rank == 0 else None]
    dist.broadcast_object_list(weights, src=0)
    problems += [f"{n}: the bf16 weight differs from the reference's" for n, p, _ in trainer.held
                 if p.dtype != torch.bfloat16 or not torch.equal(p.detach(), weights[0][n])]
    # One more step, measured: twinpipe simulate --gpt --mtp-depth 2 predicts it from the sizes (docs/memory.md).
    from twinpipe.train.memory import measured_step
    from twinpipe.train.model import GPTConfig

    _, memory = measured_step(trainer, STEPS)
    cfg = GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=4, mtp_depth=2)
    problems += [f"from the sizes: {p}" for p in predicted_from_sizes(trainer, memory, cfg, 2, "float32")]
    trainer.pipe.close()
    return problems


def _tied_llama():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(TINY_LLAMA), local_files_only=True, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config).to(torch.float32)


def _hf_tied(rank: int, schedule: str, layout: str) -> list[str]:
    """A tied Llama, 1F1B/DualPipeV PP=2 x DP=2, bf16-mixed: ZeRO-1 bitwise the replicated run (losses,
    norms, masters, state); the embedding and the head bitwise equal on every rank after the steps."""
    import torch
    import torch.distributed as dist

    from twinpipe.hf import HFSource, TokenLoss
    from twinpipe.train.data import BatchSampler
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import TrainConfig, Trainer

    corpus = torch.randint(0, 128, (3000,), generator=torch.Generator().manual_seed(3))
    runs, problems = [], []
    for zero in (1, 0):
        config = TrainConfig(schedule=schedule, batch_size=8, microbatch_size=1, seed=0, max_norm=1.0, precision="bf16-mixed",
                             zero=zero)
        trainer = Trainer(_tied_llama, BatchSampler(corpus, 8, seed=0), TokenLoss(), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                          build_mesh(2, 2), config, stages=HFSource(str(TINY_LLAMA), layout))
        results = [trainer.step(step) for step in range(STEPS)]
        state = gather_state(trainer)
        ends = [(name, p.detach().clone()) for name, p, _ in trainer.held
                if name in ("model.embed_tokens.weight", "lm_head.weight")]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ends)
        tensors = [t for mine in everyone for _, t in mine]
        if len({n for mine in everyone for n, _ in mine}) != 2 or not all(torch.equal(tensors[0], t) for t in tensors):
            problems.append(f"zero={zero}: the tied ends differ over the ranks")
        if tensors[0].dtype != torch.bfloat16:
            problems.append(f"zero={zero}: the ends are {tensors[0].dtype}, not bf16")
        runs.append(([r.losses for r in results], [r.grad_norm for r in results], state))
        trainer.pipe.close()
    (losses, norms, state), (losses0, norms0, state0) = runs
    if not all(torch.equal(a, b) for a, b in zip(losses, losses0)) or norms != norms0:
        problems.append(f"ZeRO-1 losses/norms {losses}/{norms} != replicated {losses0}/{norms0}")
    if rank == 0:
        problems += state_differences(state, state0)[:4]
        if not torch.equal(state[0]["model.embed_tokens.weight"], state[0]["lm_head.weight"]):
            problems.append("the tied masters differ")
    return problems


def _moe():
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(TINY_MOE), local_files_only=True))


def _hf_moe_ep(rank: int) -> list[str]:
    """The tiny Qwen3-MoE, 1F1B PP=2 x DP=2, its experts spread over each stage's two data-parallel ranks
    (EP=2): bf16-mixed with ZeRO-1 bitwise the same without ZeRO-1 (the expert rows are not sharded
    again: every rank updates its own, FP32 masters and main_grad); its first loss and gradient norm
    the pure float32 run's within ``BF16_LOSS`` and ``BF16_NORM``."""
    import torch
    import torch.distributed as dist

    from twinpipe.hf import HFSource, TokenLoss
    from twinpipe.train.data import BatchSampler
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import TrainConfig, Trainer

    corpus = torch.randint(0, 128, (3000,), generator=torch.Generator().manual_seed(3))
    runs, problems = {}, []
    for mode, zero in (("bf16-mixed", 1), ("bf16-mixed", 0), ("pure", 0)):
        mesh = build_mesh(2, 2)
        config = TrainConfig(schedule="1f1b", batch_size=4, microbatch_size=1, seed=0, max_norm=1.0, precision=mode, zero=zero)
        trainer = Trainer(_moe, BatchSampler(corpus, 8, seed=0), TokenLoss(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), mesh,
                          config, stages=HFSource(str(TINY_MOE), "E,t|t,L", ep_group=mesh.dp_group))
        results = [trainer.step(step) for step in range(STEPS if mode != "pure" else 1)]
        experts = [p for p in trainer.params if id(p) in trainer.row_shards]
        if not experts:
            problems.append(f"{mode} zero={zero}: no expert rows on this rank")
        for p in experts:
            master = trainer.optimized_tensor(p)  # every rank updates its own rows
            if master is None or (mode != "pure" and (master.dtype != torch.float32 or p.main_grad.dtype != torch.float32)):
                problems.append(f"{mode} zero={zero}: an expert tensor is not updated here in FP32")
            elif not trainer.optimizer.state.get(master):
                problems.append(f"{mode} zero={zero}: no optimizer state for an expert tensor")
        runs[(mode, zero)] = ([r.losses for r in results], [r.grad_norm for r in results], gather_state(trainer))
        trainer.pipe.close()
        dist.barrier()
    (losses, norms, state), (losses0, norms0, state0), (pure, pure_norms, _) = runs.values()
    if not all(torch.equal(a, b) for a, b in zip(losses, losses0)) or norms != norms0:
        problems.append(f"ZeRO-1 losses/norms {losses}/{norms} != without {losses0}/{norms0}")
    if rank == 0:
        problems += state_differences(state, state0)[:4]
    if not torch.allclose(losses[0], pure[0], rtol=BF16_LOSS, atol=0):
        problems.append(f"first losses {losses[0].tolist()} != float32's {pure[0].tolist()} within {BF16_LOSS}")
    if abs(norms[0] - pure_norms[0]) > BF16_NORM * pure_norms[0]:
        problems.append(f"first gradient norm {norms[0]} != float32's {pure_norms[0]} within {BF16_NORM}")
    return problems


def _world(rank: int, world: int) -> dict:
    cases = [(name, lambda a=args: _mtp_case(rank, *a)) for name, args in MTP_CASES.items()]
    cases += [("hf-tied-1f1b", lambda: _hf_tied(rank, "1f1b", "E,t*2|t*2,L")),
              ("hf-tied-dualpipev", lambda: _hf_tied(rank, "dualpipev", "E,t|t|t|t,L")),
              ("hf-moe-ep2", lambda: _hf_moe_ep(rank))]
    return run_named(cases)


@pytest.fixture(scope="module")
def outcomes():
    pytest.importorskip("transformers")
    return run_world(WORLD, _world, timeout=300)


@pytest.mark.parametrize("case", list(MTP_CASES))
def test_mtp_with_bf16_mixed_and_zero1_is_bitwise_the_reference(outcomes, case):
    assert all(o[case] == [] for o in outcomes), [o[case] for o in outcomes][:2]


@pytest.mark.parametrize("case", ["hf-tied-1f1b", "hf-tied-dualpipev"])
def test_tied_transformers_model_with_bf16_mixed_and_zero1(outcomes, case):
    assert all(o[case] == [] for o in outcomes), [o[case] for o in outcomes][:2]


def test_transformers_experts_with_bf16_mixed_and_zero1(outcomes):
    assert all(o["hf-moe-ep2"] == [] for o in outcomes), [o["hf-moe-ep2"] for o in outcomes][:2]


# ---- twinpipe train end to end (the console script's function, in this process; its ranks are processes)

SHAPE = ["--seq-len", "8", "--batch-size", "4", "--microbatch-size", "1", "--precision", "bf16-mixed"]


def _run(args, cwd) -> subprocess.CompletedProcess:
    """``twinpipe train ARGS`` in ``cwd``, in this process (``in_process.run_in_process``)."""
    return run_in_process(["train", *args], cwd)


def _steps(out: Path) -> list[dict]:
    return json.loads((out / "train-log.json").read_text())["steps"]


def _first_loss(folder: Path, ids) -> float:
    """The unsplit float32 model's loss on batch 0 (random weights from seed 0, as every rank builds them)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from twinpipe.train.data import BatchSampler

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
    x, y = BatchSampler(ids, 8, seed=0).batch(0, 4)
    with torch.no_grad():
        logits = model(x).logits
    return float(torch.stack([torch.nn.functional.cross_entropy(row, label) for row, label in zip(logits, y)]).mean())


def _initial(folder: Path, name: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
    return model.get_parameter(name).detach()


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    import numpy as np

    root = tmp_path_factory.mktemp("mixed-cli")
    ids = np.random.default_rng(0).integers(0, 128, 3000).astype(np.uint16)
    np.save(root / "t.npy", ids)
    return root, ids


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable:UserWarning")  # reading the checkpoint here
def test_cli_tied_llama_with_bf16_mixed_and_zero1(tokens):
    """A tied Llama (tests/data/tiny-llama with tie_word_embeddings; the file itself is untied), DP=2,
    bf16-mixed, ZeRO-1 (the one tensor under two names updated by its shard's owner): the first loss
    is the float32 model's within ``BF16_LOSS``; after the steps the checkpoint's embedding and head
    (FP32 masters) are one trained weight. The ends on two ranks: ``hf-tied-*`` above."""
    pytest.importorskip("transformers")
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    root, ids = tokens
    folder = root / "tied"
    folder.mkdir()
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    run = _run(["--model", str(folder), "--data", "t.npy", "--pp", "1", "--dp", "2", "--zero", "1", "--steps", "2",
                "--schedule", "1f1b", "--out", "tied-run", *SHAPE], root)
    assert run.returncode == 0, run.stderr
    steps = _steps(root / "tied-run")
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) for s in steps)
    assert steps[0]["loss"] == pytest.approx(_first_loss(folder, ids), rel=BF16_LOSS)
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = str(root / "tied-run" / "checkpoint-final")
    assert not [k for k in FileSystemReader(checkpoint).read_metadata().state_dict_metadata if "lm_head" in k]  # stored once
    embed = _load_state_dict_from_keys({"model.model.embed_tokens.weight"}, checkpoint_id=checkpoint)["model.model.embed_tokens.weight"]
    assert str(embed.dtype) == "torch.float32"
    assert not (embed == _initial(folder, "model.embed_tokens.weight")).all()  # trained


def test_cli_moe_with_expert_parallelism_bf16_mixed_and_zero1_resumes_on_another_mesh(tokens):
    """The tiny Qwen3-MoE, ``--ep 2 --dp 2 --precision bf16-mixed --zero 1``: the first loss is the float32
    model's within ``BF16_LOSS``; the checkpoint holds each expert's FP32 master rows once (a chunk per
    rank); a pure float32 run with PP=2 and no expert parallelism resumes from it, its first loss the
    uninterrupted run's within ``BF16_LOSS`` (the same masters, computed in float32 instead of bf16)."""
    pytest.importorskip("transformers")
    from torch.distributed.checkpoint import FileSystemReader

    root, ids = tokens
    run = _run(["--model", str(TINY_MOE), "--data", "t.npy", "--dp", "2", "--ep", "2", "--zero", "1", "--pp", "1",
                "--steps", "3", "--save-every", "2", "--schedule", "1f1b", "--out", "moe-run", *SHAPE], root)
    assert run.returncode == 0, run.stderr
    steps = _steps(root / "moe-run")
    assert len(steps) == 3 and all(math.isfinite(s["loss"]) for s in steps)
    assert steps[0]["loss"] == pytest.approx(_first_loss(TINY_MOE, ids), rel=BF16_LOSS)
    metadata = FileSystemReader(str(root / "moe-run" / "checkpoint-step2")).read_metadata().state_dict_metadata
    for key in ("model.model.layers.0.mlp.experts.gate_up_proj", "optim.model.layers.1.mlp.experts.down_proj.exp_avg"):
        chunks = metadata[key].chunks
        assert str(metadata[key].properties.dtype) == "torch.float32", key
        assert sorted(c.offsets[0] for c in chunks) == [0, 2] and all(c.sizes[0] == 2 for c in chunks), key
    again = _run(["--model", str(TINY_MOE), "--data", "t.npy", "--pp", "2", "--steps", "3", "--schedule", "1f1b",
                  "--resume", "moe-run/checkpoint-step2", "--out", "moe-again",
                  *SHAPE[:-2], "--precision", "pure"], root)
    assert again.returncode == 0, again.stderr
    resumed = _steps(root / "moe-again")
    assert [s["step"] for s in resumed] == [2]
    assert resumed[0]["loss"] == pytest.approx(steps[2]["loss"], rel=BF16_LOSS)
