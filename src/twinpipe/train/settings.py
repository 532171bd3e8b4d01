"""The start-up agreement of a trainer's ranks: every rank's configuration, model, criterion and
optimizer compared (``agreement.agree``) before any collective whose sizes depend on them."""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

import torch
from torch import nn

from twinpipe.schedule import registry
from twinpipe.train.agreement import agree, canonical
from twinpipe.train.config import TrainConfig

__all__ = ["agree_settings", "agree_optimizer"]


def _qualname(obj) -> str:
    """``module.qualname`` of a function or class (an object: of its class)."""
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', '?')}.{target.__qualname__}"


def agree_settings(c: TrainConfig, model: nn.Module, parameter_names: Sequence[tuple[str, Sequence[int]]], record: dict,
                   criterion, device, group, where: str) -> None:
    """Every rank's configuration, model and precision, compared over ``group`` (``where``: rank, for messages)."""
    names = json.dumps([[n, list(s)] for n, s in parameter_names]).encode()
    facts = {
        "schedule": registry.get(c.schedule).name, "schedule_options": sorted(c.schedule_options),
        "batch_size": c.batch_size, "microbatch_size": c.microbatch_size, "max_norm": canonical(c.max_norm),
        "balance": c.balance, "seed": c.seed, "timeout": canonical(c.timeout), "dp_reduce": c.dp_reduce, "overlap_dp": c.overlap_dp,
        "on_nonfinite": c.on_nonfinite, "bias_update_speed": canonical(c.bias_update_speed),
        "balance_alpha": canonical(c.balance_alpha),
        "mtp_depth": c.mtp_depth, "mtp_weight": canonical(c.mtp_weight), "precision": c.precision, "zero": c.zero,
        "ep": c.ep,
        "dtype": ",".join(sorted({str(p.dtype) for p in model.parameters()})), "device": torch.device(device).type,
        "criterion": _qualname(criterion),
        "model parameters": f"{len(parameter_names)} named, sha256 {hashlib.sha256(names).hexdigest()[:16]}",
    }
    config = record.get("config")
    if isinstance(config, dict):  # one fact per field: an error names the field that differs
        facts.update((f"model config.{key}", json.dumps(value, sort_keys=True)) for key, value in config.items())
    else:
        facts["model config"] = json.dumps(record, sort_keys=True)
    agree(group, facts, float(c.timeout), where,
          "Build every rank's Trainer with the same TrainConfig, model, dtype, criterion and optimizer; nothing ran.")


def agree_optimizer(optimizer, group, timeout: float, where: str) -> None:
    """Every rank's optimizer class and hyper-parameters (each param group's, ``params`` left out), compared."""
    groups = optimizer.param_groups
    facts: dict[str, object] = {"optimizer": _qualname(type(optimizer)), "optimizer param_groups": len(groups)}
    for i, param_group in enumerate(groups):
        for key, value in param_group.items():
            if key != "params":
                facts[f"optimizer param_groups[{i}].{key}"] = canonical(value)
    agree(group, facts, timeout, where,
          "Build every rank's optimizer alike (optimizer_fn); nothing ran.", decisive=("optimizer", "optimizer param_groups"))
