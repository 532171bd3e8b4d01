"""Splitting a model into stages, the stages each rank holds, the data sampler (one process)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from twinpipe.train.balance import partition
from twinpipe.train.data import BatchSampler, replica_rows, stdlib_corpus
from twinpipe.train.model import GPT, GPTConfig
from twinpipe.train.stages import model_layers, split, stage_modules
from twinpipe.train.trainer import TrainConfig


def _gpt(layers=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=layers)).double()


def test_gpt_layers_are_embedding_blocks_head():
    assert [n for n, _ in model_layers(_gpt(3))] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]


@pytest.mark.parametrize("stages", [1, 2, 3, 6])
def test_stages_run_the_model_bitwise_and_keep_its_parameter_names(stages):
    model = _gpt(4)
    ids = torch.randint(0, 32, (3, 8))
    parts = split(model, stages)
    x = ids
    for part in parts:
        x = part(x)
    assert torch.equal(x, model(ids))
    names = [n for part in parts for n, _ in part.named_model_parameters()]
    assert names == [n for n, _ in model.named_parameters()]


def test_params_balance_equalises_parameter_counts():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 40), nn.Linear(40, 10), nn.Linear(10, 10))
    counts = [sum(p.numel() for p in s.parameters()) for s in split(model, 3)]
    assert counts == [220, 440, 520]  # [L0 L1] [L2] [L3 L4]: the heaviest stage (410+110) as light as possible


def test_partition_is_optimal_against_brute_force():
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 7)
        k = rng.randint(1, n)
        w = [rng.randint(1, 9) for _ in range(n)]
        got = partition(w, k)
        assert len(got) == k and min(got) >= 1 and sum(got) == n

        def worst(counts):
            edges = list(itertools.accumulate([0, *counts]))
            return max(sum(w[a:b]) for a, b in zip(edges, edges[1:]))

        best = min(worst([b - a for a, b in zip((0, *cuts), (*cuts, n))]) for cuts in itertools.combinations(range(1, n), k - 1))
        assert worst(got) == best, (w, k, got)


def test_time_balance_measures_every_layer_and_leaves_no_gradients():
    model = _gpt(4)
    parts = split(model, 3, "time", sample=torch.randint(0, 32, (4, 8)))
    assert [n for p in parts for n in p.names] == [n for n, _ in model_layers(model)]
    assert all(p.grad is None for p in model.parameters())


def test_explicit_balance():
    assert [p.names for p in split(_gpt(2), 2, [1, 3])] == [("embed",), ("blocks.0", "blocks.1", "head")]


@pytest.mark.parametrize("model, stages, kwargs, message", [
    (_gpt(2), 5, {}, "num_stages=5: must be <= 4: the model has only 4 layers (embed, blocks.0, blocks.1, head)"),
    (_gpt(2), 0, {}, "num_stages=0: must be >= 1"),
    (_gpt(2), 2, {"balance": "flops"}, "balance='flops': allowed are 'params', 'time'"),
    (_gpt(2), 2, {"balance": [1, 2]}, "balance=[1, 2]: must sum to the model's 4 layers (layer counts per stage)"),
    (_gpt(2), 2, {"balance": "time"}, "balance='time' measures each layer: pass sample="),
    (nn.Linear(3, 3), 1, {}, "model=Linear: has 0 nn.ModuleList children (none)"),
    (_gpt(2), 2, {"blocks": "layers"}, "blocks='layers': GPT has no nn.ModuleList child of that name"),
])
def test_models_that_cannot_be_split_as_asked(model, stages, kwargs, message):
    with pytest.raises(ValueError) as err:
        split(model, stages, **kwargs)
    assert message in str(err.value)


def test_stage_modules_follow_the_placement():
    stages = split(_gpt(2), 4)
    assert stage_modules(stages, "dualpipe", 4, 1) == [stages[1], stages[2]]  # model stage 1, and 4-1-1 mirrored
    assert stage_modules(stages, "1f1b", 4, 3) == [stages[3]]
    assert stage_modules(stages, "dualpipev", 2, 0) == [stages[0], stages[3]]
    # BitPipe on one rank holds both copies of each stage: the second is a copy, not the same module.
    one = split(_gpt(2), 2)
    held = stage_modules(one, "bitpipe", 1, 0)
    assert held[:2] == one and held[2] is not one[0] and held[3] is not one[1]
    assert all(torch.equal(a, b) and a is not b for a, b in zip(held[2].parameters(), one[0].parameters()))
    with pytest.raises(ValueError, match=r"stages: 4 given, but 'dualpipev' on 4 ranks runs a model cut into 8 stages"):
        stage_modules(stages, "dualpipev", 4, 0)


def test_sampler_is_a_function_of_the_step():
    tokens = torch.arange(1000) % 251
    a, b = BatchSampler(tokens, 16, seed=1), BatchSampler(tokens, 16, seed=1)
    x, y = a.batch(7, 6)
    assert torch.equal(x, b.batch(7, 6)[0]) and torch.equal(y, b.batch(7, 6)[1])
    assert not torch.equal(x, a.batch(8, 6)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the next bytes
    assert replica_rows(12, 3, 1) == slice(4, 8)


def test_stdlib_corpus_is_bytes():
    corpus = stdlib_corpus(50_000)
    assert corpus.dtype == torch.uint8 and corpus.numel() == 50_000
    assert b"import" in bytes(corpus.tolist())


def test_stdlib_corpus_reads_the_sources_in_path_order_and_never_lists_skipped_folders(tmp_path, monkeypatch):
    # A made-up standard library: files in path order; site-packages, dist-packages, test and idlelib
    # skipped at the top (a nested "test" is read), "tests" anywhere; only *.py; a symlinked folder
    # is not entered. The skipped folders are not even listed (site-packages alone can hold far more
    # files than the standard library, and every rank reads the corpus at start).
    import os
    import sysconfig

    files = {"a.py": b"A", "b/c.py": b"C", "b/test/d.py": b"D", "b/tests/e.py": b"x", "b_z.py": b"B",
             "site-packages/f.py": b"x", "dist-packages/g.py": b"x", "test/h.py": b"x", "idlelib/i.py": b"x",
             "tests/j.py": b"x", "k.txt": b"x", ".hidden/l.py": b"L"}
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    (tmp_path / "linked").symlink_to(tmp_path / "b", target_is_directory=True)
    listed = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": (listed.append(os.fspath(path)), scandir(path))[1])
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert bytes(stdlib_corpus(100).tolist()) == b"LACDB"  # .hidden/l.py, a.py, b/c.py, b/test/d.py, b_z.py
    assert bytes(stdlib_corpus(3).tolist()) == b"LAC"
    skipped = ("site-packages", "dist-packages", "test", "idlelib", "tests", "b/tests", "linked")
    assert not [p for p in listed if os.path.relpath(p, tmp_path) in skipped], listed


def test_batch_must_divide_into_microbatches_per_replica():
    with pytest.raises(ValueError, match=r"batch_size=10: must be a multiple of dp=2 x microbatch_size=4"):
        TrainConfig(batch_size=10, microbatch_size=4).num_microbatches(2)


def test_overlap_dp_must_be_a_bool_and_is_refused_before_the_mesh_is_used():
    from twinpipe.train.trainer import Trainer

    with pytest.raises(ValueError, match=r"overlap_dp='yes': must be True or False"):
        Trainer(_gpt, None, None, None, None, TrainConfig(schedule="1f1b", overlap_dp="yes"))  # no mesh: nothing collective ran
