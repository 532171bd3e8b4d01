"""The code reads in a few hops: short functions, constructors with few arguments, a small trainer.

Counted on the source with ``ast`` (nothing is imported or run), over every module under
``src/twinpipe``. A function's length is its lines from ``def`` to its last line, docstring and
comments included.

The constructor rule: a constructor takes at most 6 parameters besides ``self``, keyword-only ones
counted (``*args``/``**kwargs`` are not). A record -- a dataclass or a NamedTuple, whose generated
``__init__`` only stores its fields -- may have more fields only when at most 6 of them can be
passed by position and the rest are keyword-only (``kw_only=True``, a ``KW_ONLY`` marker or
``field(kw_only=True)``), so that every call site names them; a NamedTuple's fields are all
positional, so it has at most 6. Fields with ``init=False`` and ``ClassVar``s are not parameters;
a dataclass's own fields come after those of its dataclass bases (in the same module).
"""

from __future__ import annotations

import ast
import functools
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
# Kept for a reason other than a signature; each goes when its reason does.
EXEMPT = {
}
TRAINER_LINES = 260  # train/trainer.py: the step and what a user calls; the parts live beside it


def _modules(root: Path | None = None) -> list[tuple[str, ast.Module]]:
    return list(_parsed(root or SRC))


@functools.lru_cache(maxsize=None)
def _parsed(root: Path) -> tuple[tuple[str, ast.Module], ...]:
    """Every module under ``root``, parsed once for all the checks of this file (none changes a tree)."""
    files = sorted(root.rglob("*.py"))
    assert files, f"no sources under {root}"
    return tuple((f.relative_to(root).as_posix(), ast.parse(f.read_text(), str(f))) for f in files)


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


def _name(node: ast.expr) -> str:
    """The last name of ``x``, ``a.x`` or ``x(...)``."""
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _true(call: ast.expr, keyword: str) -> bool:
    return isinstance(call, ast.Call) and any(k.arg == keyword and isinstance(k.value, ast.Constant)
                                              and k.value.value is True for k in call.keywords)


def _record_fields(cls: ast.ClassDef) -> tuple[list[str], list[str]] | None:
    """(positional, keyword-only) parameters of a record's generated ``__init__``; None if ``cls``
    is no record (or a dataclass with ``init=False``, whose own ``__init__`` is counted instead)."""
    decorator = next((d for d in cls.decorator_list if _name(d) == "dataclass"), None)
    named_tuple = any(_name(base) == "NamedTuple" for base in cls.bases)
    if decorator is None and not named_tuple:
        return None
    if isinstance(decorator, ast.Call) and any(k.arg == "init" for k in decorator.keywords):
        return None
    positional, keyword = [], []
    keyword_only = _true(decorator, "kw_only")
    for s in cls.body:
        if not (isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)):
            continue
        annotation = ast.unparse(s.annotation)
        if "KW_ONLY" in annotation:
            keyword_only = True
        elif "ClassVar" not in annotation and not (_name(s.value) == "field" and any(
                k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in s.value.keywords)):
            field_kw = s.value is not None and _name(s.value) == "field" and _true(s.value, "kw_only")
            (keyword if keyword_only or field_kw else positional).append(s.target.id)
    return positional, keyword


