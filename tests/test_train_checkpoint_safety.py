"""Checkpoints are complete or absent, checked before use, and never run code from the folder.

One 2-process gloo world (PP=2, 1F1B, AdamW): a checkpoint at step 3, then faults injected while
saving over it (a rank's disk full in the middle of its write, the final rename failing, last a rank
killed by ``os._exit`` as it starts its write; a rank writing into a folder rank 0 does not see, as
on several hosts without a shared filesystem); damaged copies (a flipped byte, a truncated file, a
damaged ``.metadata``, no marker); crafted copies (a ``.metadata`` pickle that runs code, a pickled
``trainer`` item); another model configuration with the same shapes; other optimizer
hyper-parameters; optimizer state that is not a tensor; saves interrupted by a SystemExit (what a
SIGTERM handler raises) or a KeyboardInterrupt; optimizer-state files outside the folder or nested
too deeply. Before the kill, rank 1 hands its results to rank 0, which returns every rank's. The
tests in this process (no world) check the crafted folders (a table: names escaping the folder,
symbolic links, a FIFO, oversized and deeply nested files) through ``read_checkpoint_info`` and
``twinpipe train --resume``, and which temporary folders a save removes.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import io
import json
import os
import pickle
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

from distributed import run_world
from train_setup import tiny_setup

WORLD = 2
MARKER = "twinpipe-checkpoint.json"


class Evil:
    """Unpickling this creates the file ``flag`` (stands for any code a crafted pickle could run)."""

    def __init__(self, flag: str):
        self.flag = flag

    def __reduce__(self):
        return (open, (self.flag, "w"))


def _sha(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _update_marker(folder: Path, *names: str) -> None:
    """Make the marker (if any) agree with the files ``names`` as they are now: a crafter can."""
    marker = folder / MARKER
    if marker.exists():
        record = json.loads(marker.read_text())
        for name in names:
            record["files"][name] = _sha(folder / name)
        marker.write_text(json.dumps(record))


def craft_metadata_folder(folder: Path, flag: str) -> None:
    """A folder whose ``.metadata`` is a pickle that runs code, with a marker that agrees with it."""
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps(Evil(flag)))
    record = {"format": "twinpipe-checkpoint", "version": 1, "step": 0, "files": {".metadata": _sha(folder / ".metadata")},
              "model": {"parameters": [], "record": {}}, "optimizer": {"class": "AdamW", "param_groups": []}}
    (folder / MARKER).write_text(json.dumps(record))


def craft_bytes_item(source: Path, folder: Path, flag: str) -> None:
    """A copy of a genuine checkpoint with a ``trainer`` item that is a ``torch.save`` payload running code."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    shutil.copytree(source, folder)
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # this test's own file
    payload = io.BytesIO()
    torch.save(Evil(flag), payload)
    (folder / "__9_0.distcp").write_bytes(payload.getvalue())
    metadata.state_dict_metadata["trainer"] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex("trainer")] = _StorageInfo("__9_0.distcp", 0, len(payload.getvalue()))
    if isinstance(metadata.planner_data, dict):
        metadata.planner_data["trainer"] = ("trainer",)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _update_marker(folder, ".metadata", "__9_0.distcp")


def _set_state_files(folder: Path, names) -> None:
    """The marker's list of optimizer-state files set to ``names`` (digests untouched)."""
    record = json.loads((folder / MARKER).read_text())
    record["optimizer_state_files"] = names
    (folder / MARKER).write_text(json.dumps(record))


def state_file_outside(folder: Path) -> None:
    """The marker points its optimizer state at a file beside the folder (values no save wrote)."""
    record = json.loads((folder / MARKER).read_text())
    state = json.loads((folder / record["optimizer_state_files"][0]).read_text())
    (folder.parent / "outside.json").write_text(json.dumps({name: {"visits": 99} for name in state}))
    _set_state_files(folder, ["../outside.json"])


def state_file_nested(folder: Path) -> None:
    """An optimizer-state file nested deeper than Python's recursion limit, with the marker agreeing."""
    name = json.loads((folder / MARKER).read_text())["optimizer_state_files"][0]
    (folder / name).write_text("[" * 100_000 + "]" * 100_000)
    _update_marker(folder, name)


