"""ZeRO-1 (``TrainConfig(zero=1)``): each data-parallel rank updates its shard of the parameters and
holds only that shard's optimizer state (and masters), and the run is bitwise the unsharded one.

One 4-process gloo world runs every case against the single-process reference (itself bitwise the
unsharded trainer, tests/test_train_exact.py, tests/test_precision.py): DualPipe PP=2 x DP=2 (its two
copies of a stage summed before the reduce-scatter, each updating half of every data-parallel shard, so
the world's masters and optimizer state are one model's, and equal after every step), in float64 and
bf16-mixed, a MoE model on DualPipeV and on DualPipe (expert parallelism: an expert is held by one rank
of each copy and never sharded), and
DP=4 with the ordered reduction. Checkpoints move between ZeRO-1 DP=2 x PP=2 and replicated DP=1 x
PP=4 and back, and replicated 1F1B DP=2 x PP=2 and back (the loaded state bitwise the saved one). A rank configured with another ``zero`` or
``precision`` makes every rank raise. The all-gather of the updated weights, awaited by each stage's
next forward, is bitwise the one awaited inside ``step()`` (1F1B, DualPipeV, DualPipe PP=2 x DP=2),
and really awaited there; a peer failing before its all-gather makes its peer raise naming it.
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
    "moe-dualpipe-pp2-dp2-bf16-mixed": ("dualpipe", 2, 2, "adamw", 0.3, "bf16-mixed", 4, "all-reduce"),
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
    """Every model parameter is updated by exactly one rank of the world (mirrored copies: by one
    copy on one data-parallel rank, so its optimizer state exists once), and owned (norms,
    checkpoints) there; experts by their holder; and this rank's optimizer holds state for nothing else."""
    import torch.distributed as dist

    from twinpipe.train.experts import expert_ids

    experts = expert_ids(trainer.pipe.module)
    mine = [(name, trainer.optimized_tensor(p) is not None, owned, id(p) in experts) for name, p, owned in trainer.held]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    count, want = {}, {}
    for claims in everyone:
        for name, updates, owned, expert in claims:
            count[name] = count.get(name, 0) + updates
            want[name] = len(trainer.placement.chains) if expert else 1  # an expert: by its holder in each copy
            if owned and not updates:
                count[name] = -99  # owned (norms, checkpoints) where another rank updates it
    problems = [f"{k} updated by {n} ranks of the world, not {want[k]} (-99: owned where not updated)"
                for k, n in sorted(count.items()) if n != want[k]]
    updated = {id(trainer.optimized_tensor(p)) for _, p, _ in trainer.held if trainer.optimized_tensor(p) is not None}
    if any(id(t) not in updated for t in trainer.optimizer.state):
        problems.append("optimizer state for a tensor this rank does not update")
    return problems[:4]


def _state_once(trainer, state) -> list[str]:
    """The world's masters and optimizer state (``Trainer.state_bytes``, summed over every rank) are
    those of one model (``state``: ``gather_state``, each parameter from its owner) and, for experts
    alone, of their copies that update without owning (mirrored copies: each updates its experts):
    DualPipe's two copies of a dense stage hold one set between them, not one each (collective)."""
    import torch
    import torch.distributed as dist

    def size(t):
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    mine = trainer.state_bytes()
    total = torch.tensor([mine["master"], mine["optimizer"]], dtype=torch.float64)
    dist.all_reduce(total)
    from twinpipe.train.experts import expert_ids

    experts = expert_ids(trainer.pipe.module)
    extra = [(t, trainer.optimizer.state.get(t, {})) for _, p, owned in trainer.held
             for t in [trainer.optimized_tensor(p)] if t is not None and not owned and id(p) in experts]
    more = torch.tensor([sum(size(t) for t, _ in extra) if trainer.mixed else 0,
                         sum(size(v) for _, st in extra for v in st.values())], dtype=torch.float64)
    dist.all_reduce(more)
    want = [None]
    if state is not None:  # global rank 0
        params, states = state
        want = [[(sum(map(size, params.values())) if trainer.mixed else 0) + more[0].item(),
                 sum(size(v) for st in states.values() for v in st.values()) + more[1].item()]]
    dist.broadcast_object_list(want, src=0)
    return [] if total.tolist() == want[0] else [f"masters and optimizer state over the world: {total.tolist()} bytes; "
                                                  f"one model's: {want[0]}"]


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
    problems += _state_once(trainer, state)
    overlapped = trainer.config.overlap_dp and len(trainer.placement.chains) == 1  # overlap_dp: started by on_grads_ready
    if not inside or set(inside) != {overlapped}:
        problems.append(f"reduce-scatters started inside the pipeline step: {inside}; expected all {overlapped}")
    return problems + _shards(trainer)


