"""The code reads in a few hops: short functions, constructors with few arguments, a small trainer.

Counted on the source with ``ast`` (nothing is imported or run), over every module under
``src/twinpipe``. A function's length is its lines from ``def`` to its last line, docstring and
comments included. A constructor's arguments are its named parameters besides ``self`` (positional
and keyword-only; ``*args``/``**kwargs`` not counted); a dataclass's are its fields, and one with
more than the limit must be ``kw_only``, so that every call site names each field.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "twinpipe"
MAX_LINES = 60
MAX_ARGUMENTS = 6
# The official API (DualPipe-compatible ``Pipeline(modules, schedule, batch_dim, process_group,
# rank_mapping, *, ...)``): its signature is the user's, not the runtime's wiring.
OFFICIAL = {"runtime/pipeline.py:Pipeline.__init__"}
# Public signatures users call as they are, kept: ``Trainer(model_fn, sampler, criterion,
# optimizer_fn, mesh, config, *, device, dtype, stages)`` (docs/train.md, bench/, the tests)
# and its single-process twin ``ReferenceTrainer``, which takes the same arguments (the mesh's sizes
# for the mesh).
PUBLIC = {
    "train/trainer.py:Trainer.__init__": "the documented Trainer(...) signature",
    "train/reference.py:ReferenceTrainer.__init__": "Trainer's twin, called alike by the exactness tests",
    "moe/block.py:MoEBlock.__init__": "the documented MoEBlock(...) keywords (docs/moe-overlap.md), in users' models",
    "moe/router.py:TopKRouter.__init__": "the documented router keywords, which MoEBlock passes on",
    "eplb/balancer.py:Balancer.__init__": "the documented Balancer(...) signature (docs/eplb.md)",
    "hf/training.py:HFSource.__init__": "the documented HFSource(...) keywords (docs/train.md)",
}
# Kept for a reason other than a signature: the simulator's event loop reads locals, not attributes,
# for its speed over millions of ops (bench/bench_sim.py); records (dataclasses, named tuples) of more
# than 6 fields built by keyword in this code but positionally in users' code or older checkpoints'
# readers are not made keyword-only.
EXEMPT = {
    "eplb/report.py:BalanceReport",
    "hf/stages.py:HFRankStages", "hf/support.py:ModelParts", "moe/exchange.py:_Route",
    "schedule/costs.py:CostModel", "schedule/registry.py:ScheduleInfo", "schedule/spec.py:ScheduleSpec",
    "sim/gpt.py:GPTRun", "sim/memory.py:StageMemory", "viz/cells.py:Cells",
    "plan/costs.py:LayerTimes", "plan/measured.py:Traced", "plan/predict.py:Prediction", "plan/spec.py:Model",
    "plan/spec.py:Cluster",
    "timeline.py:Timeline", "cli_options.py:Option",
}
TRAINER_LINES = 260  # train/trainer.py: the step and what a user calls; the parts live beside it


def _modules(root: Path | None = None) -> list[tuple[str, ast.Module]]:
    root = root or SRC
    files = sorted(root.rglob("*.py"))
    assert files, f"no sources under {root}"
    return [(f.relative_to(root).as_posix(), ast.parse(f.read_text(), str(f))) for f in files]


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def _classes(tree: ast.AST):
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def _dataclass(node: ast.ClassDef) -> ast.expr | None:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return d
    return None


def _keyword_only(decorator: ast.expr) -> bool:
    return isinstance(decorator, ast.Call) and any(
        k.arg == "kw_only" and isinstance(k.value, ast.Constant) and k.value.value is True for k in decorator.keywords
    )


def _arguments(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return names[1:] if names and names[0] in ("self", "cls") else names


def _long_functions(modules) -> dict[str, int]:
    """``"file:qualified name"`` -> lines, of every function over ``MAX_LINES``."""
    return {f"{file}:{name}": fn.end_lineno - fn.lineno + 1 for file, tree in modules for name, fn in _functions(tree)
            if fn.end_lineno - fn.lineno + 1 > MAX_LINES}


def _wide_constructors(modules) -> dict[str, str]:
    """``"file:Class.__init__"`` (or ``"file:Class"``, a dataclass not ``kw_only``) -> its arguments,
    of every constructor over ``MAX_ARGUMENTS``."""
    wide = {}
    for file, tree in modules:
        for cls in _classes(tree):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__" and len(_arguments(fn)) > MAX_ARGUMENTS:
                    wide[f"{file}:{cls.name}.__init__"] = ", ".join(_arguments(fn))
            decorator = _dataclass(cls)
            if decorator is not None and not _keyword_only(decorator):
                fields = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                if len(fields) > MAX_ARGUMENTS:
                    wide[f"{file}:{cls.name}"] = ", ".join(fields) + " (a dataclass: make it kw_only)"
    return wide


def test_no_function_is_over_60_lines():
    long = [f"{key} ({n} lines)" for key, n in _long_functions(_modules()).items() if key not in EXEMPT]
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_no_constructor_takes_more_than_6_arguments():
    allowed = OFFICIAL | set(PUBLIC) | EXEMPT
    wide = [f"{key}({args})" for key, args in _wide_constructors(_modules()).items() if key not in allowed]
    assert not wide, f"constructors with more than {MAX_ARGUMENTS} arguments: {wide}"


def test_every_exemption_is_still_needed():
    """An exemption whose code was fixed goes too: the lists above name only what is still over."""
    modules = _modules()
    over = set(_long_functions(modules)) | set(_wide_constructors(modules))
    stale = sorted((OFFICIAL | set(PUBLIC) | EXEMPT) - over)
    assert not stale, f"exempted but no longer over the limits (remove them from the lists): {stale}"


def test_the_trainer_stays_small():
    """``Trainer`` keeps the step's call and what a user calls; its parts (train/step.py,
    ownership.py, routing.py, ...) each live in their own module."""
    lines = len((SRC / "train" / "trainer.py").read_text().splitlines())
    assert lines <= TRAINER_LINES, f"train/trainer.py: {lines} lines, more than {TRAINER_LINES}"


# The trainer, its step, its stage source and its checkpoints meet through declared interfaces
# (StageSource, StepParts, CheckpointView), never by asking an object what it has.
PROBE_FREE = ("train/trainer.py", "train/step.py", "train/stage_source.py", "train/checkpoint.py", "train/checkpoint_view.py")


def _probes(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id in ("hasattr", "getattr")]


def test_no_hasattr_or_getattr_probes_between_the_trainer_and_its_parts():
    modules = dict(_modules())
    found = [f"{file}:{call.lineno}" for file in PROBE_FREE if file in modules for call in _probes(modules[file])]
    # and no module probes a trainer it is given (train/memory.py reads Trainer's declared members)
    found += [f"{file}:{call.lineno}" for file, tree in modules.items() for call in _probes(tree)
              if call.args and isinstance(call.args[0], ast.Name) and call.args[0].id == "trainer"]
    assert not found, f"hasattr/getattr probes: {found}"


def test_the_official_pipeline_signature_is_kept():
    """The exemption above covers exactly the user's API, unchanged."""
    tree = dict(_modules())["runtime/pipeline.py"]
    init = next(fn for name, fn in _functions(tree) if name == "Pipeline.__init__")
    a = init.args
    assert [x.arg for x in a.args] == ["self", "modules", "schedule", "batch_dim", "process_group", "rank_mapping"]
    assert [x.arg for x in a.kwonlyargs] == ["tensor_shapes", "tensor_dtype", "dynamic_shapes", "timeout", "transport"]
    assert a.kwarg is not None and a.kwarg.arg == "schedule_options"


