"""ZeRO-1 (``TrainConfig(zero=1)``): each data-parallel rank updates its shard of the parameters and
holds only that shard's optimizer state (and masters), and the run is bitwise the unsharded one.

One 4-process gloo world runs every case against the single-process reference (itself bitwise the
unsharded trainer, tests/test_train_exact.py, tests/test_precision.py): DualPipe PP=2 x DP=2 (its two
copies of a stage summed before the reduce-scatter, and equal after every step), in float64 and
bf16-mixed, a MoE model (expert parallelism: an expert is held by one rank and never sharded), and
DP=4 with the ordered reduction. Checkpoints move between ZeRO-1 DP=2 x PP=2 and replicated DP=1 x
PP=4 and back (the loaded state bitwise the saved one). A rank configured with another ``zero`` or
``precision`` makes every rank raise.
"""

from __future__ import annotations

import pytest

from distributed import run_named, run_world
from train_setup import gather_state, reference_state, state_differences, steps_against_reference, tiny_setup

WORLD = 4
STEPS = 2

# (schedule, pp, dp, optimizer, max_norm, precision, experts, dp_reduce)
CASES = {
    "dualpipe-pp2-dp2-float64": ("dualpipe", 2, 2, "adamw", 0.3, "pure", 0, "all-reduce"),
    "dualpipe-pp2-dp2-bf16-mixed": ("dualpipe", 2, 2, "sgd", None, "bf16-mixed", 0, "all-reduce"),
    "moe-dualpipev-pp2-dp2": ("dualpipev", 2, 2, "adamw", None, "pure", 4, "all-reduce"),
    "1f1b-pp1-dp4-ordered-bf16-mixed": ("1f1b", 1, 4, "adamw", 0.3, "bf16-mixed", 0, "ordered"),
}


def _dtype(mode: str):
    import torch

    return None if mode == "bf16-mixed" else torch.float64


def _trainer(schedule, pp, dp, optimizer="adamw", max_norm=None, mode="pure", experts=0, dp_reduce="all-reduce", zero=1):
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import Trainer

    model_fn, sampler, criterion, make_opt, config = tiny_setup(schedule, optimizer=optimizer, max_norm=max_norm, experts=experts,
                                                                dp_reduce=dp_reduce, precision=mode, zero=zero)
    return Trainer(model_fn, sampler, criterion, make_opt, build_mesh(dp, pp), config, dtype=_dtype(mode))


def _shards(trainer) -> list[str]:
    """Every dense parameter of every pipeline rank is updated by exactly one data-parallel rank;
    experts by their holder; and this rank's optimizer holds state for nothing else."""
    import torch.distributed as dist

    mine = [(trainer.mesh.pp_rank, name, trainer.optimized_tensor(p) is not None) for name, p, _ in trainer.held]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    count: dict = {}
    for claims in everyone:
        for pp_rank, name, updates in claims:
            count[(pp_rank, name)] = count.get((pp_rank, name), 0) + updates
    problems = [f"pp rank {k[0]}: {k[1]} updated by {n} data-parallel ranks" for k, n in sorted(count.items()) if n != 1]
    updated = {id(trainer.optimized_tensor(p)) for _, p, _ in trainer.held if trainer.optimized_tensor(p) is not None}
    if any(id(t) not in updated for t in trainer.optimizer.state):
        problems.append("optimizer state for a tensor this rank does not update")
    return problems[:4]


def _against_reference(rank: int, schedule, pp, dp, optimizer, max_norm, mode, experts, dp_reduce) -> list[str]:
    import torch
    import torch.distributed as dist

    from twinpipe.train.reference import ReferenceTrainer

    trainer = _trainer(schedule, pp, dp, optimizer, max_norm, mode, experts, dp_reduce)
    model_fn, sampler, criterion, make_opt, config = tiny_setup(schedule, optimizer=optimizer, max_norm=max_norm, experts=experts,
                                                                dp_reduce=dp_reduce, precision=mode)  # zero=0
    ref = ReferenceTrainer(model_fn, sampler, criterion, make_opt, config, dp, pp, dtype=_dtype(mode)) if rank == 0 else None
    problems, inside = [], []  # inside: whether each reduce-scatter started within the pipeline step
    step_fn, start = trainer.pipe.step, trainer.reducer.start
    running = [False]

    def watched_step(*args, **kwargs):
        running[0] = True
        try:
            return step_fn(*args, **kwargs)
        finally:
            running[0] = False

    trainer.pipe.step = watched_step
    trainer.reducer.start = lambda part: (inside.append(running[0]), start(part))
    problems += steps_against_reference(trainer, ref, STEPS)
    state = gather_state(trainer)
    differ = [state_differences(state, reference_state(ref)) if rank == 0 else None]
    dist.broadcast_object_list(differ, src=0)
    problems += [f"weights or optimizer state: {d}" for d in (differ[0] or [])[:4]]
    weights = [{n: p.detach() for n, p in ref.named_parameters().items()} if rank == 0 else None]
    dist.broadcast_object_list(weights, src=0)
    problems += [f"{n}: the weight every rank computes with differs" for n, p, _ in trainer.held if not torch.equal(p.detach(), weights[0][n])]
    overlapped = trainer.config.overlap_dp and len(trainer.placement.chains) == 1  # overlap_dp: started by on_grads_ready
    if not inside or set(inside) != {overlapped}:
        problems.append(f"reduce-scatters started inside the pipeline step: {inside}; expected all {overlapped}")
    return problems + _shards(trainer)


