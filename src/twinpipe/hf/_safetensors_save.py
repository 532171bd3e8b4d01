"""The collective save of ``twinpipe.hf.weights.save``: what each rank holds, who writes what
(``make_plan``: every tensor, every expert, once), each rank's shard, then rank 0's config and index
and the rename into place, every step agreed on by all ranks (``gather_json``)."""

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

from twinpipe.checks import bad
from twinpipe.hf._safetensors_files import INDEX, SINGLE, shard_name
from twinpipe.hf._safetensors_names import ModelNames
from twinpipe.hf._safetensors_place import Place, check_place
from twinpipe.train.agreement import gather_json
from twinpipe.train.checkpoint import CheckpointWriteError
from twinpipe.train.checkpoint_files import prepare_folder, put_in_place

__all__ = ["make_plan", "save_collective"]


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
        place, tensor = (Place(local), value) if isinstance(value, torch.Tensor) else (value, None)
        if isinstance(value, (tuple, list)) and len(value) == 2:
            place, tensor = value
        place = Place(place) if isinstance(place, str) else place
        if not isinstance(place, Place) or not isinstance(tensor, torch.Tensor):
            what = f"({', '.join(type(v).__name__ for v in value)})" if isinstance(value, (tuple, list)) else type(value).__name__
            raise bad(f"tensors[{local!r}]", what, "must be a tensor or a (Place, tensor) pair")
        shape = check_place(names, place, f"tensors[{local!r}]")
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


def make_plan(names: ModelNames, said: list[dict]) -> _Plan:
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
    optional = sorted(names.optional) if any(unit[0] in names.optional for unit in holders) else []  # all or none
    for name in names.stored() + optional:
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
                out[key] = part.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)  # one copy, own storage
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
    for name in plan.dtypes:  # every tensor written (the optional ones too)
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


def save_collective(target: Path, tensors, config, group, timeout: float, overwrite: bool, check_copies: bool,
                    extra_files=()) -> None:
    """``weights.save`` on a gloo ``group`` (None: this process alone): prepare and state what each
    rank holds, plan, write the shards, then rank 0 writes the rest (``extra_files``, paths of files
    such as a tokenizer's, copied in by name) and renames the folder into place; after each step
    every rank learns of any rank's failure and raises alike."""
    rank = dist.get_rank(group) if group is not None else 0
    where = f"rank {rank}: saving {str(target)!r}"
    before = f"{str(target)!r} is as it was before the save"

    def everyone(mine: dict, what: str) -> list[dict]:
        return gather_json(group, mine, timeout, f"{where}: {what}") if group is not None else [mine]

    mine: dict = {"error": None, "claims": []}
    names = held = None
    made = None  # rank 0: the temporary folder; removed when the save stops for any reason before it is in place
    try:
        try:
            mine["config"] = hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()
            names = ModelNames(config)
            mine["claims"], held = _mine(names, tensors, check_copies)
            if rank == 0:
                made = prepare_folder(target, _replace_folder if overwrite else _refuse_non_empty)
                mine["folder"] = str(made)
        except Exception as error:
            mine["error"] = f"{type(error).__name__}: {error}"
        said = everyone(mine, "preparing")
        folder = Path(said[0]["folder"]) if said[0].get("folder") else None
        _raise_if_failed(said, where, before)
        differ = [r for r, s in enumerate(said) if s["config"] != said[0]["config"]]
        if differ:  # each rank plans from its own config: they must be one
            raise CheckpointWriteError(f"{where}: rank(s) {differ} passed another config than rank 0's; {before}")
        try:
            plan = make_plan(names, said)
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
                for path in extra_files:
                    shutil.copyfile(path, folder / Path(path).name)
                put_in_place(folder, target)
            except Exception as error:
                mine["error"] = f"{type(error).__name__}: {error}"
        said = everyone(mine, "waiting for the folder to be put in place")
        _raise_if_failed(said, where, before)
    except BaseException:  # noqa: B036  (an error, KeyboardInterrupt, SystemExit: cleans up, then re-raises)
        if made is not None:  # once in place it has the target's name: this removes nothing then (never the target)
            shutil.rmtree(made, ignore_errors=True)
        raise
