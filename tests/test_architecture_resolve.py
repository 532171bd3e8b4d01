"""A schedule is resolved once (``twinpipe.schedule.resolve``) and the spec is passed on.

Outside ``schedule/`` no code asks the registry for a placement again; a name, a generator and a
fixed ``Schedule`` resolve to a spec that builds what the registry (or the generator) would;
``batch_layout``, ``stage_modules`` and ``Pipeline`` take the spec and never resolve it again.
"""

from __future__ import annotations

import ast
import copy
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import models
from distributed import run_cases, run_world

import twinpipe

SRC = Path(twinpipe.__file__).resolve().parent  # the package under test (PYTHONPATH picks it)


def _calls(path: Path, name: str) -> list[int]:
    """Lines of ``path`` that call a function named ``name`` (``f(...)`` or ``x.f(...)``)."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called == name:
                calls.append(node.lineno)
    return calls


def test_placement_for_is_called_from_the_schedule_package_only():
    outside = [f"{path.relative_to(SRC.parent)}:{line}" for path in sorted(SRC.rglob("*.py"))
               if "schedule" not in path.relative_to(SRC).parts[:1] for line in _calls(path, "placement_for")]
    assert outside == [], f"resolve the schedule once (twinpipe.schedule.resolve) and pass the spec: {outside}"
    assert _calls(SRC / "schedule" / "spec.py", "placement_for")  # the scan sees the one real caller


# ------------------------------------------------------------------ the spec, without torch.distributed
def test_a_name_resolves_to_what_the_registry_builds():
    from twinpipe.schedule import ScheduleSpec, registry, resolve

    spec = resolve("ZB-V", 4)  # an alias, any case
    assert isinstance(spec, ScheduleSpec) and spec.kind == "registered"
    assert (spec.name, spec.num_ranks, dict(spec.options)) == ("zbv", 4, {})
    assert spec.placement == registry.placement_for("zbv", 4)
    assert spec.build(8) == registry.build("zbv", 4, 8)
    assert spec.stages_of(1) == registry.stages_of_rank("zbv", 4, 1) == (1, 6)
    chimera = resolve("chimera", 4, pairs=2)
    assert chimera.describe() == "chimera(pairs=2)" and chimera.build(8) == registry.build("chimera", 4, 8, pairs=2)
    assert chimera.build(8).options["pairs"] == 2  # a trace says how it was built, as registry.build
    assert chimera.with_options(pairs=1) == resolve("chimera", 4, pairs=1)
    assert resolve("1f1b", 2) == resolve("one-f-one-b", 2) and len({resolve("1f1b", 2), resolve("1f1b", 2)}) == 1
    with pytest.raises(AttributeError):
        spec.name = "gpipe"  # frozen
    with pytest.raises(TypeError):
        spec.options["x"] = 1  # read-only
    assert pickle.loads(pickle.dumps(chimera)) == copy.deepcopy(chimera) == chimera  # a Pipeline's attribute copies


@pytest.mark.parametrize("call, message", [
    (lambda r: r(3, 2), r"schedule=3: must be a registered name"),
    (lambda r: r("nope", 2), r"schedule='nope': allowed are "),
    (lambda r: r("1f1b", True), r"num_ranks=True: must be an int >= 1"),
    (lambda r: r("1f1b", 2, pairs=2), r"1f1b: option pairs=2: unknown; 1f1b takes overlap, warmup_extra"),
    (lambda r: r("dualpipe", 3).build(6), r"dualpipe: num_ranks=3"),
    (lambda r: r("interleaved", 2, stages_per_rank=0), r"interleaved-1f1b: stages_per_rank=0"),
    (lambda r: r("zbv", 4).build(10**5), r"num_microbatches=100000: must be >= 1 and <= "),
    (lambda r: r("zbv", 4).build(2**12), r"zbv: num_microbatches=4096: must be <= 1024 on 8 stages \(8 stages x num_microbatches=4096 = 32768"),
    (lambda r: r("zbv", 4).stages_of(4), r"rank=4: must be >= 0 and <= 3"),
    (lambda r: r(r("1f1b", 2), 4), r"num_ranks=4: the schedule 1f1b was resolved for 2 ranks"),
    (lambda r: r(r("chimera", 4), 4, pairs=2), r"options \(pairs=2\) given with a resolved schedule chimera"),
])
def test_bad_input_is_refused_by_name(call, message):
    from twinpipe.schedule import resolve

    with pytest.raises(ValueError, match=message):
        call(resolve)


class _Counting:
    """A user's generator (1F1B) that counts its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, num_ranks, num_microbatches, **options):
        from twinpipe.schedule.one_f_one_b import one_f_one_b

        self.calls.append(num_microbatches)
        return one_f_one_b(num_ranks, num_microbatches, **options)


