"""A checkpoint folder on disk: complete or absent, and checked before anything in it is used.

A save writes into a fresh temporary folder beside the target (``.NAME.partial-XXXX``); when every
rank has written, one rank writes the completion marker (``twinpipe-checkpoint.json``: the step,
the model, the optimizer's hyper-parameters, and the size and SHA-256 of every file) last, and
renames the folder into place. Over an existing checkpoint the old folder is first renamed aside
(``.NAME.old-XXXX``) and removed only once the new one is in place, so at every moment the target
is the old checkpoint, the new one, or absent, never a mix. A reader refuses a folder without a
marker, or whose files disagree with it, naming the file and what is wrong.

Every file the marker lists is read through ``twinpipe.folders``: a plain name of the folder
(nothing outside it), a regular file that is not a symbolic link (a FIFO never blocks a reader), and
the marker, ``.metadata`` and the JSON files of bounded size, checked before they are read. A
temporary folder's name says who makes it (``.NAME.partial-PID@HOST-XXXX``); a later save removes it
only when no live save owns it (``remove_abandoned``).

No torch collectives here: ``checkpoint.py`` decides which rank runs what.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from twinpipe.folders import UnsafeFile, decode_json, listed_stat, open_listed, plain_name, read_listed, read_listed_json
from twinpipe.train.owners import gone, this_host
from twinpipe.train.safe_metadata import METADATA_MAX_BYTES, MetadataError, load_metadata

__all__ = ["MARKER", "CheckpointError", "CheckpointInfo", "read_checkpoint_info", "verify_files", "file_digest",
           "prepare_folder", "write_marker", "put_in_place", "read_optimizer_state", "remove_abandoned"]

MARKER = "twinpipe-checkpoint.json"
FORMAT = "twinpipe-checkpoint"
VERSION = 1
METADATA = ".metadata"
# Bounds checked before a file is read (a 1 GiB marker was once read whole: 3.4 GB resident, 201 s).
MARKER_MAX_BYTES = 64 << 20  # every parameter's name and shape, every file's digest (.metadata's: safe_metadata)
STATE_FILE_MAX_BYTES = 64 << 20  # one rank's optimizer state that is not a tensor
# A temporary folder whose owner cannot be checked from here (another host, or an older twinpipe's
# unnamed one) is taken for abandoned once nothing in it changed for this long.
PARTIAL_MAX_AGE_S = 24 * 3600
_PARTIAL = re.compile(r"\.(?P<target>.+)\.partial-(?:(?P<pid>[0-9]+)@(?P<host>[A-Za-z0-9._-]+)-)?[0-9a-f]{12}")
_PLAIN = (type(None), bool, int, float, str)


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: ``path`` and ``problem`` (the message without the path)."""

    def __init__(self, path, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"checkpoint {self.path!r}: {problem}")


