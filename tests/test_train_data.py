"""``twinpipe train --data FILE`` (and ``--model DIR``): token files memory-mapped, the sampler over them,
the checks before any rank starts, and whole runs through the command line's entry point."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from twinpipe.train_command.cli import main as train_main
from twinpipe.train.data import BatchSampler
from twinpipe.train.tokens import MEGATRON_MAGIC, open_tokens, token_range
from in_process import run_in_process

TINY_LLAMA = Path(__file__).parent / "data" / "tiny-llama"
TINY_MOE = Path(__file__).parent / "data" / "tiny-qwen3-moe"  # 2 layers, 4 experts, top-2, no auxiliary loss (a copy turns it on)
SMALL = ["--layers", "2", "--dim", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "4"]


def _ids(n: int, high: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, n)


def _megatron_idx(path: Path, code: int) -> None:
    """The first bytes of a Megatron ``.idx``: magic, version 1, the dtype code (the rest is not read)."""
    path.write_bytes(MEGATRON_MAGIC + (1).to_bytes(8, "little") + bytes([code]) + bytes(16))


# ---- reading token files

@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int64"])
def test_npy_is_memory_mapped(tmp_path, dtype):
    ids = _ids(1000, 60000 if dtype == "uint16" else 100000).astype(dtype)
    np.save(tmp_path / "t.npy", ids)
    tokens = open_tokens(str(tmp_path / "t.npy"))
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.dtype(dtype)
    assert np.array_equal(tokens, ids)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_reads_raw_little_endian_ids(tmp_path, dtype):
    ids = _ids(1000, 60000).astype(np.dtype(dtype).newbyteorder("<"))
    ids.tofile(tmp_path / "t.bin")
    tokens = open_tokens(str(tmp_path / "t.bin"), dtype)
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, ids)


def test_bin_width_from_a_megatron_idx(tmp_path):
    ids = _ids(500, 60000).astype("<u2")
    ids.tofile(tmp_path / "t.bin")
    _megatron_idx(tmp_path / "t.idx", 8)  # Megatron's uint16
    assert np.array_equal(open_tokens(str(tmp_path / "t.bin")), ids)
    with pytest.raises(ValueError, match=r"dtype='uint32': .*t.idx says the ids are uint16"):
        open_tokens(str(tmp_path / "t.bin"), "uint32")
    wide = _ids(500, 100000).astype("<i4")
    wide.tofile(tmp_path / "w.bin")
    _megatron_idx(tmp_path / "w.idx", 4)  # Megatron's int32 (vocabularies of 65500 and more)
    assert np.array_equal(open_tokens(str(tmp_path / "w.bin")), wide)
    _megatron_idx(tmp_path / "t.idx", 6)  # a float code
    with pytest.raises(ValueError, match="not an integer token dtype"):
        open_tokens(str(tmp_path / "t.bin"))


def test_token_range_scans_in_chunks(tmp_path):
    ids = _ids(10_001, 5000)
    ids[7777] = 9999
    np.save(tmp_path / "t.npy", ids)
    assert token_range(open_tokens(str(tmp_path / "t.npy")), chunk=1000) == (int(ids.min()), 9999)


# ---- the sampler

def test_sampler_over_a_memmap_draws_what_it_draws_over_a_tensor(tmp_path):
    ids = _ids(5000, 300).astype(np.uint16)
    np.save(tmp_path / "t.npy", ids)
    mapped = BatchSampler(open_tokens(str(tmp_path / "t.npy")), 16, seed=3)
    tensor = BatchSampler(torch.from_numpy(ids.astype(np.int64)), 16, seed=3)
    again = BatchSampler(open_tokens(str(tmp_path / "t.npy")), 16, seed=3)  # another rank builds its own
    for step in (0, 1, 7):
        x, y = mapped.batch(step, 4)
        assert x.dtype == torch.int64 and x.shape == (4, 16)
        assert torch.equal(x, tensor.batch(step, 4)[0]) and torch.equal(y, tensor.batch(step, 4)[1])
        assert torch.equal(x, again.batch(step, 4)[0])
        assert torch.equal(x[:, 1:], y[:, :-1])  # labels: the next token



# ---- checks before any rank starts: exit 2, one line naming the option

def _error(argv, capsys, tmp_path) -> str:
    code = train_main([*argv, "--out", str(tmp_path / "out"), "--pp", "1", "--steps", "1", *SMALL])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("twinpipe train: error: ") and err.count("\n") == 1, err
    return err


def test_bad_data_files(tmp_path, capsys):
    np.save(tmp_path / "ok.npy", _ids(100, 50).astype(np.uint16))
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    np.save(tmp_path / "float.npy", np.zeros(100, dtype=np.float32))
    np.save(tmp_path / "matrix.npy", np.zeros((10, 10), dtype=np.uint16))
    np.save(tmp_path / "short.npy", np.arange(8, dtype=np.uint16))
    np.save(tmp_path / "negative.npy", np.array([3, -1] * 20, dtype=np.int32))
    (tmp_path / "ids.csv").write_text("1,2,3")
    _ids(100, 50).astype("<u2").tofile(tmp_path / "noheader.bin")
    cases = {
        ("--data", str(tmp_path / "missing.npy")): "--data=.*missing.npy': no such file",
        ("--data", str(tmp_path / "empty.bin"), "--data-dtype", "uint16"): "--data=.*empty.bin': the file is empty",
        ("--data", str(tmp_path / "odd.bin"), "--data-dtype", "uint16"): "3 bytes is not a whole number of uint16 ids",
        ("--data", str(tmp_path / "noheader.bin")): "a .bin file has no header: give --data-dtype",
        ("--data", str(tmp_path / "float.npy")): "--data=.*: must hold a 1-D array of integer token ids; .* float32",
        ("--data", str(tmp_path / "matrix.npy")): "--data=.*: must hold a 1-D array .* 2-D",
        ("--data", str(tmp_path / "short.npy")): r"--data=.*: holds 8 tokens; one sequence needs --seq-len \+ 1 = 9",
        ("--data", str(tmp_path / "negative.npy")): r"--data=.*: holds a negative token id \(-1\)",
        ("--data", str(tmp_path / "ids.csv")): "--data=.*: must be a .npy or .bin file",
        ("--data", str(tmp_path / "ok.npy"), "--data-dtype", "uint16"): "--data-dtype='uint16': only for .bin files",
        ("--data", str(tmp_path / "ok.npy"), "--vocab", "40"): r"--vocab=40: must be > 4\d, the largest token id",
        ("--data-dtype", "uint16"): "--data-dtype=uint16: only with --data",
        ("--vocab", "100",): "--vocab=100: the built-in corpus is bytes: must be >= 256",
        ("--data", str(tmp_path / "notes.txt")): "--data=.*notes.txt': no such file|text needs a tokenizer",
    }
    (tmp_path / "notes.txt").write_text("some text")
    for argv, pattern in cases.items():
        err = _error(list(argv), capsys, tmp_path)
        assert re.search(pattern, err), (argv, err)
    assert not (tmp_path / "out").exists()  # nothing written


def _config(folder: Path, model_type: str, **fields) -> str:
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **fields).save_pretrained(folder)
    return str(folder)


def _needs_hf():
    hf = pytest.importorskip("twinpipe.hf", reason="twinpipe.hf (branch h-hf) is not in this tree yet")
    if not hasattr(hf, "build"):
        pytest.skip("twinpipe.hf.build (branch h-hf) is not in this tree yet")


def test_bad_models(tmp_path, capsys):
    _needs_hf()
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=128, max_position_embeddings=64)
    t5 = _config(tmp_path / "t5", "t5", d_model=32, d_ff=64, num_layers=2, num_heads=4, vocab_size=128)
    gpt2 = _config(tmp_path / "gpt2", "gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=128, bos_token_id=1, eos_token_id=1,
                   tie_word_embeddings=False)
    moe = json.loads((TINY_MOE / "config.json").read_text())
    moe3 = tmp_path / "moe3"
    moe3.mkdir()
    (moe3 / "config.json").write_text(json.dumps({**moe, "num_local_experts": 3}))
    qwen2_moe = _config(tmp_path / "qwen2moe", "qwen2_moe", **small, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    bare = tmp_path / "bare"  # the tiny Llama without its tokenizer
    bare.mkdir()
    shutil.copy(TINY_LLAMA / "config.json", bare / "config.json")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("some text, long enough for one sequence of eight tokens")
    np.save(tmp_path / "big.npy", np.array([5, 300] * 50, dtype=np.uint16))
    np.save(tmp_path / "ok.npy", _ids(100, 100).astype(np.uint16))
    llama, ok = str(TINY_LLAMA), str(tmp_path / "ok.npy")
    no_gpt = [a for a in SMALL if a not in ("--layers", "2", "--dim", "16", "--heads")]  # the GPT's options left at their defaults
    cases = {
        ("--model", str(tmp_path / "nowhere")): "--model=.*nowhere': must be a folder holding a transformers config.json",
        ("--model", str(tmp_path / "empty")): "--model=.*empty': has no config.json",
        ("--model", t5): "--model=.*t5': transformers builds no causal LM from its config.json \\(model_type='t5'\\)",
        ("--model", gpt2): "--model=.*gpt2': model=GPT2LMHeadModel: has no model; twinpipe.hf runs decoder-only causal LMs",
        ("--model", llama, "--layout", "E,t*2|t*2,L"): "--layout='E,t\\*2\\|t\\*2,L': must be 1 stage",
        ("--layout", "E,t*2|t*2,L"): "--layout='E,t\\*2\\|t\\*2,L': only with --model",
        ("--model", llama, "--ep", "2"): "--ep=2: must divide --dp=1 \\(allowed are 1\\): each stage's data-parallel ranks",
        ("--model", llama, "--ep", "2", "--dp", "2"): "--ep=2: --model=.*tiny-llama' has no MoE layers to spread",
        ("--model", str(moe3), "--ep", "2", "--dp", "2"): "--ep=2: must divide the 3 experts of --model=",
        ("--model", qwen2_moe, "--ep", "2", "--dp", "2"): "--ep=2: --model=.*qwen2moe''s MoE layers cannot be spread: it has "
                                                          "shared_expert, shared_expert_gate besides",
        ("--ep", "2"): "--ep=2: must divide --dp=1",
        ("--model", str(TINY_MOE), "--bias-update-speed", "0.001"): "--bias-update-speed=0.001: must be 0 with --model=.* "
                                                                     "it acts on DeepSeek-V3's routers",
        ("--model", llama, "--dim", "32"): "--dim=32: not with --model",
        ("--model", llama, "--seq-len", "300"): "--seq-len=300: must be at most 256, --model's max_position_embeddings",
        ("--model", str(bare), "--data", str(tmp_path / "notes.txt")): "--data=.*notes.txt': text needs a tokenizer: --model=.* has no tokenizer",
        ("--model", str(bare)): "--model=.*bare': has no tokenizer, so the built-in corpus .* give --data",
        ("--model", llama, "--data", str(tmp_path / "big.npy")): "--data=.*big.npy': holds token id 300, and --model's vocabulary has 128",
    }
    for argv, pattern in cases.items():
        data = [] if "--data" in argv or argv == ("--model", str(bare)) else ["--data", ok]
        code = train_main([*no_gpt, *argv, *data, "--out", str(tmp_path / "out"), "--steps", "1", "--schedule", "1f1b", "--pp", "1"])
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert err.startswith("twinpipe train: error: ") and err.count("\n") == 1 and re.search(pattern, err), (argv, err)
    assert not (tmp_path / "out").exists()  # nothing written


# ---- whole runs, through the command line's entry point

def _run(args, cwd) -> subprocess.CompletedProcess:
    """``twinpipe train ARGS`` in ``cwd``, in this process (``in_process.run_in_process``)."""
    return run_in_process(["train", *args], cwd)


def _losses(out: Path) -> list[float]:
    return [s["loss"] for s in json.loads((out / "train-log.json").read_text())["steps"]]


def test_the_seed_changes_the_batches():
    """torch's generator keeps 32 bits of a seed: a ``(seed << 32) + step`` seed drew seed 0's batches for every seed."""
    from twinpipe.train.data import batch_seed

    tokens = torch.arange(10_000)
    zero, one = BatchSampler(tokens, 8, seed=0), BatchSampler(tokens, 8, seed=1)
    assert not torch.equal(zero.batch(0, 4)[0], one.batch(0, 4)[0])
    assert batch_seed(0, 5) == 5  # seed 0's batches are the ones every earlier version drew
    # the docstring's claim: any two seeds of 0..1000 are at least 1.9 million steps apart
    offsets = sorted(batch_seed(s, 0) for s in range(1001))
    gaps = [b - a for a, b in zip(offsets, offsets[1:])] + [offsets[0] + 2**32 - offsets[-1]]
    assert min(gaps) >= 1_900_000


def test_text_is_tokenized_with_the_model_folders_tokenizer(tmp_path):
    from argparse import Namespace

    from transformers import AutoTokenizer

    from twinpipe.train_command.data import load_tokenizer, tokens

    (tmp_path / "b.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "a.txt").write_text("hello")
    tokenizer = load_tokenizer(str(TINY_LLAMA))
    reference = AutoTokenizer.from_pretrained(str(TINY_LLAMA), local_files_only=True)
    expected = [*reference("hello", add_special_tokens=False)["input_ids"], reference.eos_token_id,
                *reference("def f(x):\n    return x\n", add_special_tokens=False)["input_ids"], reference.eos_token_id]
    for data in (str(tmp_path), str(tmp_path / "*.txt")):  # a folder, a glob: files in sorted order
        assert tokens(Namespace(data=data, data_dtype=None), tokenizer).tolist() == expected
    assert load_tokenizer(str(tmp_path)) is None  # no tokenizer files there
    # without --data: the built-in corpus's text, tokenized
    corpus = tokens(Namespace(data=None, data_dtype=None, corpus_bytes=300), tokenizer)
    from twinpipe.train.data import stdlib_corpus

    text = stdlib_corpus(300).numpy().tobytes().decode("utf-8", errors="replace")
    assert corpus.tolist() == reference(text, add_special_tokens=False)["input_ids"]


def test_a_transformers_model_trains_on_a_pipeline_and_resumes_on_another_mesh(tmp_path, capsys):
    """``--model`` with the tiny Llama: the first step's loss is the unsplit model's on the same batch
    (the same seed builds the same weights), and a resumed run continues from the checkpoint."""
    _needs_hf()
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = _ids(3000, 128).astype(np.uint16)
    np.save(tmp_path / "t.npy", ids)
    shape = ["--seq-len", "8", "--batch-size", "4", "--microbatch-size", "1"]
    first = _run(["--model", str(TINY_LLAMA), "--data", "t.npy", "--pp", "2", "--steps", "2", "--schedule", "zb-h1",
                  "--layout", "E,t*2|t*2,L", *shape], tmp_path)
    assert first.returncode == 0, first.stderr
    losses = _losses(tmp_path / "twinpipe-train")
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(TINY_LLAMA), local_files_only=True))
    x, y = BatchSampler(ids, 8, seed=0).batch(0, 4)
    with torch.no_grad():
        logits = model(x).logits
    expected = float(torch.stack([torch.nn.functional.cross_entropy(logits[i], y[i]) for i in range(4)]).mean())
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    again = _run(["--model", str(TINY_LLAMA), "--data", "t.npy", "--pp", "1", "--dp", "2", "--steps", "3", "--schedule", "1f1b",
                  "--balance", "time", "--resume", "twinpipe-train/checkpoint-final", *shape], tmp_path)
    assert again.returncode == 0, again.stderr
    record = json.loads((tmp_path / "twinpipe-train" / "train-log.json").read_text())
    # the resumed run's step, after the two its checkpoint's run logged in the same --out (carried over)
    assert [s["step"] for s in record["steps"]] == [0, 1, 2] and [s["step"] for s in record["starts"]] == [0, 2]
    assert [s["loss"] for s in record["steps"][:2]] == losses
    # a checkpoint of another model: refused before any rank starts
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    code = train_main(["--model", str(other), "--data", str(tmp_path / "t.npy"), "--pp", "1", "--steps", "4", *shape,
                       "--resume", str(tmp_path / "twinpipe-train" / "checkpoint-final"), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "x").exists(), err
    assert "--resume=" in err and "holds another model than --model=" in err and "model.layers.2." in err, err


def test_a_model_folder_with_weights_gives_each_rank_its_stages_tensors(tmp_path):
    """``HFSource(weights=True)``: the stages hold the folder's tensors, not the seeded random ones."""
    _needs_hf()
    from transformers import AutoConfig, AutoModelForCausalLM

    from twinpipe.schedule import resolve
    from twinpipe.hf import HFSource

    config = AutoConfig.from_pretrained(str(TINY_LLAMA), local_files_only=True)
    torch.manual_seed(1)
    saved = AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path / "model")
    state = saved.state_dict()
    spec = resolve("dualpipe", 2)  # each rank holds two stages of two copies
    seen = set()
    for rank in range(2):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        modules = HFSource(str(tmp_path / "model"), "E,t*2|t*2,L", weights=True).build(model, spec, rank)
        assert len(modules) == 2
        for module in modules:
            for name, p in module.named_model_parameters():
                assert torch.equal(p, state[name]), name
                seen.add(name)
    assert seen == set(state)
    tied = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(TINY_LLAMA), tie_word_embeddings=True))
    assert HFSource(str(tmp_path / "model")).tied_copies(tied) == (("model.embed_tokens.weight", "lm_head.weight"),)
    assert HFSource(str(tmp_path / "model")).tied_copies(model) == ()


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable:UserWarning")  # reading the checkpoint here
def test_a_model_with_tied_embeddings_trains_and_resumes(tmp_path):
    """``tie_word_embeddings``: the first step's loss is the unsplit model's, the embedding and the head
    are one weight after the steps (in the checkpoint: stored once, under the embedding's name), and the run
    resumes."""
    _needs_hf()
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "tied"
    folder.mkdir()
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    ids = _ids(3000, 128).astype(np.uint16)
    np.save(tmp_path / "t.npy", ids)
    shape = ["--seq-len", "8", "--batch-size", "4", "--microbatch-size", "1"]
    first = _run(["--model", str(folder), "--data", "t.npy", "--pp", "2", "--steps", "2", "--schedule", "1f1b",
                  "--layout", "E,t*2|t*2,L", *shape], tmp_path)
    assert first.returncode == 0, first.stderr
    losses = _losses(tmp_path / "twinpipe-train")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    x, y = BatchSampler(ids, 8, seed=0).batch(0, 4)
    with torch.no_grad():
        logits = model(x).logits
    expected = float(torch.stack([torch.nn.functional.cross_entropy(logits[i], y[i]) for i in range(4)]).mean())
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = str(tmp_path / "twinpipe-train" / "checkpoint-final")
    keys = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    assert not [k for k in keys if "lm_head" in k]  # the tied weight is stored once, under the embedding's name
    embed = _load_state_dict_from_keys({"model.model.embed_tokens.weight"}, checkpoint_id=checkpoint)["model.model.embed_tokens.weight"]
    assert not torch.equal(embed, model.model.embed_tokens.weight.detach())  # trained
    again = _run(["--model", str(folder), "--data", "t.npy", "--pp", "2", "--steps", "3", "--schedule", "dualpipev",
                  "--layout", "E,t|t|t|t,L", "--resume", "twinpipe-train/checkpoint-final", *shape], tmp_path)
    assert again.returncode == 0, again.stderr
    steps = json.loads((tmp_path / "twinpipe-train" / "train-log.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2] and math.isfinite(steps[2]["loss"])  # steps 0 and 1 carried over



def test_a_moe_model_trains_with_expert_parallelism_and_resumes_at_another_ep(tmp_path):
    """``--ep 2 --dp 2`` under DualPipeV (F&B ops overlap the all-to-alls), the router auxiliary loss on
    (a copy of the tiny config with ``output_router_logits``, coefficient 0.1): each data-parallel rank
    holds 2 of the 4 experts of every MoE layer; the first step's loss and gradient norm are the unsplit
    model's, each micro-batch's cross entropy plus 0.1 x its auxiliary loss (1e-5 relative: the float32
    loss); the checkpoint holds each expert's rows once (one tensor of all rows per layer, a chunk per
    rank), and a run without expert parallelism on another mesh resumes from it: its steps' losses are
    the uninterrupted run's."""
    _needs_hf()
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "moe-aux"
    folder.mkdir()
    config = json.loads((TINY_MOE / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "output_router_logits": True, "router_aux_loss_coef": 0.1}))
    ids = _ids(3000, 128).astype(np.uint16)
    np.save(tmp_path / "t.npy", ids)
    shape = ["--seq-len", "8", "--batch-size", "4", "--microbatch-size", "1"]
    first = _run(["--model", str(folder), "--data", "t.npy", "--dp", "2", "--ep", "2", "--pp", "1", "--steps", "4",
                  "--save-every", "2", "--schedule", "dualpipev", *shape], tmp_path)
    assert first.returncode == 0, first.stderr
    losses = _losses(tmp_path / "twinpipe-train")
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
    x, y = BatchSampler(ids, 8, seed=0).batch(0, 4)
    rows = [model(row, attention_mask=torch.ones_like(row)) for row in x.split(1)]  # one micro-batch each
    aux = torch.stack([out.aux_loss for out in rows])
    assert aux.min() > 1  # the auxiliary term weighs in the loss (0.1 x >1 against a cross entropy of ~5)
    loss = torch.stack([torch.nn.functional.cross_entropy(out.logits[0], label) + 0.1 * out.aux_loss
                        for out, label in zip(rows, y)]).mean()
    loss.backward()
    assert losses[0] == pytest.approx(float(loss.detach()), rel=1e-5)
    # the gradient norm counts every expert once (each rank's rows: their squares summed over the ranks)
    norm = float(torch.stack([p.grad.norm() for p in model.parameters()]).norm())
    log = json.loads((tmp_path / "twinpipe-train" / "train-log.json").read_text())["steps"]
    assert log[0]["grad_norm"] == pytest.approx(norm, rel=1e-4)
    saved = tmp_path / "twinpipe-train" / "checkpoint-step2"
    metadata = FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        for key in (f"model.{name}", f"optim.{name}.exp_avg"):
            chunks = metadata[key].chunks  # each rank its 2 experts, once
            assert list(metadata[key].size) == shapes[name] and len(chunks) == 2, key
            assert sorted(c.offsets[0] for c in chunks) == [0, 2] and all(c.sizes[0] == 2 for c in chunks), key
    again = _run(["--model", str(folder), "--data", "t.npy", "--pp", "2", "--steps", "4", "--schedule", "1f1b",
                  "--resume", "twinpipe-train/checkpoint-step2", "--out", "again", *shape], tmp_path)
    assert again.returncode == 0, again.stderr
    steps = json.loads((tmp_path / "again" / "train-log.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [2, 3]
    assert [s["loss"] for s in steps] == pytest.approx(losses[2:], rel=1e-5)


def test_a_moe_model_in_float64_runs_the_eager_experts():
    """``--dtype float64`` with a MoE ``--model``: transformers' default grouped-matmul experts take
    no float64 (every rank failed in its first forward), so the model is built with the eager loop."""
    import argparse

    import torch

    _needs_hf()
    from twinpipe.train_command.model import build_model, load

    info = load(argparse.Namespace(model=str(TINY_MOE), mtp_depth=0, dtype="float64"))
    torch.manual_seed(0)
    model = build_model(info).to(torch.float64)
    logits = model(torch.arange(8).view(1, 8)).logits
    assert logits.dtype == torch.float64 and torch.isfinite(logits).all()
