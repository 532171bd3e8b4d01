"""A ``transformers`` model folder's safetensors weights checked against its ``config.json`` before
any rank starts, from the files' headers alone (no tensor read): every file whole, every tensor the
model needs present with its shape, none it does not know, and floating-point where the model's are.

The model side is ``ModelNames`` (the model built from the config on the meta device, and how its
checkpoints name each tensor on disk: tied weights stored once, fused experts one key per expert,
DeepSeek-V3's MTP layers optional); the disk side is each file's header (``_safetensors_header``).
What passes here is what ``twinpipe.hf.weights.load`` reads: it converts any floating dtype to the
run's, so a bf16 folder trains in float32; an integer tensor where the model has a float one (a
quantized export) would convert silently, and is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

from twinpipe.hf._safetensors_files import INDEX, SINGLE, CheckpointFiles
from twinpipe.hf._safetensors_header import FLOATING, DamagedFile, TensorHeader, read_header
from twinpipe.hf._safetensors_names import ModelNames
from twinpipe.train.checkpoint_files import CheckpointError

__all__ = ["check_weights"]

_SHOWN = 3  # problems named in the one line; the rest counted


def check_weights(folder, config) -> None:
    """Check the safetensors weights of model folder ``folder`` against ``config`` (its
    ``PretrainedConfig``); a ValueError whose message (one line, without the folder) names the
    first problems (file, tensor, what is on disk and what the config's model has) and counts the rest."""
    names = ModelNames(config)
    headers = _headers(Path(folder))
    problems = _compare(names, headers, _ignored(config))
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise ValueError("; ".join(problems[:_SHOWN]) + more)


def _headers(folder: Path) -> dict[str, tuple[str, TensorHeader]]:
    """Every key of the folder's weights: ``(file, header)``; a damaged file, or an index naming a
    missing shard or a key its shard lacks: ValueError."""
    try:
        where = CheckpointFiles(folder).where if (folder / INDEX).exists() else None  # it checks the shards exist
    except CheckpointError as error:
        raise ValueError(error.problem) from None
    files = sorted(set(where.values())) if where is not None else [SINGLE]
    try:
        read = {file: read_header(folder, file) for file in files}
    except DamagedFile as error:
        raise ValueError(str(error)) from None
    if where is None:
        return {key: (SINGLE, header) for key, header in read[SINGLE].items()}
    out = {}
    for key, file in where.items():
        if key not in read[file]:
            raise ValueError(f"file {file}: has no tensor {key!r}, and {INDEX} says it does")
        out[key] = (file, read[file][key])
    return out


def _ignored(config) -> list[re.Pattern]:
    """The keys ``from_pretrained`` ignores for this model class (``_keys_to_ignore_on_load_unexpected``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return [re.compile(p) for p in getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or ()]


def _compare(names: ModelNames, headers: dict, ignored: list[re.Pattern]) -> list[str]:
    """Each way the folder's tensors differ from the model's, as a phrase."""
    problems, plain, experts = [], set(), {}
    for key, (file, header) in headers.items():
        name, pattern, expert = names.from_disk(key)
        where = f"tensor {key!r} in {file}"
        if name not in names.shapes:
            if not any(p.search(key) for p in ignored):
                problems.append(f"{where}: the config's model ({names.model_class}) has no such tensor")
            continue
        want = names.shapes[name]
        if pattern is None:
            plain.add(name)
        else:  # one expert's part of a fused tensor
            experts.setdefault(name, {}).setdefault(pattern, set()).add(expert)
            want = _expert_part(names, name)
        if header.shape != want:
            problems.append(f"{where}: shape {list(header.shape)} on disk, the config's model has {list(want)}")
        if names.meta[name].dtype.is_floating_point and header.dtype not in FLOATING:
            problems.append(f"{where}: dtype {header.dtype} on disk, a floating-point one expected ({', '.join(FLOATING)}; "
                            "converted to --dtype when read)")
    for name in names.stored():
        if name in plain:
            continue
        if name in names.fused and name in experts:
            count = names.shapes[name][0]
            for pattern in names.fused[name].sources:
                lacking = sorted(set(range(count)) - experts[name].get(pattern, set()))
                if lacking:
                    problems.append(f"tensor {name!r}: no key matching {pattern!r} for expert(s) {_few(lacking)} "
                                    f"of {count}")
            continue
        alias = [t for t, s in names.tied.items() if s == name]
        tied = f" (tied to {alias[0]!r})" if alias else ""
        problems.append(f"tensor {name!r}{tied}: missing, the config's model has it with shape {list(names.shapes[name])}")
    return problems


def _expert_part(names: ModelNames, name: str) -> tuple[int, ...]:
    """The shape of one expert's key of fused tensor ``name``: its rows' shape, split over the sources."""
    fused, part = names.fused[name], list(names.shapes[name][1:])
    if fused.dim is not None:
        part[fused.dim - 1] //= len(fused.sources)
    return tuple(part)


def _few(items: list) -> str:
    return ", ".join(str(i) for i in items[:4]) + (", ..." if len(items) > 4 else "")