@dataclass(kw_only=True)
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
    written_by: dict = field(default_factory=dict)  # the writing run's schedule, dp, pp, precision, zero


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex digest) of a file."""
    with open(path, "rb") as f:
        return _digest(f)


def _digest(f) -> tuple[int, str]:
    sha, size = hashlib.sha256(), 0
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
    try:
        if listed_stat(folder, MARKER) is None:
            if os.path.lexists(folder / METADATA):
                raise CheckpointError(path, f"no completion marker {MARKER}: its save did not finish (a torn checkpoint), "
                                            "or a twinpipe older than completion markers wrote it; it cannot be loaded")
            raise CheckpointError(path, f"not a checkpoint directory (no {MARKER})")
        data = read_listed(folder, MARKER, MARKER_MAX_BYTES)
        record = decode_json(MARKER, data)
    except UnsafeFile as error:
        raise CheckpointError(path, str(error)) from None
    ok = (isinstance(record, dict) and record.get("format") == FORMAT and record.get("version") == VERSION
          and isinstance(record.get("step"), int) and isinstance(record.get("files"), dict)
          and all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
                  for v in record["files"].values())
          and isinstance(record.get("model"), dict) and isinstance(record["model"].get("parameters"), list)
          and isinstance(record.get("optimizer"), dict) and isinstance(record.get("optimizer_state_files", []), list))
    if not ok:
        raise CheckpointError(path, f"file {MARKER}: not a twinpipe completion marker of version {VERSION} (damaged, or another format)")
    _check_listing(path, record["files"], record.get("optimizer_state_files", []))
    return record, hashlib.sha256(data).hexdigest()


def _check_listing(path: str, files: dict, state_files: list) -> None:
    """The marker's file names: plain names of the folder; the optimizer-state files among the
    digested ones; the sizes it states for ``.metadata`` and them within their bounds."""
    for name in files:
        if not plain_name(name) or name == MARKER:
            raise CheckpointError(path, f"file {MARKER}: lists {name!r}, which is not a file of the folder (damaged or crafted)")
    for name in state_files:
        if not isinstance(name, str) or name not in files or name == METADATA:  # so a plain name whose digest is checked
            raise CheckpointError(path, f"file {MARKER}: lists optimizer state file {name!r}, which is not among its "
                                        "digested files of the folder (damaged or crafted)")
    for name, bound in [(METADATA, METADATA_MAX_BYTES)] + [(n, STATE_FILE_MAX_BYTES) for n in state_files]:
        size = files.get(name, {}).get("bytes", 0)
        if size > bound:
            raise CheckpointError(path, f"file {MARKER}: says {name} holds {size} bytes, more than the {bound >> 20} MiB "
                                        "such a file may hold (damaged or crafted)")


def verify_files(path: str, files: dict[str, dict], names, digests: bool = True) -> list[str]:
    """Problems (empty: none) of the files ``names`` against the marker's ``files``: missing, not a
    regular file or a symbolic link, another size (torn or corrupted) or, with ``digests``, another SHA-256."""
    folder, problems = Path(path), []
    for name in names:
        want = files[name]
        try:
            st = listed_stat(folder, name)
            if st is None:
                problems.append(f"file {name}: missing (the marker lists it)")
            elif st.st_size != want["bytes"]:
                problems.append(f"file {name}: {st.st_size} bytes, the marker says {want['bytes']} (torn or corrupted)")
            elif digests:
                with open_listed(folder, name) as f:
                    if _digest(f)[1] != want["sha256"]:
                        problems.append(f"file {name}: its SHA-256 differs from the marker's (corrupted, or written by another save)")
        except UnsafeFile as error:
            problems.append(str(error))
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
        metadata = load_metadata(read_listed(folder, METADATA, METADATA_MAX_BYTES))
    except UnsafeFile as error:
        raise CheckpointError(path, str(error)) from None
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
    return CheckpointInfo(path=path, step=record["step"], parameters=parameters, model=record["model"].get("record", {}),
                          optimizer=record["optimizer"], files=files,
                          optimizer_state_files=list(record.get("optimizer_state_files", [])), marker_sha256=marker_sha,
                          metadata=metadata,
                          written_by=record["written_by"] if isinstance(record.get("written_by"), dict) else {})


def read_optimizer_state(path, names) -> dict[str, dict]:
    """The optimizer state that is not a tensor, ``{parameter: {key: value}}``, from the JSON files
    ``names`` (``CheckpointInfo.optimizer_state_files``: files the marker lists and digests)."""
    plain: dict[str, dict] = {}
    for name in names:
        try:
            state = read_listed_json(path, name, STATE_FILE_MAX_BYTES)
        except UnsafeFile as error:
            raise CheckpointError(path, str(error)) from None
        if not (isinstance(state, dict) and all(isinstance(v, dict) and all(isinstance(x, _PLAIN) for x in v.values())
                                                for v in state.values())):
            raise CheckpointError(path, f"file {name}: not optimizer state ({{parameter: {{key: number, string, boolean "
                                        "or null}}}}): damaged or crafted")
        plain.update(state)
    return plain


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
    ``refuse``, one for which ``refuse(target)`` gives a reason; removes the temporary folders beside
    it that no live save owns (``remove_abandoned``). The new folder's name says who makes it."""
    target = Path(target)
    if target.name in ("", ".", ".."):
        raise CheckpointError(target, "must name the checkpoint's own folder (it is written beside it and renamed into place)")
    if target.exists() and (reason := refuse(target)):
        raise CheckpointError(target, reason)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(target.parent)
    folder = target.parent / f".{target.name}.partial-{os.getpid()}@{this_host()}-{uuid.uuid4().hex[:12]}"
    folder.mkdir()
    return folder


def _abandoned(entry: Path, match: re.Match) -> bool:
    if match["pid"] is not None and match["host"] == this_host():
        return gone(match["host"], int(match["pid"]))
    try:  # another host's, or an older twinpipe's without an owner: by age
        return time.time() - entry.lstat().st_mtime > PARTIAL_MAX_AGE_S
    except OSError:
        return False


def remove_abandoned(parent, all_abandoned: bool = False) -> list[str]:
    """Remove the temporary folders of unfinished saves in ``parent`` that no live save owns: made by
    a process of this host that is gone, or (their owner cannot be checked from here) unchanged for
    ``PARTIAL_MAX_AGE_S``; with ``all_abandoned`` (the caller knows no save into ``parent`` runs: it
    holds the run lock and its ranks have not started), every one. Returns their names."""
    removed = []
    for entry in Path(parent).iterdir():
        match = _PARTIAL.fullmatch(entry.name)
        if match and not entry.is_symlink() and entry.is_dir() and (all_abandoned or _abandoned(entry, match)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return sorted(removed)


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