def _checkpoints(rank: int, root: str) -> list[str]:
    """bf16-mixed: ZeRO-1 DualPipe DP=2 x PP=2 saves; replicated 1F1B DP=1 x PP=4 loads it (every
    master and optimizer state bitwise the saved one, stored in FP32), trains a step and saves;
    ZeRO-1 DP=2 x PP=2 loads that; a pure float64 run loads the first (the masters and state widened
    exactly). The same layout resumes bitwise. Replicated 1F1B DP=2 x PP=2 loads the first and saves;
    ZeRO-1 DualPipe loads that, each state once over its copies and replicas."""
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
    if a.reducer.pending:
        problems.append(f"save_checkpoint left {a.reducer.pending} all-gathers pending")
    later = [a.step(s).loss for s in range(2, 4)]
    load_checkpoint(a, f"{root}/zero1")  # with step 3's all-gathers pending: awaited first, not written over the loaded weights
    if a.step(2).loss != later[0]:
        problems.append("loading into a trainer with all-gathers pending: the next loss differs from the uninterrupted run's")
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

    f = _trainer("1f1b", 2, 2, zero=0, **mixed)  # the same two stages, replicated: each state on both replicas
    start = load_checkpoint(f, f"{root}/zero1")
    problems += same_state(f, saved_a, "ZeRO-1 DualPipe DP=2 x PP=2 -> replicated 1F1B DP=2 x PP=2")
    if f.step(start).loss != later[0]:
        problems.append("replicated 1F1B DP=2 x PP=2's first loss after loading differs from ZeRO-1 DualPipe's")
    save_checkpoint(f, f"{root}/zero0-pp2", start + 1)
    saved_f = gather_state(f)
    g = _trainer("dualpipe", 2, 2, **mixed)
    load_checkpoint(g, f"{root}/zero0-pp2")
    problems += same_state(g, saved_f, "replicated 1F1B DP=2 x PP=2 -> ZeRO-1 DualPipe DP=2 x PP=2")
    problems += [f"after loading: {p}" for p in _state_once(g, saved_f) + _shards(g)]  # each state loaded at its one owner
    if not g.mirrors_equal():
        problems.append("mirrored copies differ after loading a replicated 1F1B checkpoint")
    return problems


# The all-gather after the update awaited by each stage's next forward against awaited inside step()
# (schedule, pp, dp, overlap_dp): one chain with the reduction overlapped, a V (one rank holds two
# stages, whose all-gathers cover both: cut by stage), mirrored copies.
DEFERRED = {"1f1b": ("1f1b", 2, 2, True), "dualpipev-serial-dp": ("dualpipev", 2, 2, False), "dualpipe": ("dualpipe", 2, 2, True)}


