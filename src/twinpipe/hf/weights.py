"""Hugging Face checkpoints, per rank: load the tensors of this rank's stages and experts from a
``transformers`` checkpoint folder, and save a pipeline's weights back as one that
``AutoModelForCausalLM.from_pretrained`` loads.

The interface is the unsplit model's tensor names (the keys of ``AutoModelForCausalLM.state_dict()``):
a rank's tensor is ``full[name]`` or, for an expert-parallel slice of a fused expert tensor (3-D,
experts along dim 0), ``full[name][rows]``: a ``Place``. How the folder stores each name (renamed
keys, experts one key each, tied embeddings stored once) is read from ``transformers``' own
conversion mapping (``_safetensors_names.py``).

``load`` opens only the files that hold the tensors asked for and reads only those tensors (of a
per-expert layout only the experts asked for; of a fused one only those rows). ``save`` is
collective: each tensor (each expert) is written once, by one of the ranks that hold it, into that
rank's own shard, in the layout ``save_pretrained`` writes; the folder is complete or absent (a
temporary folder beside the target, renamed into place once every rank has written, as
``twinpipe.train``'s checkpoints are: ``train/checkpoint_files.py``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from twinpipe.checks import DEFAULT_TIMEOUT, bad, check_bool, checked_timeout
from twinpipe.hf._safetensors_files import INDEX, SINGLE, CheckpointFiles, shard_name
from twinpipe.hf._safetensors_names import ModelNames
from twinpipe.runtime.collectives import cpu_group, release_cpu_group
from twinpipe.train.agreement import gather_json
from twinpipe.train.checkpoint import CheckpointWriteError
from twinpipe.train.checkpoint_files import CheckpointError, prepare_folder, put_in_place

__all__ = ["Place", "has_weights", "load", "load_into", "save", "CheckpointError", "CheckpointWriteError"]


@dataclass(frozen=True)
class Place:
    """Where a rank's tensor sits in the unsplit model: ``full[name]``, or with ``rows``
    ``full[name][list(rows)]`` (expert indices along dim 0 of a fused expert tensor; a row may
    repeat: a redundant expert)."""

    name: str
    rows: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise bad("Place.name", self.name, "must be a tensor name of the unsplit model (a non-empty str)")
        if self.rows is not None:
            rows = tuple(self.rows)
            if not rows or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rows):
                raise bad("Place.rows", self.rows, "must be None or a non-empty sequence of ints >= 0 (expert indices)")
            object.__setattr__(self, "rows", rows)


def _places(places) -> dict[str, Place]:
    """``{local name: Place}`` from a mapping (values a Place or a name) or an iterable of names."""
    if isinstance(places, (str, bytes)) or places is None:
        raise bad("places", places, "must be a mapping {local name: Place} or an iterable of tensor names")
    if isinstance(places, Mapping):
        items = places.items()
    else:
        items = [(name, name) for name in places]
    out = {}
    for local, place in items:
        place = Place(place) if isinstance(place, str) else place
        if not isinstance(place, Place):
            raise bad(f"places[{local!r}]", place, "must be a Place or a tensor name")
        out[str(local)] = place
    return out


def _config(model_dir):
    from transformers import AutoConfig

    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise CheckpointError(folder, "has no config.json (not a transformers model folder)")
    return AutoConfig.from_pretrained(str(folder))


def _check_place(names: ModelNames, place: Place, where: str) -> tuple[int, ...]:
    """The shape of the tensor ``place`` names (rows counted); a ValueError for an unknown name or row."""
    shape = names.shapes.get(place.name)
    if shape is None:
        near = [n for n in names.shapes if n.split(".")[-1] == place.name.split(".")[-1]][:3]
        raise ValueError(f"{where}: {place.name!r} is not a tensor of {names.model_class}"
                         + (f" (tensors of that kind: {', '.join(near)}, ...)" if near else ""))
    if place.rows is None:
        return shape
    if not shape or max(place.rows) >= shape[0]:
        raise ValueError(f"{where}: rows {list(place.rows)} of {place.name!r}: it has {shape[0] if shape else 'no'} "
                         f"rows (shape {list(shape)})")
    return (len(place.rows), *shape[1:])


class _Disk:
    """Where each model tensor is in a checkpoint folder: one key, or per-expert keys."""

    def __init__(self, files: CheckpointFiles, names: ModelNames):
        self.files, self.names = files, names
        self.plain: dict[str, str] = {}
        self.experts: dict[str, dict[str, dict[int, str]]] = {}  # name -> source pattern -> expert -> key
        for key in files.where:
            name, pattern, expert = names.from_disk(key)
            if name not in names.shapes:
                continue  # a key from_pretrained ignores too
            if pattern is None:
                self.plain.setdefault(name, key)
            elif expert is not None:
                self.experts.setdefault(name, {}).setdefault(pattern, {})[expert] = key

    def _where(self, key: str) -> str:
        return f"{self.files.folder / self.files.where[key]}"

    def read(self, place: Place) -> torch.Tensor:
        names, name = self.names, self.names.canonical(place.name)
        want = names.shapes[name]
        if name in self.plain:
            key = self.plain[name]
            have = self.files.shape(key)
            if have != want:
                raise CheckpointError(self.files.folder, f"tensor {place.name!r} (key {key!r} in {self._where(key)}): "
                                      f"shape {list(have)} on disk, expected {list(want)}")
            return self.files.read(key, place.rows)
        if name in names.fused and name in self.experts:
            return self._assemble(place, name, want)
        names.refuse_unsupported(name, f"checkpoint {str(self.files.folder)!r}")
        alias = f" (tied to {name!r})" if name != place.name else ""
        raise CheckpointError(self.files.folder, f"has no tensor {place.name!r}{alias}, expected shape {list(want)} "
                              f"(files: {', '.join(sorted(set(self.files.where.values())))})")

    def _assemble(self, place: Place, name: str, want: tuple[int, ...]) -> torch.Tensor:
        """Rows of a fused expert tensor from its per-expert keys: stacked, then the sources concatenated."""
        fused = self.names.fused[name]
        rows = place.rows if place.rows is not None else range(want[0])
        part = list(want[1:])
        if fused.dim is not None:
            part[fused.dim - 1] //= len(fused.sources)
        pieces = []
        for pattern in fused.sources:
            keys = self.experts[name].get(pattern, {})
            stacked = []
            for row in rows:
                key = keys.get(row)
                if key is None:
                    raise CheckpointError(self.files.folder, f"has no expert {row} of tensor {place.name!r} (expected a key "
                                          f"matching {pattern!r} with index {row}, shape {part}; it has experts "
                                          f"{sorted(keys)[:8]}{' ...' if len(keys) > 8 else ''})")
                have = self.files.shape(key)
                if list(have) != part:
                    raise CheckpointError(self.files.folder, f"tensor {place.name!r}, expert {row} (key {key!r} in "
                                          f"{self._where(key)}): shape {list(have)} on disk, expected {part}")
                stacked.append(self.files.read(key))
            pieces.append(torch.stack(stacked))
        return torch.cat(pieces, dim=fused.dim) if fused.dim is not None else pieces[0]


def has_weights(model_dir) -> bool:
    """Whether folder ``model_dir`` holds safetensors weights (``model.safetensors`` or an index),
    rather than a configuration alone."""
    folder = Path(model_dir)
    return (folder / SINGLE).is_file() or (folder / INDEX).is_file()


def load(model_dir, places, *, dtype: torch.dtype | None = None, device=None) -> dict[str, torch.Tensor]:
    """The tensors ``places`` names, read from the ``transformers`` checkpoint folder ``model_dir``.

    ``places``: ``{local name: Place}`` (or a name for ``Place(name)``), or an iterable of tensor
    names (each its own local name). Returns ``{local name: tensor}``, in the checkpoint's dtype
    unless ``dtype``, on ``device`` (default CPU). Opens only the files that hold them and reads only
    them: of a fused expert tensor stored per expert (as ``save_pretrained`` writes it) only the
    experts in ``rows``; of one stored fused only those rows. A tied weight (``lm_head.weight`` under
    ``tie_word_embeddings``) is read from the tensor it is tied to. A tensor the model lacks, one the
    folder lacks or one of another shape: ``CheckpointError`` (a ValueError) or ValueError naming it,
    the file and the shape expected."""
    wanted = _places(places)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise bad("dtype", dtype, "must be None or a torch.dtype")
    names = ModelNames(_config(model_dir))
    where = f"loading {str(model_dir)!r}"
    for local, place in wanted.items():
        _check_place(names, place, f"{where}: places[{local!r}]")
    disk = _Disk(CheckpointFiles(model_dir), names)
    out = {}
    for local, place in wanted.items():
        out[local] = disk.read(place).to(device=device, dtype=dtype)
    return out


def load_into(module: torch.nn.Module, model_dir, places=None, *, strict: bool = True) -> list[str]:
    """Copy checkpoint tensors into ``module``'s parameters and buffers (its ``state_dict()`` keys),
    in their dtype and device; returns the keys filled. ``places``: ``{key: Place or name}`` for keys
    that are not the unsplit model's names (default: every key is). ``strict``: every key of the
    module must be filled (else the ones the model lacks are left as they are)."""
    check_bool(strict, "strict")
    state = module.state_dict(keep_vars=True)
    given = _places(places) if places is not None else {}
    unknown = sorted(set(given) - set(state))
    if unknown:
        raise bad("places", unknown[:4], f"names keys {type(module).__name__} lacks (its keys: {', '.join(list(state)[:4])}, ...)")
    wanted = {key: given.get(key, Place(key)) for key in state}
    if not strict:
        known = set(ModelNames(_config(model_dir)).shapes)
        wanted = {k: p for k, p in wanted.items() if p.name in known}
    tensors = load(model_dir, wanted)
    with torch.no_grad():
        for key, tensor in tensors.items():
            target = state[key]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"loading {str(model_dir)!r} into {type(module).__name__}: {key!r} has shape "
                                 f"{list(target.shape)}, the checkpoint's {wanted[key]} has {list(tensor.shape)}")
            target.copy_(tensor)
    return list(tensors)


# ---------------------------------------------------------------------------------------------- save

def _refuse_non_empty(target: Path) -> str | None:
    if not target.is_dir():
        return "exists and is not a folder; refusing to replace it"
    if any(target.iterdir()):
        return "exists and is not empty; pass overwrite=True to replace it"
    return None


def _replace_folder(target: Path) -> str | None:
    return None if target.is_dir() else "exists and is not a folder; refusing to replace it"


def _dtype(text: str) -> torch.dtype:
    return getattr(torch, text.removeprefix("torch."))


def _digest(tensor: torch.Tensor) -> str:
    """A short digest of a tensor's bytes (to compare copies that must be equal, not for security)."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _mine(names: ModelNames, tensors, check_copies: bool) -> tuple[list, dict]:
    """This rank's claims ``[name, rows or None, dtype, digests or None]`` and
    ``{(name, row or None): tensor}`` (a fused tensor by expert: its rows)."""
    if not isinstance(tensors, Mapping):
        raise bad("tensors", type(tensors).__name__, "must be a mapping {local name: tensor or (Place, tensor)}")
    claims, held, seen = [], {}, {}
    for local, value in tensors.items():
        place, tensor = (Place(local), value) if isinstance(value, torch.Tensor) else tuple(value)
        place = Place(place) if isinstance(place, str) else place
        if not isinstance(place, Place) or not isinstance(tensor, torch.Tensor):
            raise bad(f"tensors[{local!r}]", value, "must be a tensor or a (Place, tensor) pair")
        shape = _check_place(names, place, f"tensors[{local!r}]")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensors[{local!r}]: shape {list(tensor.shape)}, but {place} has shape {list(shape)}")
        name = names.canonical(place.name)
        if name in names.fused:  # a fused tensor is written expert by expert
            units = [((name, row), tensor[j]) for j, row in enumerate(place.rows if place.rows is not None else range(shape[0]))]
        elif place.rows is not None:  # rows of a tensor stored whole: only the whole is written
            raise ValueError(f"tensors[{local!r}]: {place.name!r} is not a fused expert tensor; only those are saved "
                             "from rows (pass the whole tensor)")
        else:
            units = [((name, None), tensor)]
        new, digests = [], []
        for unit, piece in units:
            digest = _digest(piece) if check_copies else None
            if unit in held:
                if digest != seen[unit][1]:
                    raise ValueError(f"tensors[{local!r}] and tensors[{seen[unit][0]!r}] are both {_unit(unit)} but differ")
                continue
            held[unit], seen[unit] = piece, (local, digest)
            new.append(unit[1])
            digests.append(digest)
        if new:
            claims.append([name, None if new == [None] else new, str(tensor.dtype), digests if check_copies else None])
    return claims, held


