"""Input validation for the load balancer: every error names the argument, its value and what is allowed,
in ``twinpipe.checks``' phrasing (``num_gpus=3: must be ...``), as an ``EplbArgumentError``."""

from __future__ import annotations

from functools import partial

import torch

from twinpipe import checks


class EplbArgumentError(ValueError):
    """A bad argument to the load balancer; ``argument`` is the parameter's name."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


def refused(argument: str, value: object, allowed: str, name: str | None = None) -> EplbArgumentError:
    """``name=value: allowed`` (``name`` defaults to ``argument``) as an error about ``argument``."""
    return checks.bad(name or argument, value, allowed, error=partial(EplbArgumentError, argument))


def check_count(name: str, value: object) -> int:
    """A positive int (bools are refused)."""
    return checks.check_int(value, name, low=1, error=partial(EplbArgumentError, name))


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
    for wrong, allowed in (
        (~torch.isfinite(weight), "must be finite (a load)"),
        (weight.abs() > torch.finfo(torch.float32).max,
         f"must be <= {torch.finfo(torch.float32).max:.4g} (loads are computed in float32)"),
        (weight < 0, "must be >= 0 (a load)"),
    ):
        if bool(wrong.any()):
            i, j = wrong.nonzero()[0].tolist()
            raise refused("weight", weight[i, j].item(), allowed, name=f"weight[{i}, {j}]")
    return weight.float()


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
        raise refused("num_replicas", num_replicas,
                      f"must be a multiple of num_gpus={num_gpus} (every GPU holds the same number of slots)")
    if num_replicas < num_experts:
        raise refused("num_replicas", num_replicas,
                      f"must be >= the number of experts ({num_experts}) so that every expert has a replica")
    hierarchical = num_groups % num_nodes == 0
    if hierarchical:
        if num_experts % num_groups:
            raise refused("num_groups", num_groups, f"must divide the number of experts ({num_experts}) in "
                          f"hierarchical mode (num_nodes={num_nodes} divides num_groups)")
        if num_gpus % num_nodes:
            raise refused("num_gpus", num_gpus, f"must be a multiple of num_nodes={num_nodes} in hierarchical "
                          f"mode (num_nodes divides num_groups={num_groups})")
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
        raise refused("previous_phy2log", previous[bad[0], bad[1]].item(),
                      f"must be >= 0 and <= {num_experts - 1} (a logical expert id)",
                      name=f"previous_phy2log[{bad[0]}, {bad[1]}]")
    return previous