def _deferred_against_eager(rank: int, schedule, pp, dp, overlap_dp) -> list[str]:
    """Bitwise the same losses, norms, weights and optimizer state; and the wait really moved: each
    step returns with all-gathers pending, and in the next step each stage module awaits its own
    inside the pipeline step, before its first forward (a V rank's second stage: not before the first's),
    and their receive buffers (at least the sharded weights' bytes) are freed by then."""
    import weakref

    import torch

    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import Trainer

    def make():
        model_fn, sampler, criterion, make_opt, config = tiny_setup(schedule, optimizer="adamw", max_norm=0.3, overlap_dp=overlap_dp, zero=1)
        return Trainer(model_fn, sampler, criterion, make_opt, build_mesh(dp, pp), config, dtype=torch.float64)

    eager, deferred = make(), make()
    eager.defer_gather = False
    problems, events, running = [], [], [False]
    pipe_step, wait_gather = deferred.pipe.step, deferred.reducer.wait_gather

    def watched_step(*args, **kwargs):
        running[0] = True
        try:
            return pipe_step(*args, **kwargs)
        finally:
            running[0] = False

    def pending_for(j):  # the all-gathers stage module j still waits for
        return sum(1 for unit, *_ in deferred.reducer._pending if not unit.stages or j in unit.stages)

    def watched_wait(stage, why):
        events.append(("wait", stage, pending_for(stage) if stage is not None else deferred.reducer.pending, running[0]))
        return wait_gather(stage, why)

    deferred.pipe.step, deferred.reducer.wait_gather = watched_step, watched_wait
    for j, module in enumerate(deferred.pipe.module):  # after the trainer's own pre-hook
        module.register_forward_pre_hook(lambda m, args, j=j: events.append(
            ("forward", j, pending_for(j), [pending_for(k) for k in range(len(deferred.pipe.module)) if k != j])))
    held_buffers = []  # weak references to the receive buffers of the all-gathers left pending by the last step
    for step in range(3):
        events.clear()
        a, b = eager.step(step), deferred.step(step)
        if any(ref() is not None for ref in held_buffers):
            problems.append(f"step {step}: the previous update's all-gather buffers are still alive after the step")
        held_buffers = [weakref.ref(out) for _, _, out, _, _ in deferred.reducer._pending]
        pending_bytes = sum(out.numel() * out.element_size() for _, _, out, _, _ in deferred.reducer._pending)
        sharded_bytes = sum(p.numel() * p.element_size() for unit in deferred.reducer.units for p in unit.params)
        if pending_bytes < sharded_bytes:
            problems.append(f"step {step}: pending all-gather buffers hold {pending_bytes} bytes < the sharded weights' {sharded_bytes}")
        if not torch.equal(a.losses, b.losses) or a.grad_norm != b.grad_norm:
            problems.append(f"step {step}: deferred losses/norm {b.losses.tolist()}/{b.grad_norm} != eager {a.losses.tolist()}/{a.grad_norm}")
        if eager.reducer.pending or not deferred.reducer.pending:
            problems.append(f"step {step}: all-gathers pending when step() returns: eager {eager.reducer.pending}, "
                            f"deferred {deferred.reducer.pending} (expected 0 and some)")
        if step == 0:
            continue
        for j in range(len(deferred.pipe.module)):
            mine = [e for e in events if e[1] == j]
            first = next((i for i, e in enumerate(mine) if e[0] == "forward"), None)
            waits = [e for e in mine[:first] if e[0] == "wait" and e[2] > 0]
            if first is None or not waits or not all(w[3] for w in waits) or mine[first][2]:
                problems.append(f"step {step}: stage module {j}: events {mine[:(first or 0) + 1]}: expected a wait inside the "
                                "pipeline step for its pending all-gathers, then its forward with none left")
        forwards = [e for e in events if e[0] == "forward"]
        if len(deferred.pipe.module) > 1 and forwards and not all(forwards[0][3]):
            problems.append(f"step {step}: at the first forward, the other stages' all-gathers were already awaited: {forwards[0]}")
    deferred.mirrors_equal()  # reads the weights: awaits the pending all-gathers first
    if deferred.reducer.pending:
        problems.append(f"mirrors_equal left {deferred.reducer.pending} all-gathers pending")
    for (name, p, _), (_, q, _) in zip(eager.held, deferred.held):
        if not torch.equal(p, q):
            problems.append(f"{name}: deferred weight differs from eager")
        s, t = eager.optimizer.state.get(eager.optimized_tensor(p), {}), deferred.optimizer.state.get(deferred.optimized_tensor(q), {})
        if s.keys() != t.keys() or any(not torch.equal(torch.as_tensor(s[k]), torch.as_tensor(t[k])) for k in s):
            problems.append(f"{name}: deferred optimizer state differs from eager")
    return problems[:6]