def _unit(unit) -> str:
    name, row = unit
    return repr(name) if row is None else f"expert {row} of {name!r}"


@dataclass
class _Plan:
    owner: dict  # (name, row or None) -> group rank writing it
    files: dict  # group rank -> file name
    dtypes: dict  # name -> dtype string


def _plan(names: ModelNames, said: list[dict]) -> _Plan:
    """Who writes what: every tensor (every expert) of the model once, by one of the ranks holding
    it (taken in turn, so that replicas share the writing); raises if any is missing on every rank,
    or the ranks hold it in different dtypes or (by digest) with different values. The same on every
    rank (it reads only ``said``)."""
    holders: dict = {}
    dtypes: dict = {}
    digests: dict = {}
    for rank, s in enumerate(said):
        for name, rows, dtype, sums in s["claims"]:
            if dtypes.setdefault(name, dtype) != dtype:
                raise ValueError(f"tensor {name!r} is {dtypes[name]} on one rank and {dtype} on rank {rank}")
            for i, row in enumerate(rows if rows is not None else [None]):
                unit = (name, row)
                holders.setdefault(unit, []).append(rank)
                if sums is not None:
                    first = digests.setdefault(unit, (rank, sums[i]))
                    if first[1] != sums[i]:
                        raise ValueError(f"ranks {first[0]} and {rank} hold different values of {_unit(unit)} (copies that "
                                         "must be equal, DualPipe's mirrored ones or data-parallel replicas, have drifted apart)")
    missing = []
    for name in names.stored():
        units = [(name, r) for r in range(names.shapes[name][0])] if name in names.fused else [(name, None)]
        lacking = [u for u in units if u not in holders]
        if lacking:
            missing.append(name if len(lacking) == len(units) else f"{name} rows {[r for _, r in lacking][:8]}")
    if missing:
        raise ValueError(f"no rank holds {len(missing)} tensor(s) of the model: {', '.join(missing[:6])}"
                         f"{', ...' if len(missing) > 6 else ''} (every tensor must be passed by at least one rank)")
    owner = {}
    for i, unit in enumerate(sorted(holders, key=lambda u: (u[0], -1 if u[1] is None else u[1]))):
        ranks = sorted(set(holders[unit]))
        owner[unit] = ranks[i % len(ranks)]
    writers = sorted(set(owner.values()))
    files = {rank: SINGLE if len(writers) == 1 else shard_name(i, len(writers)) for i, rank in enumerate(writers)}
    return _Plan(owner, files, dtypes)