@contextmanager
def _patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _data_writes(action):
    """FileSystem.create_stream, doing ``action(stream, path)`` when a data file is opened for writing
    (``stream`` None: before the file is opened, so an old file of that name is untouched)."""
    def make(original):
        @contextmanager
        def create_stream(self, path, mode):
            data = "w" in mode and str(path).endswith(".distcp")
            if data and getattr(action, "before_open", False):
                action(None, path)
            with original(self, path, mode) as stream:
                if data:
                    action(stream, path)
                yield stream
        return create_stream
    return make


def _disk_full(stream, path):
    stream.write(b"partial")
    stream.flush()
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


def _die(stream, path):
    os._exit(3)  # before its data file is opened: an old file of the same name would be left as it was


_die.before_open = True


def _world(rank: int, world: int, root: str) -> dict:
    import dataclasses
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystem

    from twinpipe.train.checkpoint import load_checkpoint, save_checkpoint
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.model import GPT, GPTConfig
    from twinpipe.train.trainer import Trainer

    results: dict = {}
    mesh = build_mesh(1, 2)
    root_path = Path(root)
    path = str(root_path / "ckpt")

    def case(name, fn):
        try:
            results[name] = fn()
        except BaseException as exc:  # noqa: B036  (DCP's CheckpointException is a BaseException)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            results[name] = f"{type(exc).__name__}: {exc}"
        dist.barrier()

    def make(optimizer="adamw", model_fn=None, lr=None):
        fn, sampler, criterion, make_opt, config = tiny_setup("1f1b", optimizer=optimizer)
        config = dataclasses.replace(config, timeout=60.0)  # room for a busy machine; a dead rank is seen at once
        if lr is not None:
            make_opt = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01)  # noqa: E731
        if callable(optimizer):
            make_opt = optimizer
        return Trainer(model_fn or fn, sampler, criterion, make_opt, mesh, config, dtype=torch.float64)

    def params(trainer):
        return {name: p.detach().clone() for name, p, _ in trainer.held}

    def same_params(trainer, expected) -> list[str]:
        return [n for n, p, _ in trainer.held if not torch.equal(p.detach(), expected[n])]

    def loads_as(expected_step, expected_params, where=path) -> str:
        fresh = make()
        start = load_checkpoint(fresh, where)
        differ = same_params(fresh, expected_params)
        if start != expected_step or differ:
            return f"loaded step {start} (expected {expected_step}); parameters differing from step {expected_step}'s: {differ}"
        return "ok"

    def on_rank0(fn) -> None:
        """Run ``fn`` on rank 0 only; every rank raises if it failed (so all go on alike)."""
        error = None
        if rank == 0:
            try:
                fn()
            except Exception as exc:
                error = f"rank 0 preparing the case: {type(exc).__name__}: {exc}"
        said = [None] * world
        dist.all_gather_object(said, error)
        if said[0]:
            raise RuntimeError(said[0])

    def leftovers() -> list[str]:
        """Temporary folders beside the checkpoint, as rank 0 sees them once it has returned or raised
        (it removes them; other ranks may raise before it has), told to every rank."""
        said = [None] * world
        dist.all_gather_object(said, sorted(p.name for p in root_path.iterdir() if p.name.startswith(".ckpt.")))
        return said[0]

    trainer = make()
    saved: dict = {}

    def round_trip():
        for step in range(3):
            trainer.step(step)
        save_checkpoint(trainer, path, 3)
        saved[3] = params(trainer)
        state = {id(p): {k: v.clone() for k, v in trainer.optimizer.state[p].items()} for p in trainer.params}
        if not (root_path / "ckpt" / MARKER).exists():
            return "no completion marker written"
        if leftovers():
            return f"temporary folders left: {leftovers()}"
        fresh = make()
        if load_checkpoint(fresh, path) != 3 or same_params(fresh, saved[3]):
            return "the checkpoint does not load as itself"
        for (_, p, _), (_, q, _) in zip(trainer.held, fresh.held):
            if any(not torch.equal(v, fresh.optimizer.state[q][k]) for k, v in state[id(p)].items()):
                return "optimizer state differs after loading"
        if fresh.step(3).loss != trainer.step(3).loss:
            return "the next loss differs"
        for step in range(4, 6):
            trainer.step(step)
        return "ok"

    def disk_full():
        patch = _patched(FileSystem, "create_stream", _data_writes(_disk_full)) if rank == 1 else _nothing()
        with patch:
            try:
                save_checkpoint(trainer, path, 6)
                return "the save reported no failure"
            except BaseException as exc:  # noqa: B036
                message = f"{type(exc).__name__}: {exc}"
        problems = [] if "rank 1" in message and "No space left on device" in message else [f"unclear error: {message}"]
        if leftovers():
            problems.append(f"temporary folders left: {leftovers()}")
        try:
            loaded = loads_as(3, saved[3])
        except Exception as exc:
            loaded = f"{type(exc).__name__}: {exc}"
        return "; ".join(problems + ([] if loaded == "ok" else [loaded])) or "ok"

    def save_fails_cleanly(*wanted: str) -> str:
        """Save over step 3's checkpoint under the caller's injected fault: the save must raise an error
        quoting ``wanted``, leave no temporary folder, and step 3's checkpoint must load as itself."""
        try:
            save_checkpoint(trainer, path, 6)
            return "the save reported no failure"
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
        if not all(w in message for w in wanted):
            return f"unclear error: {message}"
        if leftovers():
            return f"temporary folders left: {leftovers()}"
        return loads_as(3, saved[3])

    def another_folder():
        """Rank 1 writes into a folder of the same name that rank 0 does not see (another host's local
        disk instead of a shared filesystem): the save must fail, not write a marker that vouches for
        files rank 0 never saw."""
        import twinpipe.train.checkpoint as checkpoint

        def elsewhere(original):  # the folder argument swapped for one beside the checkpoint's
            return lambda folder, *a, **k: original(root_path / "elsewhere" / Path(folder).name, *a, **k)

        with (_patched(checkpoint, "FileSystemWriter", elsewhere) if rank == 1 else _nothing()), \
             (_patched(checkpoint, "_finish_own_files", elsewhere) if rank == 1 else _nothing()):
            return save_fails_cleanly("rank 1", "shared filesystem")

    def rename_fails():
        import twinpipe.train.checkpoint_files as files

        def failing(original):
            def rename(src, dst):
                if Path(src).name.startswith(".ckpt.partial-") and str(dst) == path:  # the folder into place
                    raise OSError(errno.EIO, "Input/output error (injected)", str(src))
                return original(src, dst)
            return rename

        with _patched(files.os, "rename", failing) if rank == 0 else _nothing():
            return save_fails_cleanly("rank 0", "Input/output error (injected)")

    def overwrite():
        save_checkpoint(trainer, path, 6)
        saved[6] = params(trainer)
        if leftovers():
            return f"folders left: {leftovers()}"
        return loads_as(6, saved[6])

    def damaged(name, damage):
        copy = root_path / name

        def prepare():
            shutil.copytree(path, copy)
            damage(copy)

        on_rank0(prepare)
        try:
            load_checkpoint(make(), str(copy))
            return "loaded"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def flip_byte(folder):
        data = bytearray((folder / "__1_0.distcp").read_bytes())
        data[len(data) // 2] ^= 0x10
        (folder / "__1_0.distcp").write_bytes(bytes(data))

    def truncate(name, keep=None):
        def cut(folder):
            data = (folder / name).read_bytes()
            (folder / name).write_bytes(data[: len(data) - 10 if keep is None else keep])
        return cut

    def garbage_metadata(folder):
        (folder / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
        _update_marker(folder, ".metadata")

    def crafted(name, craft):
        flag = root_path / f"{name}-ran"
        folder = root_path / name
        on_rank0(lambda: craft(folder, str(flag)))
        try:
            load_checkpoint(make(), str(folder))
            outcome = "loaded"
        except BaseException as exc:  # noqa: B036
            outcome = f"{type(exc).__name__}: {exc}"
        dist.barrier()
        return {"outcome": outcome, "ran": flag.exists()}

    def model_config():
        heads4 = lambda: GPT(GPTConfig(vocab=32, seq_len=8, dim=8, heads=4, layers=6))  # noqa: E731  (the same shapes)
        try:
            load_checkpoint(make(model_fn=heads4), path)
            refused = "loaded"
        except Exception as exc:
            refused = f"{type(exc).__name__}: {exc}"
        allowed = load_checkpoint(make(model_fn=heads4), path, allow_model_config_change=True)
        return {"refused": refused, "allowed": allowed}

    def hparams():
        out = {}
        for mode in ("checkpoint", "current"):
            fresh = make(lr=5e-3)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                load_checkpoint(fresh, path, optimizer_hparams=mode)
            group = fresh.optimizer.param_groups[0]
            out[mode] = {"lr": group["lr"], "betas": type(group["betas"]).__name__, "warnings": [str(w.message) for w in caught]}
        return out

    class CountingSGD(torch.optim.SGD):
        """SGD that also keeps a plain int in its state (as some optimizers do)."""

        def step(self, closure=None):
            super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["visits"] = self.state[p].get("visits", 0) + 1

    class ListState(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["history"] = [1.0, 2.0]

    def plain_state():
        counting = lambda ps: CountingSGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
        a = make(optimizer=counting)
        for step in range(2):
            a.step(step)
        save_checkpoint(a, str(root_path / "plain"), 2)
        b = make(optimizer=counting)
        load_checkpoint(b, str(root_path / "plain"))
        visits = sorted({b.optimizer.state[p]["visits"] for p in b.params})
        if visits != [2] or b.step(2).loss != a.step(2).loss:
            return f"visits {visits}; the next losses differ" if visits == [2] else f"visits {visits} after loading"
        lists = make(optimizer=lambda ps: ListState(ps, lr=0.1))
        lists.step(0)
        try:
            save_checkpoint(lists, str(root_path / "lists"), 1)
            return "saved a list of floats as optimizer state"
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
        if (root_path / "lists").exists() or "history is a list" not in message:
            return f"unclear error or a folder written: {message}"
        return "ok"

    def not_a_checkpoint():
        notes = root_path / "notes"
        on_rank0(lambda: (notes.mkdir(), (notes / "keep.txt").write_text("mine")))
        try:
            save_checkpoint(trainer, str(notes), 3)
            message = "saved over a folder that is not a checkpoint"
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
        kept = sorted(p.name for p in notes.iterdir())
        return {"message": message, "kept": kept}

    case("round_trip", round_trip)
    case("not_a_checkpoint", not_a_checkpoint)
    case("disk_full", disk_full)
    case("another_folder", another_folder)
    case("rename_fails", rename_fails)
    case("overwrite", overwrite)
    case("flipped_byte", lambda: damaged("flipped", flip_byte))
    case("truncated_data", lambda: damaged("truncated", truncate("__1_0.distcp")))
    case("truncated_metadata", lambda: damaged("short-metadata", truncate(".metadata")))
    case("garbage_metadata", lambda: damaged("garbage-metadata", garbage_metadata))
    case("no_marker", lambda: damaged("no-marker", lambda folder: (folder / MARKER).unlink()))
    case("crafted_metadata", lambda: crafted("crafted-metadata", craft_metadata_folder_at))
    case("crafted_bytes_item", lambda: crafted("crafted-bytes", lambda folder, flag: craft_bytes_item(Path(path), folder, flag)))
    case("model_config", model_config)
    case("hparams", hparams)
    case("plain_state", plain_state)

    def crafted_state(name, craft):
        folder = root_path / name
        on_rank0(lambda: (shutil.copytree(root_path / "plain", folder), craft(folder)))
        try:
            load_checkpoint(make(optimizer=lambda ps: CountingSGD(ps, lr=0.1, momentum=0.9)), str(folder))
            return "loaded"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def interrupted(interruption, during):
        """Every rank's save over the step-6 checkpoint raises ``interruption`` in the exchange ``during``."""
        import twinpipe.train.checkpoint as checkpoint

        def raising(original):
            def gather(group, obj, timeout, what):
                if what.endswith(during):
                    raise interruption("injected")
                return original(group, obj, timeout, what)
            return gather

        with _patched(checkpoint, "gather_json", raising):
            try:
                save_checkpoint(trainer, path, 7)
                return "the save was not interrupted"
            except (KeyboardInterrupt, SystemExit):
                pass
        return f"temporary folders left: {leftovers()}" if leftovers() else loads_as(6, saved[6])

    case("state_file_outside", lambda: crafted_state("state-outside", state_file_outside))
    case("state_file_nested", lambda: crafted_state("state-nested", state_file_nested))
    case("exit_while_preparing", lambda: interrupted(SystemExit, ": preparing"))
    case("ctrl_c_after_writing", lambda: interrupted(KeyboardInterrupt, ": waiting for every rank to finish writing"))

    # Last: rank 1 dies as it starts writing its part of a save over the step-6 checkpoint (rank 0 writes its part).
    for step in range(6, 9):
        trainer.step(step)
    everyone = [None] * world
    dist.all_gather_object(everyone, {"results": results, "step6": saved.get(6, {})})
    try:
        with _patched(FileSystem, "create_stream", _data_writes(_die)) if rank == 1 else _nothing():
            save_checkpoint(trainer, path, 9)
        killed = "the save reported no failure"
    except BaseException as exc:  # noqa: B036
        killed = f"{type(exc).__name__}: {exc}"
    return {"ranks": everyone, "killed": killed, "leftovers": sorted(p.name for p in root_path.iterdir() if p.name.startswith(".ckpt."))}


def craft_metadata_folder_at(folder: Path, flag: str) -> None:
    craft_metadata_folder(Path(folder), flag)


@contextmanager
def _nothing():
    yield


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt-safety")
    return root, run_world(WORLD, _world, str(root), timeout=400, allow_deaths=True)


def _case(world, name) -> dict:
    _, results = world
    assert results[1][0] == "died", results[1]
    return {r: results[0]["ranks"][r]["results"][name] for r in range(WORLD)}


@pytest.mark.parametrize("name", ["round_trip", "disk_full", "another_folder", "rename_fails", "overwrite", "plain_state", "exit_while_preparing",
                                  "ctrl_c_after_writing"])
def test_a_failed_save_leaves_the_old_checkpoint_loadable_as_itself(world, name):
    outcomes = _case(world, name)
    assert all(v == "ok" for v in outcomes.values()), outcomes


@pytest.mark.parametrize("name, wanted", [
    ("flipped_byte", "file __1_0.distcp: its SHA-256 differs from the marker's (corrupted"),
    ("truncated_data", "file __1_0.distcp: {size} bytes, the marker says {full} (torn or corrupted)"),
    ("truncated_metadata", "file .metadata: {metadata} bytes, the marker says {metadata_full} (torn or corrupted)"),
    ("garbage_metadata", "file .metadata: not readable as checkpoint metadata (UnpicklingError"),
    ("no_marker", "no completion marker twinpipe-checkpoint.json: its save did not finish"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_problem(world, name, wanted):
    root, _ = world
    full = (root / "ckpt" / "__1_0.distcp").stat().st_size  # (the step-6 checkpoint the copies were made of)
    metadata = (root / "ckpt" / ".metadata").stat().st_size
    wanted = wanted.format(size=full - 10, full=full, metadata=metadata - 10, metadata_full=metadata)
    for message in _case(world, name).values():
        assert message.startswith("CheckpointError: checkpoint ") and str(root) in message and wanted in message, message


@pytest.mark.parametrize("name", ["crafted_metadata", "crafted_bytes_item"])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(world, name):
    for outcome in _case(world, name).values():
        assert not outcome["ran"], "loading ran code from the checkpoint"
        assert outcome["outcome"].startswith("CheckpointError: checkpoint ") and "refused" in outcome["outcome"], outcome


@pytest.mark.parametrize("name, wanted", [
    ("state_file_outside", "file twinpipe-checkpoint.json: lists optimizer state file '../outside.json', which is not among "
                           "its digested files"),
    ("state_file_nested", "not readable JSON (RecursionError"),
])
def test_load_checkpoint_reads_no_optimizer_state_from_outside_or_unbounded(world, name, wanted):
    for message in _case(world, name).values():
        assert message.startswith("CheckpointError: checkpoint ") and wanted in message, message


def test_a_folder_that_is_not_a_checkpoint_is_not_replaced(world):
    for outcome in _case(world, "not_a_checkpoint").values():
        assert outcome["kept"] == ["keep.txt"], outcome
        assert outcome["message"].startswith("CheckpointWriteError: rank dp=0 pp=") and "exists and is not a checkpoint folder; refusing to replace it" in outcome["message"], outcome


def test_another_model_configuration_is_refused_unless_allowed(world):
    for outcome in _case(world, "model_config").values():
        assert "heads: 2 in the checkpoint, 4 here" in outcome["refused"] and "allow_model_config_change=True" in outcome["refused"], outcome
        assert outcome["allowed"] == 6


def test_resumed_hyper_parameters_are_an_explicit_choice_and_a_difference_is_warned(world):
    for outcome in _case(world, "hparams").values():
        taken, kept = outcome["checkpoint"], outcome["current"]
        assert taken["lr"] == 1e-2 and kept["lr"] == 5e-3 and taken["betas"] == kept["betas"] == "tuple", outcome
        assert any("param_groups[0].lr: 0.01 in the checkpoint, 0.005 in this run's optimizer" in w and "the checkpoint's are used" in w
                   for w in taken["warnings"]), taken
        assert any("param_groups[0].lr: 0.01 in the checkpoint" in w and "this run's are kept" in w for w in kept["warnings"]), kept


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process load below
def test_a_rank_killed_while_saving_over_a_checkpoint_leaves_the_old_one_whole(world):
    import torch
    import torch.distributed.checkpoint as dcp

    root, results = world
    assert results[1][0] == "died", results[1]  # rank 1 did die during the save
    assert results[0]["killed"] != "the save reported no failure", results[0]["killed"]
    assert results[0]["leftovers"] == [], results[0]["leftovers"]
    step6 = {**results[0]["ranks"][0]["step6"], **results[0]["ranks"][1]["step6"]}
    state = {f"model.{n}": torch.empty_like(t) for n, t in step6.items()}
    dcp.load(state, checkpoint_id=str(root / "ckpt"), no_dist=True)
    differ = [n for n, t in step6.items() if not torch.equal(state[f"model.{n}"], t)]
    assert not differ, f"the folder holds a mix: {len(differ)} of {len(step6)} parameters are not step 6's ({differ[:3]}, ...)"
    from twinpipe.train.checkpoint import read_checkpoint_info

    info = read_checkpoint_info(root / "ckpt", verify_data=True)  # complete: every file as the marker says
    assert info.step == 6


# In this process: the crafted folders through the reader and the command line (no world needed).

TINY = ["--layers", "2", "--dim", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--microbatch-size", "2",
        "--corpus-bytes", "20000", "--pp", "1", "--schedule", "1f1b"]


def _run_train(*argv) -> int:
    from twinpipe.train_command.cli import add_train_parser, run_train

    parser = argparse.ArgumentParser()
    return run_train(add_train_parser(parser.add_subparsers()).parse_args(list(argv)))


def test_twinpipe_train_resume_refuses_a_crafted_metadata_without_running_it(tmp_path, capsys):
    flag = tmp_path / "ran"
    craft_metadata_folder(tmp_path / "crafted", str(flag))
    assert _run_train(*TINY, "--resume", str(tmp_path / "crafted")) == 2
    err = capsys.readouterr().err
    assert not flag.exists(), "twinpipe train --resume ran code from the checkpoint"
    assert err.startswith(f"twinpipe train: error: --resume={tmp_path / 'crafted'}: file .metadata: it refers to ") and "refused" in err, err


def test_twinpipe_train_resume_refuses_a_folder_without_marker(tmp_path, capsys):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / ".metadata").write_bytes(pickle.dumps(Evil(str(tmp_path / "ran"))))
    assert _run_train(*TINY, "--resume", str(tmp_path / "old")) == 2
    err = capsys.readouterr().err
    assert not (tmp_path / "ran").exists()
    assert "no completion marker twinpipe-checkpoint.json" in err, err


def test_twinpipe_train_resume_refuses_a_pickled_item_without_running_it(world, tmp_path, capsys):
    root, _ = world
    flag = tmp_path / "ran"
    craft_bytes_item(root / "ckpt", tmp_path / "crafted", str(flag))
    assert _run_train(*TINY, "--resume", str(tmp_path / "crafted")) == 2
    err = capsys.readouterr().err
    assert not flag.exists(), "twinpipe train --resume ran code from the checkpoint"
    assert "file .metadata: item 'trainer' is a pickled object" in err and "refused" in err, err


def test_read_checkpoint_info_refuses_a_crafted_metadata_and_a_pickled_item(world, tmp_path):
    from twinpipe.train.checkpoint import CheckpointError, read_checkpoint_info

    root, _ = world
    flag = tmp_path / "ran"
    craft_metadata_folder(tmp_path / "a", str(flag))
    with pytest.raises(CheckpointError, match=r"file \.metadata: it refers to .*nothing in it was run"):
        read_checkpoint_info(tmp_path / "a")
    craft_bytes_item(root / "ckpt", tmp_path / "b", str(flag))
    with pytest.raises(CheckpointError, match=r"file \.metadata: item 'trainer' is a pickled object"):
        read_checkpoint_info(tmp_path / "b")
    assert not flag.exists()


def test_a_checkpoint_moved_aside_by_an_interrupted_save_is_named(world, tmp_path):
    from twinpipe.train.checkpoint import CheckpointError, read_checkpoint_info

    root, _ = world
    shutil.copytree(root / "ckpt", tmp_path / ".ckpt.old-0123456789ab")  # the state between the save's two renames
    with pytest.raises(CheckpointError, match=r"no such directory\); a save over it was interrupted after moving the complete "
                                              r"earlier checkpoint aside to .*\.ckpt\.old-0123456789ab"):
        read_checkpoint_info(tmp_path / "ckpt")


def test_a_checkpoint_holds_no_pickled_item_and_says_what_it_holds(world):
    from twinpipe.train.checkpoint import read_checkpoint_info

    root, _ = world
    info = read_checkpoint_info(root / "ckpt", verify_data=True)
    record = json.loads((root / "ckpt" / MARKER).read_text())
    assert info.step == 6 and record["optimizer"]["class"] == "AdamW" and record["model"]["record"]["config"]["heads"] == 2
    assert set(record["files"]) == {p.name for p in (root / "ckpt").iterdir()} - {MARKER}
    assert all(type(m).__name__ == "TensorStorageMetadata" for m in info.metadata.state_dict_metadata.values())


# Crafted and damaged folders, through the reader (copies of the world's "plain" checkpoint: it has
# optimizer-state files). Each case failed before: the file outside the folder or behind the link was
# read, the FIFO called missing, the nested marker raised RecursionError, the big files were read whole.

def _marker_set(key, value):
    def craft(folder):
        record = json.loads((folder / MARKER).read_text())
        record[key] = value
        (folder / MARKER).write_text(json.dumps(record))
    return craft


def _sparse(name, size):
    def craft(folder):
        with open(folder / name, "wb") as f:
            f.truncate(size)  # a sparse file: costs no disk, and no time unless read
    return craft


def _link_outside(name):
    def craft(folder):
        outside = folder.parent / f"{folder.name}-outside-{name.strip('.')}"
        shutil.copyfile(folder / name, outside)  # the same bytes: digests and sizes still agree
        (folder / name).unlink()
        (folder / name).symlink_to(outside)
    return craft


def _fifo(name):
    def craft(folder):
        (folder / name).unlink()
        os.mkfifo(folder / name)
    return craft


def _unlisted_state(folder):
    (folder / "extra-state.json").write_text("{}")
    _set_state_files(folder, ["extra-state.json"])


def _metadata_claims(size):
    def craft(folder):
        record = json.loads((folder / MARKER).read_text())
        record["files"][".metadata"]["bytes"] = size
        (folder / MARKER).write_text(json.dumps(record))
    return craft


CRAFTED = [
    ("state file '../outside.json'", state_file_outside, "lists optimizer state file '../outside.json', which is not among its digested"),
    ("state file by absolute path", _marker_set("optimizer_state_files", ["/etc/passwd"]), "lists optimizer state file '/etc/passwd'"),
    ("state file not digested", _unlisted_state, "lists optimizer state file 'extra-state.json', which is not among its digested"),
    ("state file not a name", _marker_set("optimizer_state_files", [5]), "lists optimizer state file 5, which"),
    ("nested marker", lambda folder: (folder / MARKER).write_text("[" * 100_000 + "]" * 100_000),
     "file twinpipe-checkpoint.json: not readable JSON (RecursionError"),
    ("marker over 64 MiB", _sparse(MARKER, (64 << 20) + 1),
     f"file twinpipe-checkpoint.json: {(64 << 20) + 1} bytes, more than the 64 MiB such a file may hold"),
    (".metadata said over 256 MiB", _metadata_claims((256 << 20) + 1), f"says .metadata holds {(256 << 20) + 1} bytes, more than the 256 MiB"),
    ("marker a symbolic link", _link_outside(MARKER), "file twinpipe-checkpoint.json: is a symbolic link; refused"),
    (".metadata a symbolic link", _link_outside(".metadata"), "file .metadata: is a symbolic link; refused"),
    ("data file a symbolic link", _link_outside("__0_0.distcp"), "file __0_0.distcp: is a symbolic link; refused"),
    ("data file a FIFO", _fifo("__1_0.distcp"), "file __1_0.distcp: is a FIFO, not a regular file; refused"),
]


@pytest.mark.parametrize("craft, wanted", [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED])
def test_a_crafted_folder_is_refused_before_anything_outside_it_is_read(world, tmp_path, craft, wanted):
    from twinpipe.train.checkpoint import CheckpointError, read_checkpoint_info

    root, _ = world
    folder = tmp_path / "crafted"
    shutil.copytree(root / "plain", folder)
    craft(folder)
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint_info(folder, verify_data=True)
    assert str(refused.value).startswith(f"checkpoint {str(folder)!r}: ") and wanted in str(refused.value), str(refused.value)


def test_twinpipe_train_resume_refuses_a_nested_marker_in_one_line(tmp_path, capsys):
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / MARKER).write_text("{\"a\": " * 100_000)
    assert _run_train(*TINY, "--out", str(tmp_path / "out"), "--resume", str(tmp_path / "nested")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"twinpipe train: error: --resume={tmp_path / 'nested'}: file {MARKER}: not readable JSON "
                          "(RecursionError") and err.count("\n") == 1, err


# Which temporary folders a save removes: only those no live save owns.

def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid  # gone (a recycled id would look alive: then the folder is only kept, never wrongly removed)


def test_a_save_removes_only_the_temporary_folders_no_live_save_owns(tmp_path):
    import subprocess
    import sys
    import time

    from twinpipe.train.checkpoint_files import PARTIAL_MAX_AGE_S, prepare_folder
    from twinpipe.train.owners import this_host

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host, old = this_host(), time.time() - PARTIAL_MAX_AGE_S - 60
    try:
        folders = {  # name -> removed?
            f".ckpt.partial-{_dead_pid()}@{host}-0123456789ab": True,   # its process died (SIGKILL, a crash)
            f".step9.partial-{_dead_pid()}@{host}-0123456789ab": True,  # another target's, its process died too
            f".ckpt.partial-{live.pid}@{host}-0123456789ab": False,     # a live save's
            ".ckpt.partial-77@another-host-0123456789ab": False,        # another host's, recent
            ".ckpt.partial-78@another-host-abcdef012345": True,         # another host's, untouched for a day
            ".ckpt.partial-0123456789ab": False,                        # an older twinpipe's (no owner), recent
            ".ckpt.partial-abcdef012345": True,                         # an older twinpipe's, untouched for a day
        }
        for name in folders:
            (tmp_path / name).mkdir()
            (tmp_path / name / "__0_0.distcp").write_bytes(b"x")
        for name in (".ckpt.partial-78@another-host-abcdef012345", ".ckpt.partial-abcdef012345"):
            os.utime(tmp_path / name, (old, old))
        made = prepare_folder(tmp_path / "ckpt")
        left = {p.name for p in tmp_path.iterdir()} - {made.name}
        assert left == {name for name, removed in folders.items() if not removed}, sorted(left)
        assert made.name.startswith(f".ckpt.partial-{os.getpid()}@{host}-"), made.name
    finally:
        live.kill()
        live.wait()
