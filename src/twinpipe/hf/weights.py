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

from pathlib import Path

import torch
import torch.distributed as dist

from twinpipe.checks import DEFAULT_TIMEOUT, bad, check_bool, checked_timeout
from twinpipe.hf._safetensors_files import INDEX, SINGLE, CheckpointFiles
from twinpipe.hf._safetensors_names import ModelNames
from twinpipe.hf._safetensors_place import Place, check_place
from twinpipe.hf._safetensors_place import places as places_of
from twinpipe.hf._safetensors_save import save_collective
from twinpipe.runtime.collectives import cpu_group, release_cpu_group
from twinpipe.train.checkpoint import CheckpointWriteError
from twinpipe.train.checkpoint_files import CheckpointError

__all__ = ["Place", "has_weights", "load", "load_into", "save", "CheckpointError", "CheckpointWriteError"]


def _config(model_dir):
    from transformers import AutoConfig

    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise CheckpointError(folder, "has no config.json (not a transformers model folder)")
    return AutoConfig.from_pretrained(str(folder))


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
    wanted = places_of(places)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise bad("dtype", dtype, "must be None or a torch.dtype")
    names = ModelNames(_config(model_dir))
    where = f"loading {str(model_dir)!r}"
    for local, place in wanted.items():
        check_place(names, place, f"{where}: places[{local!r}]")
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
    given = places_of(places) if places is not None else {}
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
        save_collective(target, tensors, config, gloo, timeout, overwrite, check_copies)
    finally:
        if gloo is not None:
            release_cpu_group(gloo)