def _disk_tensors(names: ModelNames, name: str, row, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) as written for tensor ``name`` (a fused one: for its expert ``row``)."""
    if row is None:
        return [(names.disk_key(name), tensor)]
    fused = names.fused[name]
    parts = tensor.chunk(len(fused.sources), dim=fused.dim - 1) if fused.dim is not None else (tensor,)
    return [(names.disk_key(name, i, row), part) for i, part in enumerate(parts)]


def _write_own(folder: Path, names: ModelNames, plan: _Plan, rank: int, held: dict) -> None:
    from safetensors.torch import save_file

    out = {}
    for unit, tensor in held.items():
        if plan.owner.get(unit) == rank:
            for key, part in _disk_tensors(names, *unit, tensor):
                out[key] = part.detach().to("cpu").clone(memory_format=torch.contiguous_format)  # own storage each
    if out:
        path = folder / plan.files[rank]
        save_file(out, str(path), metadata={"format": "pt"})
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _write_shared(folder: Path, names: ModelNames, plan: _Plan, config) -> None:
    """``config.json`` (dtype and architecture set as ``save_pretrained`` sets them) and, for more than one
    shard, the index; rank 0 writes them once every rank has written its shard."""
    config = copy.deepcopy(config)
    stored = names.stored()
    floating = [plan.dtypes[n] for n in stored if _dtype(plan.dtypes[n]).is_floating_point]
    if floating:
        config.dtype = floating[0].removeprefix("torch.")
    config.architectures = [names.model_class]
    config.save_pretrained(str(folder))
    if len(set(plan.files.values())) == 1:
        return
    weight_map, total = {}, 0
    for (name, row), rank in plan.owner.items():
        if name in names.fused:
            for key, _ in _disk_tensors(names, name, row, torch.empty(names.shapes[name][1:], device="meta")):
                weight_map[key] = plan.files[rank]
        else:
            weight_map[names.disk_key(name)] = plan.files[rank]
    for name in stored:
        numel = 1
        for d in names.shapes[name]:
            numel *= d
        total += numel * _dtype(plan.dtypes[name]).itemsize
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _raise_if_failed(said: list[dict], where: str, before: str) -> None:
    failed = [(rank, s["error"]) for rank, s in enumerate(said) if s.get("error")]
    if failed:
        raise CheckpointWriteError(f"{where}: failed ({'; '.join(f'rank {r}: {e}' for r, e in failed)}); {before}")


def save(model_dir_out, tensors, config, *, group=None, timeout: float = DEFAULT_TIMEOUT, overwrite: bool = False,
         check_copies: bool = True) -> None:
    """Write a ``transformers`` checkpoint folder of the model these ranks hold, collectively.

    Every rank of ``group`` (default: the world; without ``torch.distributed``, this process alone)
    calls it with its tensors ``{local name: (Place, tensor)}`` (or ``{name: tensor}``) and the
    model's ``config`` (a ``PretrainedConfig``). Every tensor of the model must be held by at least
    one rank; a tensor (an expert) held by several (DualPipe's mirrored copies, data-parallel
    replicas, redundant experts) is written once, by one of them. The folder holds ``config.json``
    and safetensors shards (one per writing rank, with ``model.safetensors.index.json``; a single
    ``model.safetensors`` when one rank writes) in the layout ``save_pretrained`` writes (experts
    one key each), so that ``AutoModelForCausalLM.from_pretrained(model_dir_out)`` loads these
    tensors bitwise. Complete or absent: written beside ``model_dir_out`` and renamed into place
    when every rank has finished; if any rank fails, every rank raises ``CheckpointWriteError`` and
    the target is as it was. An existing non-empty ``model_dir_out`` is refused unless
    ``overwrite``, which replaces it atomically. ``check_copies``: compare the copies of each tensor
    (by a digest of its bytes) and raise if they differ, rather than write one of them. Every wait is
    bounded by ``timeout`` seconds."""
    timeout = checked_timeout(timeout)
    check_bool(overwrite, "overwrite")
    check_bool(check_copies, "check_copies")
    target = Path(model_dir_out)
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    gloo = cpu_group(group, timeout) if group is not None else None
    try:
        _save(target, tensors, config, gloo, timeout, overwrite, check_copies)
    finally:
        if gloo is not None:
            release_cpu_group(gloo)


def _save(target: Path, tensors, config, group, timeout: float, overwrite: bool, check_copies: bool) -> None:
    rank = dist.get_rank(group) if group is not None else 0
    where = f"rank {rank}: saving {str(target)!r}"
    before = f"{str(target)!r} is as it was before the save"

    def everyone(mine: dict, what: str) -> list[dict]:
        return gather_json(group, mine, timeout, f"{where}: {what}") if group is not None else [mine]

    mine: dict = {"error": None, "claims": []}
    names = held = None
    try:
        mine["config"] = hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()
        names = ModelNames(config)
        mine["claims"], held = _mine(names, tensors, check_copies)
        if rank == 0:
            mine["folder"] = str(prepare_folder(target, _replace_folder if overwrite else _refuse_non_empty))
    except Exception as error:
        mine["error"] = f"{type(error).__name__}: {error}"
    said = everyone(mine, "preparing")
    folder = Path(said[0]["folder"]) if said[0].get("folder") else None
    try:
        _raise_if_failed(said, where, before)
        differ = [r for r, s in enumerate(said) if s["config"] != said[0]["config"]]
        if differ:  # each rank plans from its own config: they must be one
            raise CheckpointWriteError(f"{where}: rank(s) {differ} passed another config than rank 0's; {before}")
        try:
            plan = _plan(names, said)
        except ValueError as error:  # the same on every rank: it reads only what every rank said
            raise CheckpointWriteError(f"{where}: {error}; {before}") from None
        mine = {"error": None}
        try:
            _write_own(folder, names, plan, rank, held)
        except Exception as error:
            mine["error"] = f"{type(error).__name__}: {error}"
        said = everyone(mine, "waiting for every rank to write its shard")
        _raise_if_failed(said, where, before)
        mine = {"error": None}
        if rank == 0:
            try:
                _write_shared(folder, names, plan, config)
                put_in_place(folder, target)
            except Exception as error:
                mine["error"] = f"{type(error).__name__}: {error}"
        said = everyone(mine, "waiting for the folder to be put in place")
        _raise_if_failed(said, where, before)
    except BaseException:  # noqa: B036  (cleans up, then re-raises whatever it was)
        if rank == 0 and folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # never the target: it is the old folder or the new one
        raise