def _arguments(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return names[1:] if names and names[0] in ("self", "cls") else names


def _long_functions(modules) -> dict[str, int]:
    """``"file:qualified name"`` -> lines, of every function over ``MAX_LINES``."""
    return {f"{file}:{name}": fn.end_lineno - fn.lineno + 1 for file, tree in modules for name, fn in _functions(tree)
            if fn.end_lineno - fn.lineno + 1 > MAX_LINES}


def _wide_constructors(modules) -> dict[str, str]:
    """``"file:Class.__init__"`` (or ``"file:Class"``, a record) -> its parameters, of every
    constructor the rule in this module's docstring refuses."""
    wide = {}
    for file, tree in modules:
        records = {}  # class name -> its (positional, keyword-only) fields, bases' included
        for cls in _classes(tree):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__" and len(_arguments(fn)) > MAX_ARGUMENTS:
                    wide[f"{file}:{cls.name}.__init__"] = ", ".join(_arguments(fn))
            record = _record_fields(cls)
            if record is not None:  # a dataclass's bases in this module come first in its __init__
                bases = [records[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in records]
                record = records[cls.name] = ([n for r in bases for n in r[0]] + record[0], record[1])
            if record is not None and len(record[0]) > MAX_ARGUMENTS:
                wide[f"{file}:{cls.name}"] = ", ".join(record[0]) + " (a record: the fields past the sixth keyword-only)"
        for call in ast.walk(tree):  # namedtuple("Name", "a b c") and NamedTuple("Name", [("a", int), ...])
            if isinstance(call, ast.Call) and _name(call) in ("namedtuple", "NamedTuple") and len(call.args) == 2:
                spec = call.args[1]
                count = (len(spec.value.replace(",", " ").split()) if isinstance(spec, ast.Constant)
                         else len(getattr(spec, "elts", ())))
                if count > MAX_ARGUMENTS:
                    wide[f"{file}:{ast.unparse(call.args[0])}"] = f"{count} fields (a NamedTuple: make it a kw_only dataclass)"
    return wide


def test_no_function_is_over_60_lines():
    long = [f"{key} ({n} lines)" for key, n in _long_functions(_modules()).items() if key not in EXEMPT]
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_no_constructor_takes_more_than_6_arguments():
    allowed = OFFICIAL | set(PUBLIC) | set(EXEMPT)
    wide = [f"{key}({args})" for key, args in _wide_constructors(_modules()).items() if key not in allowed]
    assert not wide, f"constructors with more than {MAX_ARGUMENTS} arguments: {wide}"


def test_every_exemption_is_still_needed():
    """An exemption whose code was fixed goes too: the lists above name only what is still over."""
    modules = _modules()
    over = set(_long_functions(modules)) | set(_wide_constructors(modules))
    stale = sorted((OFFICIAL | set(PUBLIC) | set(EXEMPT)) - over)
    assert not stale, f"exempted but no longer over the limits (remove them from the lists): {stale}"


# Module-level mutable state, each where one value for the whole process is the point; everything
# else a module keeps at its top level is immutable (tuple, frozenset, MappingProxyType, frozen
# records) or lives in an object. Keyed "file:name"; the rule is test_module_level_state_is_listed's.
PROCESS_STATE = {
    "schedule/registry.py:_REGISTRY": "the schedule registry: register() makes a name known to every tool",
    "schedule/registry.py:_ALIASES": "the schedule registry's aliases, added with their names",
    "schedule/deps.py:dependency_table": "a cache of a pure function of an immutable Placement",
    "schedule/vshape_memory.py:_type_needs": "a cache of a pure function of the pipeline size",
    "runtime/comm.py:_SHAPES": "set_p2p_tensor_shapes(): the official DualPipe API declares it process-wide",
    "runtime/comm.py:_DTYPE": "set_p2p_tensor_dtype(): the official DualPipe API declares it process-wide",
    "runtime/weight_grad.py:_PROCESS_STORE": "the store the class-level WeightGradStore API acts on outside a step",
    "runtime/weight_grad.py:_local": "each thread's current store (a step's, while it runs)",
    "runtime/weight_grad.py:_in_backward": "the stores whose backward runs now, for autograd's device threads",
    "runtime/weight_grad.py:_file_or_run_untraced": "the dynamo-excluded wrapper, made once when torch.compile is loaded",
    "runtime/memory.py:_recomputing": "open measuring contexts: torch's checkpoint recomputation hook is process-wide",
    "runtime/memory.py:_recomputing_lock": "guards _recomputing across threads",
    "runtime/observe.py:_local": "each thread's installed step observer",
    "runtime/waits.py:_CURRENT": "the wait context of the running step (a ContextVar)",
    "runtime/pipeline.py:_BY_IDENTITY": "every live pipeline of the process, weakly, for out-of-step marking",
    "runtime/board.py:_BOARDS": "one shared-memory board per process group, for every pipeline on it",
    "runtime/collectives.py:_CPU_GROUPS": "gloo groups shared by the pipelines of one process, counted",
    "runtime/releases.py:EARLY_RELEASE": "the switch bench/bench_memory.py turns one release off with, for all code",
    "overlap/state.py:_STATE": "the overlap engine's side streams (one per device) and the capture in progress",
    "hf/self_check.py:_CACHE": "a model class and configuration checked once per process",
}
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "bytearray", "local",
                  "Lock", "RLock", "ContextVar", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}
_CACHES = {"lru_cache", "cache"}


def _module_state(file: str, tree: ast.Module) -> dict[str, str]:
    """``"file:name"`` -> what it is, of every piece of mutable state ``tree`` keeps at module level:
    a mutable container (a list, dict or set display or comprehension, or a call making one, a
    lock, a thread-local or a context variable) or an instance of a class of the module bound at
    the top level, a name a ``global`` statement rebinds, and a function cached by ``functools``.
    ``__all__`` (a list by the language's convention, never changed) is not counted."""
    own_classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    state = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and (_name(value) in _MUTABLE_CALLS or _name(value) in own_classes))
        for target in targets:
            if mutable and isinstance(target, ast.Name) and target.id != "__all__":
                state[f"{file}:{target.id}"] = f"{type(value).__name__} {ast.unparse(value)[:60]}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(_name(d) in _CACHES for d in node.decorator_list):
            state[f"{file}:{node.name}"] = "a cached function"
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            state.update({f"{file}:{name}": "rebound by a global statement" for name in node.names})
    return state


def test_module_level_state_is_listed():
    """Mutable module-level state only where a process-wide value is the point (``PROCESS_STATE``,
    each with its reason); a constant table is immutable (tuple, frozenset, ``MappingProxyType``)."""
    found = {key: what for file, tree in _modules() for key, what in _module_state(file, tree).items()}
    stray = [f"{key} ({what})" for key, what in found.items() if key not in PROCESS_STATE]
    assert not stray, f"module-level mutable state not in PROCESS_STATE (make it immutable or an object's): {stray}"
    stale = sorted(set(PROCESS_STATE) - set(found))
    assert not stale, f"in PROCESS_STATE but no longer module-level state (remove them): {stale}"


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


