"""Checkpoints with ``torch.distributed.checkpoint``, stored by the unsplit model's parameter names.

Keys: ``model.<name>`` for each parameter, ``optim.<name>.<state>`` for its optimizer state, and
``trainer`` (JSON: step, optimizer class and hyper-parameters). Each model
parameter is written once: by data-parallel replica 0 (a MoE expert by the data-parallel rank that
holds it, under the expert's own name), from the copy that is not DualPipe's mirror.
Because keys name model parameters, not ranks or stages, a checkpoint loads under any schedule,
pipeline size or data-parallel size (each rank reads the experts it holds). Saving and loading are collective over the world, on a gloo group whose
timeout is the trainer's.
"""

from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

__all__ = ["save_checkpoint", "load_checkpoint"]


def save_checkpoint(trainer, path: str, step: int) -> None:
    """Write the model, optimizer and ``step`` (the next step to run) to directory ``path``."""
    state: dict[str, object] = {}
    for name, p, owned in trainer.held:
        if owned:  # dp replica 0's first copy; a MoE expert from the one rank holding it
            state[f"model.{name}"] = p.detach()
            for key, value in trainer.optimizer.state.get(p, {}).items():
                state[f"optim.{name}.{key}"] = value
    if trainer.mesh.is_first:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]
        # One JSON string: DCP would flatten a dict into keys of its own.
        state["trainer"] = json.dumps({"step": int(step), "optimizer": type(trainer.optimizer).__name__, "param_groups": groups})
    dcp.save(state, checkpoint_id=path, process_group=trainer.checkpoint_group)


def _check_model(path: str, metadata, trainer) -> None:
    saved = {k[len("model."):]: list(m.size) for k, m in metadata.items() if k.startswith("model.")}
    mine = {name: list(shape) for name, shape in trainer.parameter_names}
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    shapes = sorted(n for n in set(mine) & set(saved) if mine[n] != saved[n])
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"it lacks {len(missing)} parameter(s) of this model ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
        if extra:
            parts.append(f"it has {len(extra)} this model lacks ({', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''})")
        if shapes:
            parts.append("shapes differ: " + ", ".join(f"{n} {saved[n]} in the checkpoint vs {mine[n]}" for n in shapes[:4]))
        raise ValueError(f"checkpoint {path!r} holds a different model: " + "; ".join(parts))


def load_checkpoint(trainer, path: str) -> int:
    """Load ``path`` into ``trainer``'s model and optimizer; returns the step to run next."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path!r}: no torch.distributed.checkpoint metadata there") from None
    _check_model(path, metadata, trainer)
    head: dict[str, object] = {"trainer": None}
    dcp.load(head, checkpoint_id=path, process_group=trainer.checkpoint_group)
    info = json.loads(head["trainer"])
    if info["optimizer"] != type(trainer.optimizer).__name__:
        raise ValueError(f"checkpoint {path!r} was written with optimizer {info['optimizer']}, "
                         f"this run uses {type(trainer.optimizer).__name__}")
    state: dict[str, object] = {}
    optim_keys: dict[int, list[tuple[str, str]]] = {}
    for name, p, _ in trainer.held:
        state[f"model.{name}"] = p.detach()
        prefix = f"optim.{name}."
        for key, meta in metadata.items():
            if not key.startswith(prefix):
                continue
            if isinstance(meta, TensorStorageMetadata):
                state[key] = torch.empty(meta.size, dtype=meta.properties.dtype, device=p.device if meta.size else "cpu")
            elif isinstance(meta, BytesStorageMetadata):
                state[key] = None
            optim_keys.setdefault(id(p), []).append((key, key[len(prefix):]))
    dcp.load(state, checkpoint_id=path, process_group=trainer.checkpoint_group)
    for _, p, _ in trainer.held:
        if id(p) in optim_keys:
            trainer.optimizer.state[p] = {short: state[key] for key, short in optim_keys[id(p)]}
    for group, saved in zip(trainer.optimizer.param_groups, info["param_groups"]):
        group.update(saved)
    return info["step"]
