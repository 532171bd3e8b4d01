"""twinpipe.hf.weights: each rank reads only its tensors (and experts) of a transformers checkpoint,
and a collective save writes one that ``from_pretrained`` loads bitwise, complete or absent.

This process builds tiny Llama (tied and untied), Mixtral, Qwen3-MoE and DeepSeek-V3 models with
random weights and writes each with ``save_pretrained``: a single file, and sharded
(``max_shard_size``); Qwen3-MoE also with fused expert keys (``save_original_format=False``). Then
one 2-process gloo world runs every case: each rank loads half of the layers (files opened and keys
read counted), expert rows split over the 2 ranks with a redundant row, a save from 2 ranks (layers
split, experts split with a redundant row, a mirrored copy of a layer on both ranks, the tied head
on the other rank) read back with ``from_pretrained``, and faults: an injected write error on one
rank, a tensor no rank holds, a non-empty target, a SystemExit or Ctrl-C in an exchange. Load errors
are checked here, without a world.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distributed import run_cases, run_world

WORLD = 2
KILL_TIMEOUT = 4.0  # seconds the surviving rank waits for a dead one
SMALL = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, max_position_embeddings=64)


def _configs() -> dict:
    from transformers import DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen3MoeConfig

    return {
        "llama-tied": LlamaConfig(**SMALL, intermediate_size=24, num_hidden_layers=4, num_key_value_heads=1, tie_word_embeddings=True),
        "llama": LlamaConfig(**SMALL, intermediate_size=24, num_hidden_layers=4, num_key_value_heads=1, tie_word_embeddings=False),
        "mixtral": MixtralConfig(**SMALL, intermediate_size=24, num_hidden_layers=2, num_key_value_heads=1, num_local_experts=4,
                                 num_experts_per_tok=2),
        "qwen3-moe": Qwen3MoeConfig(**SMALL, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2, num_key_value_heads=1,
                                    num_experts=4, num_experts_per_tok=2, head_dim=8),
        "deepseek-v3": DeepseekV3Config(**SMALL, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=3, first_k_dense_replace=1,
                                        num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                        kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                                        n_shared_experts=1),
    }


LAYOUTS = ("single", "sharded")
MOE = ("mixtral", "qwen3-moe", "deepseek-v3")


def _make(root: Path) -> None:
    """Each model: its state dict (``ref.pt``) and checkpoints ``single/``, ``sharded/`` (and ``fused/``)."""
    from transformers import AutoModelForCausalLM

    for i, (arch, config) in enumerate(_configs().items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # some tensors start as zeros or ones: make every one distinct
            for p in model.parameters():
                p.normal_()
        folder = root / arch
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, folder.with_suffix(".pt"))
        model.save_pretrained(folder / "single")
        model.save_pretrained(folder / "sharded", max_shard_size="6KB")
        if arch == "qwen3-moe":
            model.save_pretrained(folder / "fused", save_original_format=False)


def _halves(names: list[str], rank: int) -> list[str]:
    """Rank 0: embeddings and the first half of the layers; rank 1: the rest, final norm and head."""
    layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
    mine = set(layers[: len(layers) // 2]) if rank == 0 else set(layers[len(layers) // 2 :])
    out = []
    for n in names:
        if n.startswith("model.layers."):
            if int(n.split(".")[2]) in mine:
                out.append(n)
        elif (n.startswith("model.embed_tokens") and rank == 0) or (not n.startswith("model.embed_tokens") and rank == 1):
            out.append(n)
    return out


class _CountedSlice:
    """A safetensors slice that adds the bytes of every piece taken from it to ``counter.bytes``."""

    def __init__(self, piece, counter):
        self.piece, self.counter = piece, counter

    def get_shape(self):
        return self.piece.get_shape()

    def __getitem__(self, index):
        out = self.piece[index]
        self.counter.bytes += out.numel() * out.element_size()
        return out


class _Counting:
    """Records the files ``load`` opens, the keys it reads and the bytes it takes from the files
    (patched into the reading module: every tensor is read through a slice)."""

    def __enter__(self):
        from twinpipe.hf import _safetensors_files as files

        self.files, self.opened, self.read, self.rows, self.bytes = files, [], [], [], 0
        self._open, self._read, self._slice = files.safe_open, files.CheckpointFiles.read, files.CheckpointFiles._slice
        counter = self

        def _slice(this, key):
            return _CountedSlice(counter._slice(this, key), counter)

        def safe_open(path, *args, **kwargs):
            counter.opened.append(Path(path).name)
            return counter._open(path, *args, **kwargs)

        def read(this, key, rows=None):
            counter.read.append(key)
            counter.rows.append(None if rows is None else list(rows))
            return counter._read(this, key, rows)

        files.safe_open, files.CheckpointFiles.read, files.CheckpointFiles._slice = safe_open, read, _slice
        return self

    def __exit__(self, *exc):
        self.files.safe_open, self.files.CheckpointFiles.read, self.files.CheckpointFiles._slice = self._open, self._read, self._slice


def _key_files(folder: Path) -> dict[str, str]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def _load_half(root: Path, arch: str, layout: str, rank: int) -> dict:
    from twinpipe.hf._safetensors_names import ModelNames
    from twinpipe.hf.weights import load

    ref = torch.load(root / f"{arch}.pt")
    folder = root / arch / layout
    mine = _halves(list(ref), rank)
    with _Counting() as seen:
        got = load(folder, mine)
    names = ModelNames(transformers.AutoConfig.from_pretrained(str(folder)))
    wanted = {names.canonical(n) for n in mine}
    where = _key_files(folder)
    return {
        "equal": sorted(n for n in mine if not torch.equal(got[n], ref[n])) or True,
        "count": len(got) == len(mine),
        "foreign reads": sorted(k for k in seen.read if names.from_disk(k)[0] not in wanted),
        "each read once": len(seen.read) == len(set(seen.read)),
        "opened": sorted(set(seen.opened)),
        "needed": sorted({where[k] for k in seen.read}),
        "files": len(set(where.values())),
        "opened once": len(seen.opened) == len(set(seen.opened)),
    }


def _expert_rows(rank: int) -> tuple[int, ...]:
    return (0, 1) if rank == 0 else (2, 3, 1)  # expert 1 twice in the world, and in any order


def _load_experts(root: Path, arch: str, layout: str, rank: int) -> dict:
    from twinpipe.hf._safetensors_names import ModelNames
    from twinpipe.hf.weights import Place, load

    ref = torch.load(root / f"{arch}.pt")
    folder = root / arch / layout
    rows = _expert_rows(rank)
    fused = [n for n in ref if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    places = {f"local.{i}": Place(n, rows) for i, n in enumerate(fused)}
    with _Counting() as seen:
        got = load(folder, places, dtype=torch.float64)
    names = ModelNames(transformers.AutoConfig.from_pretrained(str(folder)))
    experts_read = sorted({names.from_disk(k)[2] for k in seen.read} - {None})
    return {
        "equal": sorted(p.name for k, p in places.items() if not torch.equal(got[k], ref[p.name][list(rows)].double())) or True,
        "fused": len(fused),
        "experts read": experts_read,
        "rows read": sorted({str(r) for r in seen.rows}),
        "dtype": str(got["local.0"].dtype),
        # what was taken from the files: the rows asked for, in the checkpoint's dtype (float32), once each
        "bytes": (seen.bytes, sum(ref[p.name][list(rows)].numel() * ref[p.name].element_size() for p in places.values())),
    }


def _save_parts(ref: dict, config, rank: int) -> dict:
    """What rank ``rank`` passes to ``save``: half of the layers (the tied head on rank 1), the expert
    rows of every MoE layer split with a redundant row, and layer 0's attention on both ranks."""
    from twinpipe.hf.weights import Place

    fused = {n for n in ref if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    parts = {}
    for n in _halves([n for n in ref if n not in fused], rank):
        parts[f"stage.{n}"] = (Place(n), ref[n].clone())
    if rank == 1:  # DualPipe's mirror: the same layer held on a second rank
        for n in ref:
            if n.startswith("model.layers.0.self_attn."):
                parts[f"mirror.{n}"] = (Place(n), ref[n].clone())
    rows = _expert_rows(rank)
    for n in sorted(fused):
        parts[f"experts.{n}"] = (Place(n, rows), ref[n][list(rows)].clone())
    return parts


def _save_and_read(group, root: Path, arch: str, out: Path) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from twinpipe.hf.weights import save

    rank = dist.get_rank(group)
    ref = torch.load(root / f"{arch}.pt")
    config = transformers.AutoConfig.from_pretrained(str(root / arch / "single"))
    save(out, _save_parts(ref, config, rank), config, group=group, timeout=120)
    result = {"files": sorted(os.listdir(out))}
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(str(out))
        state = model.state_dict()
        result["equal"] = sorted(n for n in ref if not torch.equal(state[n], ref[n])) or True
        result["same keys"] = set(state) == set(ref)
        result["like save_pretrained"] = sorted(_key_files(out)) == sorted(_key_files(root / arch / "single"))
    dist.barrier(group)
    return result


def _raises(fn) -> str:
    try:
        fn()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _fault(group, root: Path, out: Path) -> dict:
    """Rank 1's write fails (a full disk): every rank raises; no folder, no temporary folder."""
    import torch.distributed as dist
    from safetensors import torch as safetensors_torch

    from twinpipe.hf.weights import save

    rank = dist.get_rank(group)
    ref = torch.load(root / "qwen3-moe.pt")
    config = transformers.AutoConfig.from_pretrained(str(root / "qwen3-moe" / "single"))
    original = safetensors_torch.save_file

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    if rank == 1:
        safetensors_torch.save_file = full_disk
    try:
        error = _raises(lambda: save(out, _save_parts(ref, config, rank), config, group=group, timeout=120))
    finally:
        safetensors_torch.save_file = original
    dist.barrier(group)
    return {"error": error, "left": sorted(p.name for p in out.parent.iterdir() if out.name in p.name)}


def _missing(group, root: Path, out: Path) -> dict:
    """No rank holds the final norm: every rank raises naming it, nothing is written."""
    import torch.distributed as dist

    from twinpipe.hf.weights import save

    rank = dist.get_rank(group)
    ref = torch.load(root / "llama.pt")
    config = transformers.AutoConfig.from_pretrained(str(root / "llama" / "single"))
    parts = {k: v for k, v in _save_parts(ref, config, rank).items() if v[0].name != "model.norm.weight"}
    error = _raises(lambda: save(out, parts, config, group=group, timeout=120))
    dist.barrier(group)
    return {"error": error, "left": sorted(p.name for p in out.parent.iterdir() if out.name in p.name)}


def _overwrite(group, root: Path, out: Path) -> dict:
    """A non-empty target is refused (and kept); with overwrite=True it is replaced."""
    import torch.distributed as dist

    from twinpipe.hf.weights import save

    rank = dist.get_rank(group)
    if rank == 0:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    dist.barrier(group)
    ref = torch.load(root / "llama.pt")
    config = transformers.AutoConfig.from_pretrained(str(root / "llama" / "single"))
    parts = _save_parts(ref, config, rank)
    refused = _raises(lambda: save(out, parts, config, group=group, timeout=120))
    kept = (out / "keep.txt").read_text() if (out / "keep.txt").exists() else None
    dist.barrier(group)
    replaced = _raises(lambda: save(out, parts, config, group=group, timeout=120, overwrite=True))
    return {"refused": refused, "kept": kept, "replaced": replaced, "files": sorted(os.listdir(out)),
            "left": sorted(p.name for p in out.parent.iterdir() if out.name in p.name)}


def _copies_differ(group, root: Path, out: Path) -> dict:
    """Rank 1's mirrored copy of a layer differs in one element from rank 0's: every rank raises naming it."""
    import torch.distributed as dist

    from twinpipe.hf.weights import save

    rank = dist.get_rank(group)
    ref = torch.load(root / "deepseek-v3.pt")
    config = transformers.AutoConfig.from_pretrained(str(root / "deepseek-v3" / "single"))
    parts = _save_parts(ref, config, rank)
    if rank == 1:
        parts["mirror.model.layers.0.self_attn.o_proj.weight"][1][0, 0] += 1
    error = _raises(lambda: save(out, parts, config, group=group, timeout=120))
    dist.barrier(group)
    return {"error": error, "left": sorted(p.name for p in out.parent.iterdir() if out.name in p.name)}


def _configs_differ(group, root: Path, out: Path) -> dict:
    """Rank 1 passes another config (the ranks would plan different files): every rank raises."""
    import torch.distributed as dist

    from twinpipe.hf.weights import save

    rank = dist.get_rank(group)
    ref = torch.load(root / "llama.pt")
    config = transformers.AutoConfig.from_pretrained(str(root / "llama" / "single"))
    parts = _save_parts(ref, config, rank)
    if rank == 1:
        config.rms_norm_eps = 1e-3
    error = _raises(lambda: save(out, parts, config, group=group, timeout=120))
    dist.barrier(group)
    return {"error": error, "left": sorted(p.name for p in out.parent.iterdir() if out.name in p.name)}


def _interrupted(group, root: Path, out: Path, interruption, during: str) -> dict:
    """Every rank's save raises ``interruption`` (a SIGTERM handler's SystemExit, a Ctrl-C) as the
    exchange ``during`` ends: it is re-raised, and no temporary folder is left behind."""
    import torch.distributed as dist

    from twinpipe.hf import _safetensors_save
    from twinpipe.hf.weights import save

    rank = dist.get_rank(group)
    ref = torch.load(root / "llama.pt")
    config = transformers.AutoConfig.from_pretrained(str(root / "llama" / "single"))
    original = _safetensors_save.gather_json

    def gather(group, obj, timeout, what):
        said = original(group, obj, timeout, what)  # as it ends: every rank is done with the folder until then
        if what.endswith(during):
            raise interruption("injected")
        return said

    _safetensors_save.gather_json = gather
    try:
        save(out, _save_parts(ref, config, rank), config, group=group, timeout=120)
        raised = "no interruption"
    except (KeyboardInterrupt, SystemExit) as error:
        raised = type(error).__name__
    finally:
        _safetensors_save.gather_json = original
    dist.barrier(group)
    return {"raised": raised, "left": sorted(p.name for p in out.parent.iterdir() if out.name in p.name)}


def _world(rank: int, world_size: int, root: str) -> dict:
    root = Path(root)
    cases = {}
    for arch in _configs():
        for layout in LAYOUTS:
            cases[f"load/{arch}/{layout}"] = (WORLD, lambda g, a=arch, lay=layout: _load_half(root, a, lay, rank))
    for arch in MOE:
        cases[f"experts/{arch}/sharded"] = (WORLD, lambda g, a=arch: _load_experts(root, a, "sharded", rank))
    cases["experts/qwen3-moe/fused"] = (WORLD, lambda g: _load_experts(root, "qwen3-moe", "fused", rank))
    for arch in _configs():
        cases[f"save/{arch}"] = (WORLD, lambda g, a=arch: _save_and_read(g, root, a, root / "saved" / a))
    cases["fault"] = (WORLD, lambda g: _fault(g, root, root / "saved" / "fault"))
    cases["missing"] = (WORLD, lambda g: _missing(g, root, root / "saved" / "missing"))
    cases["copies differ"] = (WORLD, lambda g: _copies_differ(g, root, root / "saved" / "copies"))
    cases["configs differ"] = (WORLD, lambda g: _configs_differ(g, root, root / "saved" / "configs"))
    cases["overwrite"] = (WORLD, lambda g: _overwrite(g, root, root / "saved" / "overwrite"))
    for name, interruption, during in (("exit while preparing", SystemExit, ": preparing"),
                                       ("ctrl-c after writing", KeyboardInterrupt, ": waiting for every rank to write its shard")):
        cases[name] = (WORLD, lambda g, n=name, i=interruption, d=during: _interrupted(g, root, root / "saved" / n, i, d))
    results = run_cases(rank, world_size, cases)
    # Last: rank 1 dies as it starts writing its shard; rank 0 must raise within the timeout, leaving nothing.
    import time

    import torch.distributed as dist
    from safetensors import torch as safetensors_torch

    from twinpipe.hf.weights import save

    everyone = [None] * world_size
    dist.all_gather_object(everyone, results)
    ref = torch.load(root / "llama.pt")
    config = transformers.AutoConfig.from_pretrained(str(root / "llama" / "single"))
    out = root / "saved" / "killed"
    if rank == 1:
        safetensors_torch.save_file = lambda *args, **kwargs: os._exit(3)
    start = time.monotonic()
    killed = _raises(lambda: save(out, _save_parts(ref, config, rank), config, timeout=KILL_TIMEOUT))
    return {"ranks": everyone, "killed": killed, "elapsed": time.monotonic() - start,
            "left": sorted(p.name for p in out.parent.iterdir() if out.name in p.name)}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-weights")
    _make(root)
    (root / "saved").mkdir()
    return root, run_world(WORLD, _world, str(root), timeout=300, allow_deaths=True)


def _both(world, name: str) -> list:
    results = [r[name] for r in world[1][0]["ranks"]]
    for r in results:
        assert not isinstance(r, str), r  # a case that raised
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", list(_configs()))
def test_each_rank_reads_only_its_tensors_and_gets_the_models(world, arch, layout):
    for r in _both(world, f"load/{arch}/{layout}"):
        assert r["equal"] is True and r["count"], r
        assert r["foreign reads"] == [] and r["each read once"], r
        assert r["opened"] == r["needed"] and r["opened once"], r  # no file opened but the ones holding its tensors
        if layout == "sharded":
            assert r["files"] >= 3 and len(r["opened"]) < r["files"], r  # the shards are many: this rank skipped some


@pytest.mark.parametrize("case", [f"experts/{a}/sharded" for a in MOE] + ["experts/qwen3-moe/fused"])
def test_expert_rows_split_over_two_ranks_with_a_redundant_row(world, case):
    for rank, r in enumerate(_both(world, case)):
        assert r["equal"] is True and r["fused"] >= 2 and r["dtype"] == "torch.float64", r
        assert r["bytes"][0] == r["bytes"][1], r
        if not case.endswith("fused"):  # stored per expert: only this rank's experts were read
            assert r["experts read"] == sorted(set(_expert_rows(rank))), r
        else:  # stored fused: only its rows were read
            assert r["rows read"] == [str(list(_expert_rows(rank)))], r


@pytest.mark.parametrize("case", [f"{arch}/sharded" for arch in MOE] + ["qwen3-moe/fused"])
def test_the_trainers_ep_ranks_read_only_their_expert_rows(world, case):
    """``twinpipe train --model DIR --ep 2`` (``HFSource`` with an EP group, here 2 ranks simulated in
    this process): each rank takes from the files exactly the bytes of the tensors it holds, of each
    fused expert tensor its own half of the rows (stored per expert: only its experts' keys), and
    gets the checkpoint's values."""
    from transformers import AutoModelForCausalLM

    from twinpipe.moe.local import LocalEPGroup
    from twinpipe.schedule.spec import resolve
    from twinpipe.hf import HFSource

    root, (arch, layout) = world[0], case.split("/")
    folder, ref = root / arch / layout, torch.load(root / f"{arch}.pt")
    group = LocalEPGroup(2)
    for rank in range(2):
        model = AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(folder)))
        stages = HFSource(str(folder), weights=True, ep_group=group.rank(rank))
        with _Counting() as seen:
            modules = stages.build(model, resolve("1f1b", 1), 0)
        held = dict(p for m in modules for p in m.named_model_parameters())
        experts = {n: p for n, p in held.items() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        assert experts and all(len(p) == len(ref[n]) // 2 for n, p in experts.items())
        rows = list(range(rank * 2, rank * 2 + 2))
        assert all(torch.equal(p.detach(), ref[n][rows] if n in experts else ref[n]) for n, p in held.items())
        buffers = [b for m in modules for _, b in m.named_model_buffers()]  # read too: DeepSeek-V3's routing biases
        assert seen.bytes == sum(t.numel() * t.element_size() for t in [*held.values(), *buffers]), (rank, seen.bytes)


@pytest.mark.parametrize("arch", list(_configs()))
def test_a_save_from_two_ranks_loads_with_from_pretrained_bitwise(world, arch):
    first, second = _both(world, f"save/{arch}")
    assert first["equal"] is True and first["same keys"], first
    assert first["like save_pretrained"], "the keys are not the ones save_pretrained writes"
    assert first["files"] == second["files"] == ["config.json", "model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors", "model.safetensors.index.json"]


def test_a_write_failing_on_one_rank_raises_on_every_rank_and_leaves_no_folder(world):
    for r in _both(world, "fault"):
        assert r["error"].startswith("CheckpointWriteError:") and "rank 1: OSError" in r["error"], r
        assert "No space left on device (injected)" in r["error"] and r["left"] == [], r


def test_a_tensor_no_rank_holds_is_named_on_every_rank_and_nothing_is_written(world):
    for r in _both(world, "missing"):
        assert r["error"].startswith("CheckpointWriteError:") and "model.norm.weight" in r["error"], r
        assert r["left"] == [], r


def test_a_non_empty_target_is_refused_unless_overwrite_replaces_it(world):
    for r in _both(world, "overwrite"):
        assert "exists and is not empty; pass overwrite=True" in r["refused"] and r["kept"] == "mine", r
        assert r["replaced"] == "no error" and "keep.txt" not in r["files"] and "config.json" in r["files"], r
        assert r["left"] == ["overwrite"], r


@pytest.mark.parametrize("case", ["exit while preparing", "ctrl-c after writing"])
def test_a_save_interrupted_by_a_signal_or_ctrl_c_leaves_no_temporary_folder(world, case):
    for r in _both(world, case):
        assert r["raised"] in ("SystemExit", "KeyboardInterrupt") and r["left"] == [], r


def test_copies_that_differ_are_named_on_every_rank_and_nothing_is_written(world):
    for r in _both(world, "copies differ"):
        assert r["error"].startswith("CheckpointWriteError:"), r
        assert "ranks 0 and 1 hold different values of 'model.layers.0.self_attn.o_proj.weight'" in r["error"], r
        assert r["left"] == [], r


def test_ranks_passing_different_configs_all_raise(world):
    for r in _both(world, "configs differ"):
        assert r["error"].startswith("CheckpointWriteError:") and "rank(s) [1] passed another config" in r["error"], r
        assert r["left"] == [], r


def test_a_rank_dying_during_a_save_makes_the_other_raise_within_the_timeout_leaving_nothing(world):
    dead, alive = world[1][1], world[1][0]
    assert dead[0] == "died", dead
    assert alive["killed"].startswith(("PipelineTimeout", "PipelineCommError")), alive["killed"]  # its death or the timeout
    assert "saving" in alive["killed"] and "waiting for every rank to write its shard" in alive["killed"], alive["killed"]
    assert alive["elapsed"] < KILL_TIMEOUT + 30, alive["elapsed"]  # the timeout, not the process group's 10 minutes
    assert alive["left"] == [], alive["left"]


# ---- in this process

def test_replicas_take_turns_writing_and_one_writer_writes_model_safetensors():
    from twinpipe.hf._safetensors_names import ModelNames
    from twinpipe.hf._safetensors_save import make_plan as _plan

    names = ModelNames(_configs()["qwen3-moe"])
    every = [[n, list(range(names.shapes[n][0])) if n in names.fused else None, "torch.float32", None] for n in names.stored()]
    plan = _plan(names, [{"claims": every}, {"claims": every}])
    owners = list(plan.owner.values())
    assert set(owners) == {0, 1} and abs(owners.count(0) - owners.count(1)) <= 1
    assert plan.files == {0: "model-00001-of-00002.safetensors", 1: "model-00002-of-00002.safetensors"}
    assert _plan(names, [{"claims": every}, {"claims": []}]).files == {0: "model.safetensors"}


def test_a_save_without_a_process_group_writes_one_file_in_the_tensors_dtype(world, tmp_path):
    from transformers import AutoModelForCausalLM

    from twinpipe.hf.weights import save

    root = world[0]
    ref = {n: t.to(torch.bfloat16) for n, t in torch.load(root / "mixtral.pt").items()}
    config = transformers.AutoConfig.from_pretrained(str(root / "mixtral" / "single"))
    save(tmp_path / "out", ref, config)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert config.dtype == torch.float32  # the caller's config is left as it was
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert all(torch.equal(model.state_dict()[n], ref[n]) for n in ref) and model.dtype == torch.bfloat16


def test_two_local_copies_that_differ_are_refused(world, tmp_path):
    from twinpipe.hf.weights import Place, save

    ref = torch.load(world[0] / "qwen3-moe.pt")
    config = transformers.AutoConfig.from_pretrained(str(world[0] / "qwen3-moe" / "single"))
    name = "model.layers.1.mlp.experts.down_proj"
    other = ref[name][[1]].clone()
    other[0, 0, 0] += 1
    parts = {**ref, "again": (Place(name, (1,)), other)}
    with pytest.raises(Exception, match=r"tensors\['again'\] and tensors\['model.layers.1.mlp.experts.down_proj'\] are both "
                                        r"expert 1 of 'model.layers.1.mlp.experts.down_proj' but differ"):
        save(tmp_path / "out", parts, config)
    assert not (tmp_path / "out").exists()
    save(tmp_path / "out", {**ref, "again": (Place(name, (1,)), ref[name][[1]].clone())}, config)  # an equal copy is fine


def test_a_tensor_converted_by_another_operation_is_refused_by_name(world, monkeypatch):
    from twinpipe.hf import _safetensors_names
    from twinpipe.hf.weights import load

    monkeypatch.setattr(_safetensors_names, "_ops", lambda converter: "its conversion is [Transpose(dim0=1, dim1=2)]")
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.experts.down_proj' is stored through a transformers "
                                         r"conversion this loader does not read \(its conversion is \[Transpose"):
        load(world[0] / "qwen3-moe" / "single", ["model.layers.0.mlp.experts.down_proj"])


def test_the_docs_example_runs_and_round_trips(tmp_path, monkeypatch):
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "hf-weights.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)[1]
    monkeypatch.chdir(tmp_path)  # the block writes its own checkpoint folder
    scope: dict = {}
    exec(compile(code, "docs/hf-weights.md", "exec"), scope)
    ref = scope["source"].state_dict()
    assert scope["tensors"]["my_experts"].shape == (3, 16, 16)
    assert torch.equal(scope["tensors"]["my_experts"], ref[scope["experts"]][[2, 3, 1]])
    assert all(torch.equal(scope["model"].state_dict()[n], ref[n]) for n in ref)


# ---- load errors, in this process

def test_a_tensor_the_folder_lacks_or_of_another_shape_is_named_with_its_file_and_shape(world, tmp_path):
    from safetensors.torch import load_file, save_file

    from twinpipe.hf.weights import CheckpointError, load

    root = world[0]
    single = root / "llama" / "single"
    state = load_file(str(single / "model.safetensors"))
    (tmp_path / "config.json").write_text((single / "config.json").read_text())
    state.pop("model.norm.weight")
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:5]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"has no tensor 'model.norm.weight', expected shape \[16\] \(files: model.safetensors\)"):
        load(tmp_path, ["model.norm.weight"])
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.up_proj.weight' \(key 'model.layers.0.mlp.up_proj.weight' "
                                              r"in .*model.safetensors\): shape \[5, 16\] on disk, expected \[24, 16\]"):
        load(tmp_path, ["model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match=r"'model.layers.9.mlp.up_proj.weight' is not a tensor of LlamaForCausalLM"):
        load(tmp_path, ["model.layers.9.mlp.up_proj.weight"])


def test_a_missing_expert_and_rows_out_of_range_are_named(world, tmp_path):
    from safetensors.torch import load_file, save_file

    from twinpipe.hf.weights import CheckpointError, Place, load

    single = world[0] / "qwen3-moe" / "single"
    state = load_file(str(single / "model.safetensors"))
    (tmp_path / "config.json").write_text((single / "config.json").read_text())
    state.pop("model.layers.1.mlp.experts.2.up_proj.weight")
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert load(tmp_path, {"a": Place(name, (0, 3))})["a"].shape == (2, 16, 16)  # the missing expert is not read
    with pytest.raises(CheckpointError, match=r"has no expert 2 of tensor 'model.layers.1.mlp.experts.gate_up_proj' "
                                              r"\(expected a key matching 'mlp.experts.\*.up_proj.weight' with index 2, shape \[8, 16\]"):
        load(tmp_path, {"a": Place(name, (2,))})
    with pytest.raises(ValueError, match=r"rows \[4\] of 'model.layers.1.mlp.experts.gate_up_proj': it has 4 rows"):
        load(tmp_path, {"a": Place(name, (4,))})
    with pytest.raises(ValueError, match=r"Place.rows=\(\): must be a non-empty sequence"):
        Place(name, ())


def test_a_folder_without_a_checkpoint_or_of_another_kind_of_model_is_refused(tmp_path):
    from transformers import ViTConfig

    from twinpipe.hf.weights import CheckpointError, load

    with pytest.raises(CheckpointError, match="has no config.json"):
        load(tmp_path, ["model.norm.weight"])
    ViTConfig().save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"config ViTConfig \(model_type 'vit'\): transformers builds no causal LM from it"):
        load(tmp_path, ["model.norm.weight"])


def test_bad_arguments_are_named_briefly(world, tmp_path):
    from twinpipe.hf.weights import load, save

    root = world[0]
    ref = torch.load(root / "llama.pt")
    config = transformers.AutoConfig.from_pretrained(str(root / "llama" / "single"))
    with pytest.raises(ValueError, match=r"^places\['model.embed_tokens.weight'\]='Tensor': must be a Place or a tensor name$"):
        load(root / "llama" / "single", ref)  # a state dict is not a map of places
    with pytest.raises(Exception, match=r"tensors\['x'\]='\(Tensor, Tensor\)': must be a tensor or a \(Place, tensor\) pair"):
        save(tmp_path / "out", {**ref, "x": (ref["model.norm.weight"], ref["model.norm.weight"])}, config)
    with pytest.raises(ValueError, match=r"timeout=0: must be a finite number >= 0.001"):
        save(tmp_path / "out", ref, config, timeout=0)
    assert not (tmp_path / "out").exists()


def test_has_weights_tells_a_checkpoint_from_a_config_alone(world, tmp_path):
    from twinpipe.hf.weights import has_weights

    transformers.AutoConfig.from_pretrained(str(world[0] / "llama" / "single")).save_pretrained(str(tmp_path))
    assert not has_weights(tmp_path)
    assert has_weights(world[0] / "llama" / "single") and has_weights(world[0] / "llama" / "sharded")


def test_load_into_fills_a_modules_tensors_in_its_dtype(world):
    from transformers import AutoModelForCausalLM

    from twinpipe.hf.weights import load_into

    root = world[0]
    config = transformers.AutoConfig.from_pretrained(str(root / "llama-tied" / "sharded"))
    model = AutoModelForCausalLM.from_config(config).to(torch.float64)
    filled = load_into(model, root / "llama-tied" / "sharded")
    ref = torch.load(root / "llama-tied.pt")
    assert set(filled) == set(ref)
    assert all(torch.equal(model.state_dict()[n], ref[n].double()) for n in ref)