_RECORDS = {  # source -> refused by the constructor rule
    "@dataclass\nclass R:\n" + "".join(f"    f{i}: int\n" for i in range(7)): True,
    "@dataclass(frozen=True)\nclass R:\n" + "".join(f"    f{i}: int = 0\n" for i in range(7)): True,
    "class R(NamedTuple):\n" + "".join(f"    f{i}: int\n" for i in range(7)): True,
    "R = namedtuple('R', 'a b c d e f g')\n": True,
    "@dataclass\nclass R:\n" + "".join(f"    f{i}: int\n" for i in range(7)) + "    _: KW_ONLY\n    g: int\n": True,
    "@dataclass(kw_only=True)\nclass R:\n" + "".join(f"    f{i}: int\n" for i in range(12)): False,
    "@dataclass\nclass R:\n" + "".join(f"    f{i}: int\n" for i in range(6)) + "    _: KW_ONLY\n    g: int\n    h: int\n": False,
    "@dataclass\nclass R:\n" + "".join(f"    f{i}: int\n" for i in range(6))
    + "    g: int = field(kw_only=True)\n    h: ClassVar[int] = 0\n    i: int = field(init=False)\n": False,
    "class R(NamedTuple):\n" + "".join(f"    f{i}: int\n" for i in range(6)): False,
    "@dataclass\nclass Base:\n" + "".join(f"    b{i}: int\n" for i in range(4))
    + "\n\n@dataclass\nclass R(Base):\n" + "".join(f"    f{i}: int\n" for i in range(3)): True,
}


@pytest.mark.parametrize("source, refused", list(_RECORDS.items()))
def test_the_constructor_rule_counts_records(source, refused):
    """Records with more than 6 positional fields are refused; keyword-only fields past the sixth,
    ``ClassVar``s and ``init=False`` fields are not counted."""
    assert bool(_wide_constructors([("r.py", ast.parse(source))])) is refused


_STATES = {  # source -> the names the module-state rule counts
    "_SEEN = {}\n\n\ndef see(x):\n    _SEEN[x] = True\n": ["_SEEN"],
    "_SEEN: set = set()\n_ORDER = [1, 2]\n": ["_SEEN", "_ORDER"],
    "class _Box:\n    pass\n\n\n_BOX = _Box()\n": ["_BOX"],
    "_N = 0\n\n\ndef bump():\n    global _N\n    _N += 1\n": ["_N"],
    "import functools\n\n\n@functools.lru_cache(maxsize=8)\ndef table(p):\n    return p\n": ["table"],
    "from types import MappingProxyType\n\n__all__ = ['T']\nT = MappingProxyType({'a': 1})\nS = frozenset({1})\nL = (1,)\n": [],
}


@pytest.mark.parametrize("source, names", list(_STATES.items()))
def test_the_module_state_rule_counts(source, names):
    """Mutable containers, a module's own singleton, ``global`` and caches are counted; immutable
    tables and ``__all__`` are not."""
    assert sorted(_module_state("m.py", ast.parse(source))) == sorted(f"m.py:{name}" for name in names)


def test_a_stray_module_level_dict_fails_the_rule(monkeypatch, tmp_path):
    (tmp_path / "cache.py").write_text("_SEEN = {}\n\n\ndef remember(key, value):\n    _SEEN[key] = value\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    monkeypatch.setitem(globals(), "PROCESS_STATE", {})
    with pytest.raises(AssertionError, match="cache.py:_SEEN"):
        test_module_level_state_is_listed()


def test_the_architecture_page_states_these_rules():
    """docs/architecture.md's "Size and state" paragraph gives the limits this module holds and
    names the lists where exceptions are kept."""
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    section = text.split("## Size and state", 1)[1].split("\n## ", 1)[0]
    stated = " ".join(section.split())
    assert f"over {MAX_LINES} lines" in stated and f"more than {MAX_ARGUMENTS} parameters" in stated
    assert f"at most {MAX_ARGUMENTS} are positional" in stated
    assert all(f"`{name}`" in section for name in ("PUBLIC", "EXEMPT", "PROCESS_STATE"))
    named = {"schedule/registry.py:_REGISTRY", "runtime/comm.py:_SHAPES", "runtime/weight_grad.py:_PROCESS_STORE",
             "runtime/weight_grad.py:_local", "runtime/board.py:_BOARDS"}  # the examples the paragraph gives
    assert named <= set(PROCESS_STATE)
    examples = {"CostModel": "schedule/costs.py", "ScheduleSpec": "schedule/spec.py"}
    modules = dict(_modules(SRC / "schedule"))
    for cls, file in examples.items():  # the examples shown are the records as they are
        node = next(c for c in _classes(modules[file.removeprefix("schedule/")]) if c.name == cls)
        positional, keyword = _record_fields(node)
        shown = section.split(f"`{cls}(", 1)[1].split("*", 1)[0]
        assert [n.strip() for n in shown.split(",") if n.strip()] == positional, (cls, positional)
