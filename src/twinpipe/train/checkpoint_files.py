"""A checkpoint folder on disk: complete or absent, and checked before anything in it is used.

A save writes into a fresh temporary folder beside the target (``.NAME.partial-XXXX``); when every
rank has written, one rank writes the completion marker (``twinpipe-checkpoint.json``: the step,
the model, the optimizer's hyper-parameters, and the size and SHA-256 of every file) last, and
renames the folder into place. Over an existing checkpoint the old folder is first renamed aside
(``.NAME.old-XXXX``) and removed only once the new one is in place, so at every moment the target
is the old checkpoint, the new one, or absent, never a mix. A reader refuses a folder without a
marker, or whose files disagree with it, naming the file and what is wrong.

No torch collectives here: ``checkpoint.py`` decides which rank runs what.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from twinpipe.train.safe_metadata import MetadataError, load_metadata

__all__ = ["MARKER", "CheckpointError", "CheckpointInfo", "read_checkpoint_info", "verify_files", "file_digest",
           "prepare_folder", "write_marker", "put_in_place"]

MARKER = "twinpipe-checkpoint.json"
FORMAT = "twinpipe-checkpoint"
VERSION = 1
METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: ``path`` and ``problem`` (the message without the path)."""

    def __init__(self, path, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"checkpoint {self.path!r}: {problem}")


@dataclass
class CheckpointInfo:
    """What a complete checkpoint's marker and metadata say (``read_checkpoint_info``)."""

    path: str
    step: int  # the next step to run
    parameters: dict[str, list[int]]  # every model parameter: name in the unsplit model -> shape
    model: dict  # the model's configuration record (``config.model_record``)
    optimizer: dict  # {"class": name, "param_groups": [hyper-parameters, without params]}
    files: dict[str, dict]  # file name -> {"bytes": size, "sha256": hex digest}
    optimizer_state_files: list[str]  # JSON files of optimizer state that is not a tensor
    marker_sha256: str
    metadata: object  # torch.distributed.checkpoint Metadata, read with the allow-list


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex digest) of a file."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def _aside_hint(folder: Path) -> str:
    """Where an interrupted overwrite left the complete earlier checkpoint, if it did."""
    prefix = f".{folder.name}.old-"
    try:
        moved = sorted(p for p in folder.parent.iterdir() if p.name.startswith(prefix) and (p / MARKER).is_file())
    except OSError:
        return ""
    if not moved:
        return ""
    return (f"; a save over it was interrupted after moving the complete earlier checkpoint aside to {str(moved[-1])!r}: "
            "rename that folder back to use it")


def _marker(path: str, folder: Path) -> tuple[dict, str]:
    marker = folder / MARKER
    if not marker.is_file():
        if (folder / METADATA).exists():
            raise CheckpointError(path, f"no completion marker {MARKER}: its save did not finish (a torn checkpoint), "
                                        "or a twinpipe older than completion markers wrote it; it cannot be loaded")
        raise CheckpointError(path, f"not a checkpoint directory (no {MARKER})")
    data = marker.read_bytes()
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(path, f"file {MARKER}: not readable JSON ({error}): damaged") from None
    ok = (isinstance(record, dict) and record.get("format") == FORMAT and record.get("version") == VERSION
          and isinstance(record.get("step"), int) and isinstance(record.get("files"), dict)
          and all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
                  for v in record["files"].values())
          and isinstance(record.get("model"), dict) and isinstance(record["model"].get("parameters"), list)
          and isinstance(record.get("optimizer"), dict) and isinstance(record.get("optimizer_state_files", []), list))
    if not ok:
        raise CheckpointError(path, f"file {MARKER}: not a twinpipe completion marker of version {VERSION} (damaged, or another format)")
    for name in record["files"]:
        if not isinstance(name, str) or Path(name).name != name or name in (".", "..", MARKER):
            raise CheckpointError(path, f"file {MARKER}: lists {name!r}, which is not a file of the folder (damaged or crafted)")
    return record, hashlib.sha256(data).hexdigest()


def verify_files(path: str, files: dict[str, dict], names, digests: bool = True) -> list[str]:
    """Problems (empty: none) of the files ``names`` against the marker's ``files``: missing, another
    size (torn or corrupted) or, with ``digests``, another SHA-256."""
    folder, problems = Path(path), []
    for name in names:
        want = files[name]
        file = folder / name
        if not file.is_file():
            problems.append(f"file {name}: missing (the marker lists it)")
            continue
        size = file.stat().st_size
        if size != want["bytes"]:
            problems.append(f"file {name}: {size} bytes, the marker says {want['bytes']} (torn or corrupted)")
        elif digests and file_digest(file)[1] != want["sha256"]:
            problems.append(f"file {name}: its SHA-256 differs from the marker's (corrupted, or written by another save)")
    return problems


