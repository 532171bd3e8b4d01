"""Input validation for the load balancer: every error names the argument, its value and what is allowed."""

from __future__ import annotations

import torch


class EplbArgumentError(ValueError):
    """A bad argument to the load balancer; ``argument`` is the parameter's name."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


def check_count(name: str, value: object) -> int:
    """A positive int (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise EplbArgumentError(name, f"{name}={value!r} is not allowed: it must be a positive int")
    if value <= 0:
        raise EplbArgumentError(name, f"{name}={value} is not allowed: it must be a positive int")
    return value


def check_weight(weight: object) -> torch.Tensor:
    """A finite, non-negative real [layers, experts] tensor, returned as float32 on the CPU."""
    if not isinstance(weight, torch.Tensor):
        try:
            weight = torch.as_tensor(weight)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise EplbArgumentError(
                "weight", f"weight of type {type(weight).__name__} is not allowed: pass a 2-D tensor ({exc})"
            ) from None
    if weight.dim() != 2:
        raise EplbArgumentError(
            "weight",
            f"weight has shape {tuple(weight.shape)} (rank {weight.dim()}); "
            "allowed: a 2-D tensor [layers, experts]",
        )
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise EplbArgumentError(
            "weight", f"weight has shape {tuple(weight.shape)}; allowed: at least one layer and one expert"
        )
    if weight.is_complex() or weight.dtype == torch.bool:
        raise EplbArgumentError("weight", f"weight has dtype {weight.dtype}; allowed: a real numeric dtype")
    weight = weight.detach().cpu()
    if not bool(torch.isfinite(weight).all()):
        bad = (~torch.isfinite(weight)).nonzero()[0].tolist()
        raise EplbArgumentError(
            "weight",
            f"weight[{bad[0]}, {bad[1]}]={weight[bad[0], bad[1]].item()} is not allowed: loads must be finite",
        )
    too_big = weight.abs() > torch.finfo(torch.float32).max
    if bool(too_big.any()):
        bad = too_big.nonzero()[0].tolist()
        raise EplbArgumentError(
            "weight",
            f"weight[{bad[0]}, {bad[1]}]={weight[bad[0], bad[1]].item()} is not allowed: loads are computed "
            f"in float32 and must be at most {torch.finfo(torch.float32).max:.4g}",
        )
    weight = weight.float()
    if bool((weight < 0).any()):
        bad = (weight < 0).nonzero()[0].tolist()
        raise EplbArgumentError(
            "weight",
            f"weight[{bad[0]}, {bad[1]}]={weight[bad[0], bad[1]].item()} is not allowed: loads must be >= 0",
        )
    return weight


def check_layout(
    num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> bool:
    """Check the counts against each other; return True for the hierarchical policy."""
    for name, value in (
        ("num_replicas", num_replicas),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_gpus", num_gpus),
    ):
        check_count(name, value)
    if num_replicas % num_gpus:
        raise EplbArgumentError(
            "num_replicas",
            f"num_replicas={num_replicas} is not allowed: it must be a multiple of num_gpus={num_gpus} "
            "(every GPU holds the same number of slots)",
        )
    if num_replicas < num_experts:
        raise EplbArgumentError(
            "num_replicas",
            f"num_replicas={num_replicas} is not allowed: it must be >= the number of experts "
            f"({num_experts}) so that every expert has a replica",
        )
    hierarchical = num_groups % num_nodes == 0
    if hierarchical:
        if num_experts % num_groups:
            raise EplbArgumentError(
                "num_groups",
                f"num_groups={num_groups} is not allowed: in hierarchical mode (num_nodes={num_nodes} "
                f"divides num_groups) it must divide the number of experts ({num_experts})",
            )
        if num_gpus % num_nodes:
            raise EplbArgumentError(
                "num_gpus",
                f"num_gpus={num_gpus} is not allowed: in hierarchical mode (num_nodes={num_nodes} "
                f"divides num_groups={num_groups}) it must be a multiple of num_nodes",
            )
    return hierarchical


def check_previous(previous: object, num_layers: int, num_experts: int, num_replicas: int) -> torch.Tensor:
    """A [layers, num_replicas] integer tensor of logical ids in [0, experts)."""
    if not isinstance(previous, torch.Tensor):
        previous = torch.as_tensor(previous)
    if previous.shape != (num_layers, num_replicas):
        raise EplbArgumentError(
            "previous_phy2log",
            f"previous_phy2log has shape {tuple(previous.shape)}; allowed: ({num_layers}, {num_replicas}) "
            "= [layers, num_replicas]",
        )
    if previous.is_floating_point() or previous.is_complex() or previous.dtype == torch.bool:
        raise EplbArgumentError(
            "previous_phy2log", f"previous_phy2log has dtype {previous.dtype}; allowed: an integer dtype"
        )
    previous = previous.long().cpu()
    if bool(((previous < 0) | (previous >= num_experts)).any()):
        bad = ((previous < 0) | (previous >= num_experts)).nonzero()[0].tolist()
        raise EplbArgumentError(
            "previous_phy2log",
            f"previous_phy2log[{bad[0]}, {bad[1]}]={previous[bad[0], bad[1]].item()} is not allowed: "
            f"logical ids must be in [0, {num_experts})",
        )
    return previous