def test_a_generator_runs_once_to_show_its_placement_and_meets_the_size_limits():
    from twinpipe.schedule import registry, resolve

    gen = _Counting()
    spec = resolve(gen, 2)
    assert spec.kind == "generator" and spec.placement == registry.placement_for("1f1b", 2) and gen.calls == [4]
    assert spec.name == f"{__name__}._Counting" and spec.describe() == spec.name
    assert spec.build(4) is spec.build(4) and gen.calls == [4]  # the probe, reused
    assert spec.build(6) == registry.build("1f1b", 2, 6) and gen.calls == [4, 6]
    with pytest.raises(ValueError, match="num_microbatches=100000"):
        spec.build(10**5)
    assert gen.calls == [4, 6]  # refused before the generator ran
    with pytest.raises(ValueError, match="must return a Schedule"):
        resolve(lambda p, m: None, 2)


def test_ranks_compare_generators_by_name_not_address():
    import functools

    from twinpipe.schedule import registry, resolve
    from twinpipe.schedule.interleaved import interleaved_1f1b

    assert resolve(_Counting(), 2).name == f"{__name__}._Counting"  # a callable object: its class
    spec = resolve(functools.partial(interleaved_1f1b, stages_per_rank=3), 2)
    assert spec.name == "twinpipe.schedule.interleaved.interleaved_1f1b[stages_per_rank=3]"
    assert spec.placement == registry.placement_for("interleaved-1f1b", 2, stages_per_rank=3)


def test_a_fixed_schedule_resolves_to_itself():
    from twinpipe.schedule import registry, resolve

    fixed = registry.build("dualpipev", 2, 4)
    spec = resolve(fixed)
    assert spec.kind == "fixed" and spec.num_ranks == 2 and spec.placement == fixed.placement
    assert spec.build(4) is fixed and spec.name.startswith("fixed schedule #")
    assert resolve(fixed, 2) == spec
    with pytest.raises(ValueError, match="num_chunks=6: must be 4, the fixed schedule's micro-batches"):
        spec.build(6)
    with pytest.raises(ValueError, match="schedule is for 2 ranks but num_ranks=4"):
        resolve(fixed, 4)


def test_layout_and_stage_modules_take_the_spec_and_resolve_nothing_again(monkeypatch):
    from twinpipe.runtime.batches import batch_layout
    from twinpipe.schedule import registry, resolve
    from twinpipe.train.stages import stage_modules

    calls = []
    placement_for = registry.placement_for
    monkeypatch.setattr(registry, "placement_for", lambda *a, **k: calls.append(a) or placement_for(*a, **k))
    spec = resolve("dualpipe", 4)
    stages = [nn.Linear(2, 2) for _ in range(spec.placement.num_model_stages)]
    by_spec = [(batch_layout(spec, 4, r, 8), stage_modules(stages, spec, 4, r)) for r in range(4)]
    assert len(calls) == 1  # the spec's own resolution, and nothing after it
    by_name = [(batch_layout("dualpipe", 4, r, 8), stage_modules(stages, "dualpipe", 4, r)) for r in range(4)]
    assert [layout for layout, _ in by_spec] == [layout for layout, _ in by_name]
    assert [list(map(id, mods)) for _, mods in by_spec] == [list(map(id, mods)) for _, mods in by_name]
    with pytest.raises(ValueError, match="stages: 3 given, but 'dualpipe' on 4 ranks runs a model cut into 4 stages"):
        stage_modules(stages[:3], spec, 4, 0)
    with pytest.raises(ValueError, match="asked for num_ranks=2, num_chunks=6"):
        batch_layout(resolve(registry.build("1f1b", 2, 4)), 2, 0, 6)


