"""The planner's activation rows for the overlapped schedules (overlap, extra warm-up: built by the
schedule layer, schedule/fb_pairing.py) against a measured run: twinpipe train's GPT on 2 gloo
ranks runs the very schedule the planner plans (``plan.candidates.build``; ZB-V ordered by the W
memory the planner gives it), ``Pipeline.step(measure_memory=True)`` measures each rank's peak, and
``twinpipe plan --gpt``'s prediction for that row (``predict_one(..., gpt=GPTRun)``) is within 10%,
as every registered schedule's is (tests/test_memory.py). One 2-process world.
"""

from __future__ import annotations

import pytest

from distributed import run_named, run_world

ROWS, M, TOLERANCE = 4, 8, 0.10
CASES = {
    "interleaved-1f1b overlap k=0": ("interleaved-1f1b", {"overlap": True, "warmup_extra": 0}),
    "interleaved-1f1b overlap k=2": ("interleaved-1f1b", {"overlap": True, "warmup_extra": 2}),
    "interleaved-1f1b overlap k=1": ("interleaved-1f1b", {"overlap": True, "warmup_extra": 1}),
    "zbv overlap": ("zbv", {"overlap": True}),
}


def _config():
    from twinpipe.train.model import GPTConfig

    return GPTConfig(vocab=32, seq_len=8, dim=16, heads=2, layers=4)


def _measured(name: str, options: dict) -> int:
    """This rank's measured activation peak, in bytes, under the planner's schedule."""
    import torch
    import torch.distributed as dist

    import twinpipe
    from twinpipe.plan.candidates import build
    from twinpipe.runtime.batches import batch_layout
    from twinpipe.runtime.weight_grad import defer_weight_grads
    from twinpipe.train.model import GPT, lm_loss
    from twinpipe.train.stages import split, stage_modules

    from twinpipe.sim.gpt import PLANNED_WITH_MW, GPTRun, stage_layers, stage_memory

    cfg = _config()
    if name in PLANNED_WITH_MW:  # ordered by the memory W keeps, as the trainer and the planner order it
        run = GPTRun.of(cfg, ROWS)
        cut = stage_layers(run, twinpipe.schedule.resolve(name, 2, **options).placement.num_model_stages)
        options = {**options, "mw": round(max(stage_memory(run, n, ROWS, run.elsize, 1).mw for n in cut), 3)}
    schedule = build(name, 2, M, options)
    spec = twinpipe.schedule.resolve(schedule, 2)
    rank = dist.get_rank()
    torch.manual_seed(0)
    cut = split(GPT(cfg), spec.placement.num_model_stages)
    modules = [defer_weight_grads(m) for m in stage_modules(cut, spec, 2, rank)]
    x = torch.randint(0, cfg.vocab, (ROWS * M, cfg.seq_len))
    with twinpipe.Pipeline(modules, spec, tensor_shapes=[(ROWS, cfg.seq_len, cfg.dim)], tensor_dtype=torch.float32) as pipe:
        layout = batch_layout(spec, 2, rank, M)
        pipe.step(*layout.inputs(x), num_chunks=M, criterion=lm_loss, labels=layout.labels(x), measure_memory=True)
        return pipe.last_memory.activations_peak


def _world(rank, world):
    return run_named([(case, lambda n=name, o=options: _measured(n, o)) for case, (name, options) in CASES.items()])


@pytest.fixture(scope="module")
def measured():
    return run_world(2, _world)


@pytest.mark.parametrize("case", sorted(CASES))
def test_planned_activation_peak_of_an_overlapped_schedule_within_10_percent_of_the_run(measured, case):
    from twinpipe.plan import Cluster, Model, predict_one
    from twinpipe.sim.gpt import GPTRun

    name, options = CASES[case]
    cfg = _config()
    row = predict_one(name, Model.from_config(cfg, microbatch_size=ROWS), Cluster(gpus=2), 2, M, options=options,
                      gpt=GPTRun.of(cfg, ROWS))
    assert row.memory_parts, row.why
    for rank in range(2):
        got = measured[rank][case]
        assert not isinstance(got, list), got
        predicted = next(r["activations_peak"] for r in row.memory_parts if r["pp_rank"] == rank)
        assert abs(got - predicted) <= TOLERANCE * predicted, f"rank {rank}: measured {got} B, planned {predicted} B"
