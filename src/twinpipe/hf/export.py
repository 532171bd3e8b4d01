"""A trained checkpoint as a ``transformers`` folder: ``export_checkpoint(checkpoint, model_dir, out)``.

A ``twinpipe.train`` checkpoint stores every model tensor once under the unsplit model's name
(experts assembled from their expert-parallel ranks, a tied copy under its main name, routing
biases as ``buffer.<name>``), whatever mesh wrote it; so one process reads them all and writes them
as ``save_pretrained`` would (``twinpipe.hf.weights``' names and layout: experts one key each, tied
weights once, DeepSeek-V3's MTP layers under its own names with their ``embed_tokens`` and
``shared_head.head`` copies), with ``--model``'s ``config.json`` and tokenizer files. The same
checkpoint values give the same files, whichever mesh wrote them.

The weights are those the trained model computes with: the checkpoint's values in their dtype,
and under ``bf16-mixed`` the FP32 masters rounded to bfloat16, as the trainer rounds them into its
compute weights. The folder is complete or absent (written beside ``out``, renamed into place).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from types import MappingProxyType

import torch

from twinpipe.folders import UnsafeFile, listed_stat
from twinpipe.precisions import BF16_MIXED
from twinpipe.train.checkpoint_files import CheckpointError, CheckpointInfo, read_checkpoint_info

__all__ = ["export_checkpoint", "tokenizer_files", "TOKENIZER_FILES", "COMPUTE_DTYPE"]

# What a transformers tokenizer (and generation settings) may keep in a model folder: copied when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
COMPUTE_DTYPE = MappingProxyType({BF16_MIXED: torch.bfloat16})  # precision -> the dtype its compute weights have (else the stored one)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def tokenizer_files(model_dir) -> list[Path]:
    """The tokenizer and generation files of ``model_dir`` (``TOKENIZER_FILES`` present there; a
    link is followed, a FIFO or folder by such a name refused)."""
    found = []
    for name in TOKENIZER_FILES:
        try:
            if listed_stat(model_dir, name, follow_links=True) is not None:
                found.append(Path(model_dir) / name)
        except UnsafeFile as error:
            raise ValueError(f"model folder {str(model_dir)!r}: {error}") from None
    return found


def _config(model_dir):
    from transformers import AutoConfig

    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {str(model_dir)!r}: has no config.json (a transformers model folder has one)")
    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def _mtp_depth(info: CheckpointInfo, config) -> int:
    """The MTP layers the checkpoint holds: a DeepSeek-V3's layers numbered from ``num_hidden_layers`` on
    (another model has none: layers past its count mean another model, which the names check tells)."""
    if getattr(config, "model_type", None) != "deepseek_v3":
        return 0
    n = int(config.num_hidden_layers)
    return len({int(m.group(1)) for name in info.parameters if (m := _LAYER.match(name)) and int(m.group(1)) >= n})


def _check_same_model(info: CheckpointInfo, config, depth: int, model_dir) -> None:
    """The checkpoint's parameters (names, shapes) are those ``twinpipe train --model model_dir`` has."""
    from transformers import AutoModelForCausalLM

    from twinpipe.hf.support import UntestedModelWarning
    from twinpipe.hf.training import parameter_names

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UntestedModelWarning)
        mine = {name: list(shape) for name, shape in parameter_names(AutoModelForCausalLM.from_config(config), depth)}
    saved = info.parameters
    if mine != saved:
        names = sorted(set(mine) ^ set(saved))
        shapes = sorted(n for n in set(mine) & set(saved) if mine[n] != saved[n])
        first = (f"{names[0]} only in {'the checkpoint' if names[0] in saved else 'the model'}" if names
                 else f"{shapes[0]}: {saved[shapes[0]]} in the checkpoint, {mine[shapes[0]]} in the model")
        raise CheckpointError(info.path, f"holds another model than {str(model_dir)!r} ({getattr(config, 'model_type', '?')}): "
                              f"{len(names)} parameter name(s) and {len(shapes)} shape(s) differ (first: {first})")


def _read_tensors(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """Every model tensor and routing bias of the checkpoint, whole, by its name in the unsplit model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from twinpipe.train.safe_metadata import SafeFileSystemReader, TensorsOnlyLoadPlanner

    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in info.metadata.state_dict_metadata.items()
             if key.startswith(("model.", "buffer.")) and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():  # one process on purpose: DCP's note that it reads without a process group
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(info.path), planner=TensorsOnlyLoadPlanner(), no_dist=True)
    return {key.split(".", 1)[1]: tensor for key, tensor in state.items()}


def _as_computed(tensors: dict[str, torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
    dtype = COMPUTE_DTYPE.get(precision)
    if dtype is None:
        return tensors
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}


def export_checkpoint(checkpoint, model_dir, out, *, overwrite: bool = False) -> Path:
    """Write the ``twinpipe.train`` checkpoint ``checkpoint`` of the ``transformers`` model of folder
    ``model_dir`` as a folder ``out`` that ``AutoModelForCausalLM.from_pretrained`` loads, bit for bit
    the weights the trained model computes with. One process, no process group; the whole model
    passes through this process's memory. A folder that is not a complete checkpoint, or one of
    another model: ``CheckpointError`` (a ValueError) naming it; an existing non-empty ``out``
    unless ``overwrite``: ``CheckpointWriteError``. Returns ``out``."""
    from twinpipe.checks import DEFAULT_TIMEOUT
    from twinpipe.hf._safetensors_save import save_collective
    from twinpipe.hf.mtp_layer import copy_sources

    info = read_checkpoint_info(checkpoint, verify_data=True)
    config = _config(model_dir)
    depth = _mtp_depth(info, config)
    _check_same_model(info, config, depth, model_dir)
    files = tokenizer_files(model_dir)
    tensors = _as_computed(_read_tensors(info), info.written_by.get("precision"))
    if depth:  # DeepSeek-V3's MTP layers: as many in config.json as the folder holds, with their copies
        config.num_nextn_predict_layers = depth
        tensors.update((name, tensors[source]) for name, source in copy_sources(config, depth).items())
    save_collective(Path(out), tensors, config, None, DEFAULT_TIMEOUT, overwrite, check_copies=False, extra_files=files)
    return Path(out)