@pytest.mark.parametrize("checker", [test_no_function_is_over_60_lines, test_no_constructor_takes_more_than_6_arguments,
                                     test_the_trainer_stays_small, test_no_hasattr_or_getattr_probes_between_the_trainer_and_its_parts])
def test_the_checks_see_what_they_count(checker, monkeypatch, tmp_path):
    """Each check fails on a tree with one long function, one wide constructor, a long trainer
    probing its stages."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "wide.py").write_text(
        f"def long():\n{body}\n\n\nclass Wide:\n    def __init__(self, a, b, c, d, e, f, *, g):\n        pass\n"
    )
    (tmp_path / "train").mkdir()
    for file in PROBE_FREE:
        (tmp_path / file).write_text("x = 1\n")
    (tmp_path / "train" / "trainer.py").write_text("probe = hasattr(object, 'build')\n" * (TRAINER_LINES + 1))
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    with pytest.raises(AssertionError):
        checker()


def test_the_architecture_page_names_the_trainers_parts_as_they_are():
    """docs/architecture.md's trainer section: every file it names exists, and every private function
    or ``Class.method`` it names in backticks is defined in those files."""
    import re

    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    section = text.split("## The trainer's parts", 1)[1].split("\n## ", 1)[0]
    files = sorted(set(re.findall(r"\b((?:[a-z_]+/)+[a-z_]+\.py)\b", section)))
    assert len(files) >= 15, files
    assert not [f for f in files if not (SRC / f).exists()], "missing: " + str([f for f in files if not (SRC / f).exists()])
    modules = dict(_modules())
    defined = {name for f in files for name, _ in _functions(modules[f])}
    classes = {c.name for f in files for c in _classes(modules[f])}
    named = re.findall(r"`([A-Za-z_]\w*(?:\.\w+)?)`", section)
    bare = {name.rsplit(".", 1)[-1] for name in defined} | classes
    wrong = [n for n in named if (n.startswith("_") and "." not in n and n not in bare)
             or ("." in n and n.split(".")[0] in classes and n not in defined)]
    assert not wrong, f"named in docs/architecture.md but not defined there: {wrong}"
