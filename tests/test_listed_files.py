"""Files that a folder's own index names, read by one checked reader (``twinpipe.folders``), and the
other readers of a folder or file the user gives (a transformers model's safetensors, an EPLB table).

No process group, no model: small files in ``tmp_path``, oversized ones sparse (no disk, no time
unless read). Each case failed before: links followed, a FIFO called missing, a nested index raising
RecursionError, oversized files read whole.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from twinpipe.folders import UnsafeFile, plain_name, read_listed, read_listed_json


def _sparse(path, size):
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize("name, plain", [
    ("__0_0.distcp", True), ("optimizer-state-1.json", True), ("..", False), (".", False), ("", False),
    ("../outside.json", False), ("/etc/passwd", False), ("sub/file", False), ("a\\b", False), ("a\0b", False), (5, False),
])
def test_a_plain_name_is_a_file_of_the_folder_itself(name, plain):
    assert plain_name(name) is plain


def _link(folder):
    (folder.parent / "outside.json").write_text("{}")
    (folder / "f.json").symlink_to(folder.parent / "outside.json")


CASES = [
    ("escaping name", None, "../outside.json", "'../outside.json' is not a file of the folder"),
    ("symbolic link", _link, "f.json", "file f.json: is a symbolic link; refused"),
    ("FIFO", lambda folder: os.mkfifo(folder / "f.json"), "f.json", "file f.json: is a FIFO, not a regular file"),
    ("folder", lambda folder: (folder / "f.json").mkdir(), "f.json", "file f.json: is a folder, not a regular file"),
    ("over the bound", lambda folder: _sparse(folder / "f.json", (1 << 20) + 1), "f.json",
     f"file f.json: {(1 << 20) + 1} bytes, more than the 1 MiB"),
    ("nested", lambda folder: (folder / "f.json").write_text("[" * 100_000), "f.json", "file f.json: not readable JSON (RecursionError"),
    ("not UTF-8", lambda folder: (folder / "f.json").write_bytes(b"\xff\xfe\xfa"), "f.json", "file f.json: not readable JSON"),
    ("missing", None, "f.json", "file f.json: missing"),
]


@pytest.mark.parametrize("make, name, wanted", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_checked_reader_refuses_naming_the_file(tmp_path, make, name, wanted):
    folder = tmp_path / "folder"
    folder.mkdir()
    if make:
        make(folder)
    with pytest.raises(UnsafeFile) as refused:
        read_listed_json(folder, name, 1 << 20)
    assert wanted in str(refused.value), str(refused.value)


def test_the_checked_reader_reads_a_regular_file_and_follows_links_only_when_asked(tmp_path):
    (tmp_path / "data").write_bytes(b"abc")
    (tmp_path / "link").symlink_to(tmp_path / "data")
    assert read_listed(tmp_path, "data", 3) == b"abc"
    assert read_listed(tmp_path, "link", 3, follow_links=True) == b"abc"
    with pytest.raises(UnsafeFile, match="symbolic link"):
        read_listed(tmp_path, "link", 3)


# A transformers model's folder (hf/_safetensors_files.py): links are followed (the hub's cache is
# made of them), everything else is checked.

def _files(folder):
    from twinpipe.hf._safetensors_files import CheckpointFiles

    return CheckpointFiles(folder)


HF = [
    ("nested index", lambda f: (f / "model.safetensors.index.json").write_text("[" * 100_000),
     "file model.safetensors.index.json: not readable JSON (RecursionError"),
    ("index over 64 MiB", lambda f: _sparse(f / "model.safetensors.index.json", (64 << 20) + 1),
     f"file model.safetensors.index.json: {(64 << 20) + 1} bytes, more than the 64 MiB"),
    ("weights a FIFO", lambda f: os.mkfifo(f / "model.safetensors"), "file model.safetensors: is a FIFO, not a regular file"),
]


@pytest.mark.parametrize("make, wanted", [c[1:] for c in HF], ids=[c[0] for c in HF])
def test_a_transformers_folder_is_checked_before_it_is_read(tmp_path, make, wanted):
    from twinpipe.train.checkpoint_files import CheckpointError

    make(tmp_path)
    with pytest.raises(CheckpointError) as refused:
        _files(tmp_path)
    assert wanted in str(refused.value), str(refused.value)


def test_a_transformers_folder_of_links_as_the_hub_cache_makes_it_loads(tmp_path):
    from safetensors.torch import save_file

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    save_file({"w": torch.arange(4.0)}, str(blobs / "a"))
    (blobs / "b").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    (snapshot / "model-00001-of-00001.safetensors").symlink_to(blobs / "a")
    (snapshot / "model.safetensors.index.json").symlink_to(blobs / "b")
    assert torch.equal(_files(snapshot).read("w"), torch.arange(4.0))


def test_an_eplb_table_over_64_mib_is_refused_before_it_is_read(tmp_path):
    from twinpipe.eplb.checks import EplbArgumentError
    from twinpipe.eplb.io import read_table

    _sparse(tmp_path / "loads.csv", (64 << 20) + 1)
    with pytest.raises(EplbArgumentError, match=r"holds 67108865 bytes; allowed: at most 64 MiB"):
        read_table(tmp_path / "loads.csv")