def _checkpoints(rank: int, root: str) -> list[str]:
    """bf16-mixed: ZeRO-1 DualPipe DP=2 x PP=2 saves; replicated 1F1B DP=1 x PP=4 loads it (every
    master and optimizer state bitwise the saved one, stored in FP32), trains a step and saves;
    ZeRO-1 DP=2 x PP=2 loads that; a pure float64 run loads the first (the masters and state widened
    exactly). The same layout resumes bitwise."""
    import torch.distributed as dist

    from twinpipe.train.checkpoint import load_checkpoint, read_checkpoint_info, save_checkpoint

    def same_state(trainer, saved, what):
        state = gather_state(trainer)  # collective
        differ = [state_differences(state, saved) if rank == 0 else None]
        dist.broadcast_object_list(differ, src=0)
        return [f"{what}: the loaded state differs from the saved one: {differ[0][:4]}"] if differ[0] else []

    mixed = dict(optimizer="adamw", max_norm=0.3, mode="bf16-mixed")
    problems = []
    a = _trainer("dualpipe", 2, 2, **mixed)
    first = [a.step(s).loss for s in range(2)]
    save_checkpoint(a, f"{root}/zero1", 2)
    saved_a = gather_state(a)
    later = [a.step(s).loss for s in range(2, 4)]
    dtypes = {str(m.properties.dtype) for k, m in read_checkpoint_info(f"{root}/zero1").metadata.state_dict_metadata.items()
              if k.startswith("model.")}
    if dtypes != {"torch.float32"}:
        problems.append(f"the checkpoint stores weights as {dtypes}, not the FP32 masters")

    b = _trainer("1f1b", 4, 1, zero=0, **mixed)
    start = load_checkpoint(b, f"{root}/zero1")
    problems += same_state(b, saved_a, "ZeRO-1 DP=2 x PP=2 -> replicated DP=1 x PP=4")
    b_loss = b.step(start).loss
    if b_loss != later[0]:  # the same bf16 weights: the first loss after loading is the same under any layout
        problems.append(f"DP=1 x PP=4's first loss {b_loss!r} != DP=2 x PP=2's {later[0]!r}")
    save_checkpoint(b, f"{root}/zero0", start + 1)
    saved_b = gather_state(b)
    b_next = b.step(start + 1).loss

    c = _trainer("dualpipe", 2, 2, **mixed)
    start = load_checkpoint(c, f"{root}/zero0")
    problems += same_state(c, saved_b, "replicated DP=1 x PP=4 -> ZeRO-1 DP=2 x PP=2")
    if c.step(start).loss != b_next:
        problems.append("ZeRO-1 DP=2 x PP=2's first loss after loading differs from DP=1 x PP=4's")
    if not c.mirrors_equal():
        problems.append("mirrored copies differ after loading")

    e = _trainer("1f1b", 4, 1, zero=0, optimizer="adamw", max_norm=0.3, mode="pure")  # float64: the FP32 masters widened
    load_checkpoint(e, f"{root}/zero1")
    widened = [({n: p.double() for n, p in saved_a[0].items()},
                {n: {k: v.double() if k != "step" else v for k, v in st.items()} for n, st in saved_a[1].items()})  # AdamW's step stays
               if rank == 0 else None][0]
    problems += same_state(e, widened, "bf16-mixed ZeRO-1 -> pure float64 replicated")

    d = _trainer("dualpipe", 2, 2, **mixed)
    start = load_checkpoint(d, f"{root}/zero1")
    again = [d.step(s).loss for s in range(start, 4)]
    if again != later:
        problems.append(f"resumed losses {again} != uninterrupted {later} (first two: {first})")
    return problems


def _disagreeing(rank: int, field: str) -> str:
    from twinpipe.runtime.errors import PipelineMismatchError

    odd = rank == 1
    try:
        if field == "zero":
            _trainer("1f1b", 2, 2, zero=1 if odd else 0)
        else:
            _trainer("1f1b", 2, 2, mode="bf16-mixed" if odd else "pure")
    except PipelineMismatchError as error:
        return str(error)
    return "no error"


def _world(rank: int, world: int, root: str) -> dict:
    results = {}
    cases = [(name, lambda a=args: _against_reference(rank, *a)) for name, args in CASES.items()]
    cases += [("checkpoints", lambda: _checkpoints(rank, root))]
    cases += [(f"agree-{f}", lambda f=f: _disagreeing(rank, f)) for f in ("zero", "precision")]
    results.update(run_named(cases))
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return run_world(WORLD, _world, str(tmp_path_factory.mktemp("zero")), timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_zero1_is_bitwise_the_unsharded_reference(outcomes, case):
    assert all(o[case] == [] for o in outcomes), [o[case] for o in outcomes][:2]


def test_checkpoints_move_between_zero1_and_replicated_layouts(outcomes):
    assert all(o["checkpoints"] == [] for o in outcomes), [o["checkpoints"] for o in outcomes][:2]


@pytest.mark.parametrize("field", ["zero", "precision"])
def test_a_rank_with_another_setting_makes_every_rank_raise(outcomes, field):
    for o in outcomes:
        message = o[f"agree-{field}"]
        assert "the ranks are configured differently" in message and f"{field} (ranks" in message, message
