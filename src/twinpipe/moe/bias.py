"""Auxiliary-loss-free load balancing (DeepSeek-V3): each routed expert's bias, added to its score
for the top-k choice only, moves against the expert's load after every training step.

The rule (``bias_step``): with ``load_i`` the token copies routed to expert i in the step, summed
over every rank that routes tokens through that layer (expert- and data-parallel replicas), and
``mean`` their mean over the E experts, ``b_i += gamma * sign(mean - load_i)``: an overloaded
expert's bias drops by gamma, an underloaded one's rises by gamma, an expert exactly at the mean
keeps its bias. The comparison is made on integers (``sum - E * load_i``), so every rank with the
same loads moves its biases alike, bit for bit. The bias is a buffer: no gradient, no optimizer.

Routers it moves: ``twinpipe.moe.TopKRouter`` (``bias``, counting into ``loads``) and Hugging Face
DeepSeek-V3 gates (``DeepseekV3TopkRouter``: any module with an ``e_score_correction_bias``
buffer whose forward returns ``(logits, weights, indices)``), whose choices a forward hook counts.
``twinpipe.train.Trainer`` moves its model's biases itself (``TrainConfig.bias_update_speed``);
``BiasBalancer`` is the same for a loop of one's own.
"""

from __future__ import annotations

import torch
from torch import nn

from twinpipe.checks import check_float
from twinpipe.moe.agree import agree, all_reduce, ep_timeout, frame_device
from twinpipe.moe.router import TopKRouter

__all__ = ["bias_step", "update_bias_", "bias_routers", "hf_gates", "BiasBalancer", "CountedRouter", "HF_BIAS"]

HF_BIAS = "e_score_correction_bias"  # the buffer of transformers' DeepseekV3TopkRouter


def is_hf_gate(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face DeepSeek-V3 gate: a module with an ``e_score_correction_bias`` tensor."""
    return isinstance(getattr(module, HF_BIAS, None), torch.Tensor)


def hf_gates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, gate)`` of every Hugging Face DeepSeek-V3 gate in ``model`` (``is_hf_gate``), in module order."""
    return [(name, m) for name, m in model.named_modules() if is_hf_gate(m)]


def bias_step(loads: torch.Tensor, gamma: float) -> torch.Tensor:
    """``gamma * sign(mean(loads) - loads)`` per expert (float64), compared exactly on integers."""
    loads = loads.to(torch.int64)
    return gamma * torch.sign(loads.sum() - len(loads) * loads).to(torch.float64)


def update_bias_(bias: torch.Tensor, loads: torch.Tensor, gamma: float) -> None:
    """Move ``bias`` in place by ``bias_step(loads, gamma)`` (``loads`` summed over every rank)."""
    if loads.shape != bias.shape:
        raise ValueError(f"loads has shape {tuple(loads.shape)}: must match the bias, {tuple(bias.shape)}")
    with torch.no_grad():
        bias.add_(bias_step(loads.cpu(), gamma).to(device=bias.device, dtype=bias.dtype))


class _GateCounter:
    """A forward hook on a Hugging Face DeepSeek-V3 gate: counts its top-k choices in training."""

    def __init__(self, gate: nn.Module):
        bias = getattr(gate, HF_BIAS)
        self.loads = torch.zeros(len(bias), dtype=torch.long, device=bias.device)
        self.handle = gate.register_forward_hook(self)

    def __call__(self, gate, inputs, output):
        if gate.training and torch.is_grad_enabled():
            indices = output[2]
            self.loads += torch.bincount(indices.reshape(-1), minlength=len(self.loads)).to(self.loads.device)


class CountedRouter:
    """One router of ``bias_routers``: its ``bias`` and its ``loads`` (token copies routed to each
    expert since the last reset): a ``TopKRouter`` counts them itself, a Hugging Face gate through a
    forward hook put on it here (``counter.handle.remove()`` takes it off)."""

    def __init__(self, name: str, module: nn.Module):
        self.name, self.module = name, module
        if isinstance(module, TopKRouter):
            self.counter = None
        else:
            self.counter = _GateCounter(module)

    @property
    def bias(self) -> torch.Tensor:
        return self.module.bias if self.counter is None else getattr(self.module, HF_BIAS)

    @property
    def loads(self) -> torch.Tensor:
        return self.module.loads if self.counter is None else self.counter.loads


_Slot = CountedRouter


def bias_routers(model) -> list[tuple[str, nn.Module]]:
    """``(name, router)`` of every ``TopKRouter`` and Hugging Face DeepSeek-V3 gate in ``model`` (a
    module, or a sequence of modules such as a rank's stages, named ``"i.name"`` then), in order."""
    modules = [("", model)] if isinstance(model, nn.Module) else [(f"{i}.", m) for i, m in enumerate(model)]
    found = []
    for prefix, module in modules:
        if not isinstance(module, nn.Module):
            raise ValueError(f"model holds a {type(module).__name__}: must be a module or a sequence of modules")
        found += [(prefix + name, m) for name, m in module.named_modules()
                  if isinstance(m, TopKRouter) or is_hf_gate(m)]
    return found


class BiasBalancer:
    """Moves the routing bias of every router of ``model`` (``bias_routers``) by ``gamma`` against
    its load after each training step: call ``step()`` after ``optimizer.step()``, on every rank of
    ``group`` (the ranks whose tokens pass through the same layers: the expert- and data-parallel
    ranks of a pipeline stage; None: this process alone). One all-reduce per call, its wait at most
    ``timeout`` s (default: the limit in force, else ``twinpipe.checks.DEFAULT_TIMEOUT``).

    Hugging Face DeepSeek-V3 gates get a forward hook that counts their choices (``close()``
    removes the hooks). With DualPipe's mirrored copies, a layer's tokens pass through two ranks of
    the pipeline: include both in ``group``, or use ``twinpipe.train.Trainer``.
    """

    def __init__(self, model, gamma: float, group=None, timeout: float | None = None):
        self.gamma = check_float(gamma, "gamma", low=0.0)
        self.group, self.timeout = group, ep_timeout(timeout)
        self.slots = [CountedRouter(name, m) for name, m in bias_routers(model)]
        if not self.slots:
            raise ValueError(f"model ({type(model).__name__}) has no router with a bias (TopKRouter, or a module with "
                             f"an {HF_BIAS} buffer): nothing to balance")
        self._agreed = False

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    def step(self) -> list[torch.Tensor]:
        """Sum the step's loads over ``group``, move every bias, reset the counts; returns the
        summed [E] loads per router (on the CPU)."""
        flat = torch.cat([s.loads.to(torch.int64).cpu() for s in self.slots])
        if self.group is not None and torch.distributed.get_world_size(self.group) > 1:
            device = frame_device(self.slots[0].bias)
            if not self._agreed:  # its size comes from the routers, fixed since __init__: checked once
                agree(self.group, {"routers": self.names, "experts": [len(s.bias) for s in self.slots]},
                      "BiasBalancer.step", self.timeout, device)
                self._agreed = True
            flat = flat.to(device) if device is not None else flat
            all_reduce(flat, self.group, self.timeout, "BiasBalancer.step")
            flat = flat.cpu()
        loads = list(flat.split([len(s.bias) for s in self.slots]))
        for slot, load in zip(self.slots, loads):
            update_bias_(slot.bias, load, self.gamma)
            slot.loads.zero_()
        return loads

    def close(self) -> None:
        """Remove the forward hooks put on Hugging Face gates."""
        for slot in self.slots:
            if slot.counter is not None:
                slot.counter.handle.remove()