def _peer_fails_in_update(rank: int, fault: str = "gather") -> dict:
    """DP rank 1 of pipeline rank 0 fails in its update of step 0 (``fault``: starting its first
    all-gather, or ``"optimizer"``: in ``optimizer.step``, before any all-gather): its data-parallel
    peer's step 0 returns, and its step 1 raises within the timeout naming the all-gather; afterwards
    the weights of both are refused (incomplete), not used."""
    import dataclasses
    import time

    import torch
    import torch.distributed as dist

    from twinpipe.runtime.errors import PipelineBrokenError
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.trainer import Trainer

    timeout = 30.0 if fault == "gather" else 12.0  # the ranks of pipeline rank 1 wait this long (their peers raise without telling them)
    model_fn, sampler, criterion, make_opt, config = tiny_setup("1f1b", optimizer="adamw", zero=1)
    trainer = Trainer(model_fn, sampler, criterion, make_opt, build_mesh(2, 2), dataclasses.replace(config, timeout=timeout),
                      dtype=torch.float64)
    mesh, out = trainer.mesh, {"timeout": timeout}
    failing = (mesh.dp_rank, mesh.pp_rank) == (1, 0)
    gather = dist.all_gather_single

    def refused(*args, **kwargs):
        raise RuntimeError("injected failure starting the all-gathers")

    def refused_update():
        raise RuntimeError("injected failure in optimizer.step")

    start = time.monotonic()
    try:
        if failing and fault == "gather":
            dist.all_gather_single = refused
        elif failing:
            trainer.optimizer.step = lambda *a, **k: refused_update()
        for step in range(2):
            try:
                trainer.step(step)
            except Exception as error:
                out.update(step=step, error=f"{type(error).__name__}: {error}", seconds=time.monotonic() - start)
                break
    finally:
        dist.all_gather_single = gather
    if mesh.pp_rank == 0:
        try:
            trainer.finish_update()
            out["after"] = "finish_update returned"
        except PipelineBrokenError as error:
            out["after"] = str(error)
    if failing and fault == "optimizer":  # its weights are stale: the next step refuses them too, at once
        try:
            trainer.step(2)
            out["next step"] = "returned"
        except Exception as error:
            out["next step"] = f"{type(error).__name__}: {error}"
    return {"dp": mesh.dp_rank, "pp": mesh.pp_rank, **out}


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
    cases += [(f"deferred-{name}", lambda a=args: _deferred_against_eager(rank, *a)) for name, args in DEFERRED.items()]
    # Last: they leave all-gathers unmatched (each on its own trainer's groups).
    cases += [(f"peer-fails-in-{fault}", lambda f=fault: _peer_fails_in_update(rank, f)) for fault in ("optimizer", "gather")]
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


@pytest.mark.parametrize("name", list(DEFERRED))
def test_deferred_all_gather_is_bitwise_the_eager_one_and_awaited_by_each_stage(outcomes, name):
    assert all(o[f"deferred-{name}"] == [] for o in outcomes), [o[f"deferred-{name}"] for o in outcomes][:2]


@pytest.mark.parametrize("fault", ["gather", "optimizer"])
def test_a_peer_failing_before_its_all_gather_makes_its_peer_raise_naming_it(outcomes, fault):
    case = f"peer-fails-in-{fault}"
    assert all(isinstance(o[case], dict) for o in outcomes), [o[case] for o in outcomes]
    by = {(o[case]["dp"], o[case]["pp"]): o[case] for o in outcomes}
    failed, peer = by[(1, 0)], by[(0, 0)]
    assert failed.get("step") == 0 and "injected failure" in failed["error"], failed
    assert peer.get("step") == 1, peer  # step 0 returned with the all-gathers pending
    assert "all-gather of updated weights" in peer["error"] and "rank dp=0 pp=0" in peer["error"], peer
    assert "before the forward of stage 0" in peer["error"] and "global ranks [0, 2]" in peer["error"], peer
    assert peer["seconds"] < peer["timeout"] / 2, peer  # the failure notice is heard at once, not at the timeout
    assert "the weights are incomplete" in peer["after"] and "rank dp=0 pp=0" in peer["after"], peer
    assert "the weights are incomplete" in failed["after"] and "injected failure" in failed["after"], failed
    assert all("error" in o for o in by.values()), by  # every rank raised: nothing hangs
    if fault == "optimizer":  # the failing rank's later calls refuse its stale weights
        assert "the weights are incomplete" in failed["next step"] and "optimizer.step" in failed["next step"], failed


def test_the_forward_pre_hook_sees_every_stages_first_forward_in_the_built_in_schedules():
    """The deferred all-gather is awaited by a stage module's forward pre-hook, which an F&B op's
    forward half (run through the stage's parts) bypasses: no built-in schedule starts a stage with
    one; a schedule that does (``first_forward_in_fb``) makes the trainer await them before the step."""
    from twinpipe.schedule import registry
    from twinpipe.schedule.ops import parse_op
    from twinpipe.train.trainer import first_forward_in_fb

    for name in registry.names():
        for p, m in ((2, 4), (4, 8), (4, 5)):
            try:
                schedule = registry.build(name, p, m)
            except ValueError:  # a size the schedule does not take
                continue
            assert not any(first_forward_in_fb(ops) for ops in schedule.ops), (name, p, m)
    assert first_forward_in_fb([parse_op("0F0"), parse_op("(1F0;0BW0)")])
    assert not first_forward_in_fb([parse_op("0F0"), parse_op("1F0"), parse_op("(1F1;0BW0)")])
