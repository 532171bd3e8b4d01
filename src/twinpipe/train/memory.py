"""The trainer's per-rank memory report: one step measured, and the same quantities predicted.

``measured_step(trainer, step)`` trains ``step`` with the pipeline's activation meter on
(``twinpipe.runtime.memory``), then measures each of this rank's stages alone on the inputs it
saw (``measure_stage``) and replays the rank's program on them (``Pipeline.predict_activation_peak``).
Parameters, gradients, master weights and optimizer state are counted on the rank
(``Trainer.state_bytes``) and predicted from the parameter counts
(``twinpipe.sim.memory.state_prediction``). ``gather_report`` collects every rank's
``RankMemory`` (collective), as ``train-log.json`` stores them under ``"memory"``.
"""

from __future__ import annotations

import functools

import torch

from twinpipe.runtime.collectives import gather_objects
from twinpipe.runtime.memory import measure_stage
from twinpipe.sim.gpt import PLANNED_WITH_MW  # generators that order their ops by the memory W keeps
from twinpipe.sim.memory import MemoryParts, RankMemory, state_prediction

__all__ = ["measured_step", "gather_report", "state_bytes"]


def state_bytes(params, masters, optimizer) -> dict[str, int]:
    """Bytes of model state by part (``twinpipe.sim.memory.MemoryParts`` names): ``params`` (in their own
    dtype), ``grads`` (the buffers gradients accumulate in: FP32 ``main_grad`` under mixed precision,
    else one ``.grad`` per parameter), ``master`` (the FP32 ``masters``) and ``optimizer`` (every
    tensor of the optimizer's state as it is now: AdamW builds its state at the first step)."""
    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    grads = sum(size(p.main_grad) if getattr(p, "main_grad", None) is not None else size(p) for p in params)
    optimizer_state = sum(size(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": sum(size(p) for p in params), "grads": grads, "master": sum(size(t) for t in masters),
            "optimizer": optimizer_state}


def _state_predicted(trainer) -> MemoryParts:
    params = trainer.params
    updated = trainer.updated_parameters  # ZeRO-1: this rank's shard
    kind = "adamw" if isinstance(trainer.optimizer, (torch.optim.Adam, torch.optim.AdamW)) else \
        "sgd" if isinstance(trainer.optimizer, torch.optim.SGD) else "none"
    elsize = params[0].element_size() if params else 4
    return state_prediction([p.numel() for p in params], elsize, mixed=trainer.mixed,
                            updated=[p.numel() for p in updated], optimizer=kind)


def measured_step(trainer, step: int):
    """Train ``step`` with memory measured; returns (the step's result, this rank's ``RankMemory``)."""
    pipe = trainer.pipe
    inputs: dict[int, tuple] = {}
    labels: list = []

    outputs: list[int] = []  # how many tensors the last stage returns: the criterion's arguments after them are labels

    def keep_input(stage, module, args):
        if stage not in inputs:
            inputs[stage] = tuple(a.detach().clone() for a in args)

    def count_outputs(module, args, out):
        if not outputs:
            outputs.append(len(out) if isinstance(out, (tuple, list)) else 1)

    run = trainer.train_step
    criterion = run.criterion  # what the last stage runs (with MTP: MTPLoss over the model's criterion)

    def keeping_labels(*args):
        if not labels:
            labels.append(tuple(a.detach().clone() for a in args[outputs[0] if outputs else 1:]))
        return criterion(*args)

    handles = [m.register_forward_pre_hook(functools.partial(keep_input, s)) for s, m in zip(pipe.stages, pipe.module)]
    handles += [m.register_forward_hook(count_outputs) for s, m in zip(pipe.stages, pipe.module) if trainer.placement.is_last(s)]
    run.criterion, pipe.measure_memory = keeping_labels, True
    try:
        result = trainer.step(step)
    finally:
        run.criterion, pipe.measure_memory = criterion, False
        for h in handles:
            h.remove()
    measured = MemoryParts(**trainer.state_bytes(), activations_peak=pipe.last_memory.activations_peak,
                           device_peak=pipe.last_memory.device_peak)
    predicted = _state_predicted(trainer)
    predicted.activations_peak = predict_activations(trainer, inputs, labels[0] if labels else ())
    mesh = trainer.mesh
    return result, RankMemory(torch.distributed.get_rank(), mesh.dp_rank, mesh.pp_rank, measured, predicted)


def predict_activations(trainer, inputs: dict, labels: tuple) -> int:
    """This rank's predicted activation peak from its stages measured alone on the inputs they saw.
    Collective over the data-parallel ranks of a stage: MoE experts exchange tokens in their forward
    and backward, and every rank measures its stages in the same order at the same point."""
    pipe, placement = trainer.pipe, trainer.placement
    grads = [(p, p.grad) for p in trainer.params]
    stages = {}
    for s, module in zip(pipe.stages, pipe.module):
        last = placement.is_last(s)
        stages[s] = measure_stage(module, inputs[s], first=placement.is_first(s),
                                  criterion=trainer.train_step.criterion if last else None, labels=labels if last else ())
    for p, g in grads:  # measuring ran the stages' W: leave the step's gradients as they were
        p.grad = g
    return pipe.predict_activation_peak(trainer.num_chunks, stages)


def gather_report(trainer, entry: RankMemory) -> list[RankMemory]:
    """Every rank's entry, in global rank order (collective over the world)."""
    entries = gather_objects(trainer.checkpoint_group, entry.to_dict(), trainer.timeout,
                             f"rank {torch.distributed.get_rank()}: gathering the memory report")
    return sorted((RankMemory.from_dict(e) for e in entries), key=lambda e: e.rank)


def measured_mw(model, num_stages: int, sample: tuple, criterion) -> float:
    """M_W / M_B of ``model`` cut into ``num_stages`` (``"params"`` balance), the largest over its
    stages, each measured alone on ``sample`` = (inputs, labels) of one micro-batch: what W really
    keeps, for the generators that plan with it (``PLANNED_WITH_MW``). The same on every rank (the
    same model, the same sample), so every rank builds the same schedule."""
    from twinpipe.runtime.weight_grad import defer_weight_grads
    from twinpipe.train.mtp import MTPLoss, mtp_heads
    from twinpipe.train.stages import split

    x, y = sample
    ratios, h = [], x
    stages = split(model, num_stages, "params")
    for k, stage in enumerate(stages):
        defer_weight_grads(stage)  # in place, as the trainer's stages are
        last = k == len(stages) - 1
        heads = mtp_heads([stage]) if last else []
        runs = MTPLoss(criterion, heads[0], 1.0) if heads else criterion  # an MTP head's loss (its weight keeps no bytes)
        ratios.append(measure_stage(stage, (h,), first=k == 0, criterion=runs if last else None,
                                    labels=(y,) if last else ()).mw)
        with torch.no_grad():
            out = stage(h)
            h = out[0] if isinstance(out, tuple) else out
    return max(ratios)


def planned_options(config, model, sampler, criterion, pp: int, device) -> dict:
    """``config.schedule_options`` with ``mw`` measured (``measured_mw`` on the sampler's first
    micro-batch, to 3 digits) for a schedule that plans with it, unless given; MoE models (experts
    talk across ranks) keep the generator's default."""
    from twinpipe.schedule import registry, resolve

    options = dict(config.schedule_options)
    if "mw" in options or registry.get(config.schedule).name not in PLANNED_WITH_MW or \
            any(hasattr(m, "parts") for m in model.modules()):
        return options
    num_stages = resolve(config.schedule, pp, **options).placement.num_model_stages
    x, y = sampler.batch(0, config.microbatch_size)
    return {**options, "mw": round(measured_mw(model, num_stages, (x.to(device), y.to(device)), criterion), 3)}