def read_checkpoint_info(path, verify_data: bool = False) -> CheckpointInfo:
    """The step, model and optimizer record of the checkpoint at ``path``, after checking it is
    complete: a marker, every file it lists present with its size, ``.metadata`` with its digest and
    readable with the allow-list, the metadata's parameters those of the marker. ``verify_data``:
    also every data file's digest (``load_checkpoint`` shares that work out over the ranks).
    Raises ``CheckpointError`` (a ValueError) naming the checkpoint, the file and the problem."""
    path = str(path)
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(path, "not a checkpoint directory (no such directory)" + _aside_hint(folder))
    record, marker_sha = _marker(path, folder)
    files = record["files"]
    if METADATA not in files:
        raise CheckpointError(path, f"file {MARKER}: lists no {METADATA} (damaged or crafted)")
    data_files = sorted(n for n in files if n != METADATA)
    problems = verify_files(path, files, [METADATA]) + verify_files(path, files, data_files, digests=verify_data)
    if problems:
        raise CheckpointError(path, problems[0])
    try:
        metadata = load_metadata((folder / METADATA).read_bytes())
    except MetadataError as error:
        raise CheckpointError(path, f"file {METADATA}: {error}") from None
    unlisted = sorted({info.relative_path for info in metadata.storage_data.values()} - set(files))
    if unlisted:
        raise CheckpointError(path, f"file {METADATA}: refers to {', '.join(unlisted)}, which the marker does not list "
                                    "(parts of different saves)")
    try:
        parameters = {str(n): [int(d) for d in shape] for n, shape in record["model"]["parameters"]}
    except (TypeError, ValueError):
        raise CheckpointError(path, f"file {MARKER}: its parameter list is damaged") from None
    stored = {k[len("model."):]: list(m.size) for k, m in metadata.state_dict_metadata.items() if k.startswith("model.")}
    tied = record["model"].get("tied", [])  # (main, copy) pairs: a tied copy is stored once, under its main name
    if not (isinstance(tied, list) and all(isinstance(pair, list) and len(pair) == 2 and all(isinstance(n, str) for n in pair)
                                           for pair in tied)):
        raise CheckpointError(path, f"file {MARKER}: its list of tied parameters is damaged")
    stored.update((copy, stored[main]) for main, copy in tied if main in stored and copy not in stored)
    if stored != parameters:
        differ = sorted(set(stored) ^ set(parameters)) or sorted(n for n in stored if stored[n] != parameters[n])
        raise CheckpointError(path, f"files {METADATA} and {MARKER} disagree on the model's parameters ({', '.join(differ[:4])}): "
                                    "parts of different saves")
    return CheckpointInfo(path, record["step"], parameters, record["model"].get("record", {}), record["optimizer"], files,
                          [str(n) for n in record.get("optimizer_state_files", [])], marker_sha, metadata)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not possible everywhere (Windows): the renames are still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_checkpoint(target: Path) -> str | None:
    if target.is_dir() and ((target / MARKER).exists() or (target / METADATA).exists()):
        return None
    return "exists and is not a checkpoint folder; refusing to replace it"


def prepare_folder(target, refuse=_is_checkpoint) -> Path:
    """A fresh empty folder beside ``target`` to write a checkpoint into (one rank calls this).

    Refuses a ``target`` that exists and is not a checkpoint (it would be replaced), or, with
    ``refuse``, one for which ``refuse(target)`` gives a reason; removes the temporary folders of
    earlier saves to ``target`` that did not finish."""
    target = Path(target)
    if target.name in ("", ".", ".."):
        raise CheckpointError(target, "must name the checkpoint's own folder (it is written beside it and renamed into place)")
    if target.exists() and (reason := refuse(target)):
        raise CheckpointError(target, reason)
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.partial-"
    for stale in [p for p in target.parent.iterdir() if p.name.startswith(prefix)]:
        shutil.rmtree(stale, ignore_errors=True)
    folder = target.parent / f"{prefix}{uuid.uuid4().hex[:12]}"
    folder.mkdir()
    return folder


def write_marker(folder: Path, record: dict) -> None:
    """Write the completion marker into ``folder``, durably (the last file of a save)."""
    part = folder / (MARKER + ".tmp")
    with open(part, "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, **record}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, folder / MARKER)
    _fsync_dir(folder)


def put_in_place(folder: Path, target) -> None:
    """Rename the finished ``folder`` to ``target``; an existing ``target`` is moved aside first and
    removed once the new one is in place (if the second rename fails, it is moved back)."""
    target = Path(target)
    aside = None
    if target.exists():
        aside = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(target, aside)
    try:
        os.rename(folder, target)
    except BaseException:
        if aside is not None:
            os.rename(aside, target)
        raise
    _fsync_dir(target.parent)
    prefix = f".{target.name}.old-"
    for old in [p for p in target.parent.iterdir() if p.name.startswith(prefix)]:  # this one, and earlier interrupted ones
        shutil.rmtree(old, ignore_errors=True)