# ------------------------------------------------------------------ the Pipeline, on 2 gloo ranks
_CALLS: list[int] = []


def counting_1f1b(num_ranks, num_microbatches, **options):
    """A user's generator function (1F1B) that logs its calls in ``_CALLS``."""
    from twinpipe.schedule.one_f_one_b import one_f_one_b

    _CALLS.append(num_microbatches)
    return one_f_one_b(num_ranks, num_microbatches, **options)


def _steps(group, schedule, chunks_list) -> None:
    import torch.distributed as dist

    import twinpipe

    rank = dist.get_rank(group)
    model = models.make_model(models.MLPStage, 2, seed=7)
    pipe = twinpipe.Pipeline([copy.deepcopy(model[rank])], schedule, process_group=group)
    x = torch.randn(12, 3, models.HIDDEN, dtype=torch.float64)
    for chunks in chunks_list:
        pipe.step(*((x,) if rank == 0 else ()), num_chunks=chunks, criterion=models.mse, labels=(() if rank == 0 else (x,)))


def case_pipeline_resolves_a_generator_once(group):
    _steps(group, counting_1f1b, (4, 4, 6, 6))  # 2p = 4 is the probe's size; 6 is built once (its lowering is cached)
    return list(_CALLS)


def case_pipeline_takes_a_callable_object(group):
    """Ranks agree on a generator object by its class (its repr holds an address, other on each rank)."""
    gen = _Counting()
    _steps(group, gen, (4,))
    return gen.calls


def case_pipeline_takes_a_spec(group):
    """Rank 0 passes a resolved spec, rank 1 the name: they built the same pipeline (no mismatch)."""
    import torch.distributed as dist

    import twinpipe
    from twinpipe.schedule import resolve

    rank = dist.get_rank(group)
    model = models.make_model(models.MLPStage, 4, seed=3)
    mine = [copy.deepcopy(model[s]) for s in resolve("dualpipev", 2).stages_of(rank)]
    schedule = resolve("dualpipev", 2) if rank == 0 else "dualpipev"
    pipe = twinpipe.Pipeline(mine, schedule, process_group=group)
    x, y = torch.randn(8, 3, models.HIDDEN, dtype=torch.float64), torch.randn(8, 3, models.HIDDEN, dtype=torch.float64)
    loss, _ = pipe.step(*((x,) if rank == 0 else ()), num_chunks=4, criterion=models.mse, labels=((y,) if rank == 0 else ()))
    if rank != 0:
        return pipe._identity.split(" pipeline #")[0]
    ref = []
    for xs, ys in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
        out = xs
        for stage in model:
            out = stage(out)
        ref.append(models.mse(out, ys).detach())
    return pipe._identity.split(" pipeline #")[0], torch.equal(loss, torch.stack(ref))


def case_pipeline_refuses_a_spec_for_other_ranks(group):
    import twinpipe
    from twinpipe.schedule import resolve

    try:
        twinpipe.Pipeline([models.MLPStage().double()], resolve("1f1b", 4), process_group=group)
    except ValueError as error:
        return str(error)
    return "built"


CASES = {
    "generator_once": (2, case_pipeline_resolves_a_generator_once),
    "callable_object": (2, case_pipeline_takes_a_callable_object),
    "spec": (2, case_pipeline_takes_a_spec),
    "other_ranks": (2, case_pipeline_refuses_a_spec_for_other_ranks),
}


@pytest.fixture(scope="module")
def out():
    return run_world(2, run_cases, CASES)


def test_a_pipeline_runs_a_generator_once_per_size(out):
    for rank in (0, 1):
        assert out[rank]["generator_once"] == [4, 6], out[rank]["generator_once"]


def test_a_pipeline_takes_a_callable_object(out):
    for rank in (0, 1):
        assert out[rank]["callable_object"] == [4], out[rank]["callable_object"]


def test_a_pipeline_takes_a_resolved_spec(out):
    assert out[0]["spec"] == ("dualpipev", True)
    assert out[1]["spec"] == "dualpipev"


def test_a_pipeline_refuses_a_spec_resolved_for_other_ranks(out):
    for rank in (0, 1):
        assert "num_ranks=2: the schedule 1f1b was resolved for 4 ranks" in out[rank]["other_ranks"], out[rank]["other_ranks"]
