"""twinpipe's layers, written down once (``LAYERS``), and the import graph of ``src/twinpipe`` held to
them: every import between top-level packages/modules points down the table, and no two packages
import each other through any chain. Also counted on the tree: one Chrome-trace writer, and the
overlap package's module-level state in one module.

The graph is read from the source (every ``import`` and ``from ... import``, at module level or
inside functions), not from what happens to be imported at run time.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "twinpipe"

# Bottom first. A node may import only nodes above it in this list (lower layers); each line says
# what the layer is. ``__init__`` is the package's public face (``import twinpipe``), which
# re-exports from the library layers; ``twinpipe.__version__`` is metadata any layer may read.
LAYERS = [
    ("checks", "argument validators and the one timeout default (pure Python)"),
    ("cli_options", "the command line's one vocabulary: each shared option spelled once (pure Python)"),
    ("folders", "the folder a command writes into, and the files a folder's own index names, checked (pure Python)"),
    ("precisions", "training precisions by name, and the model dtype each needs (pure Python)"),
    ("schedule", "schedules as data: ops, placements, generators, lowering, the dependency rule (pure Python)"),
    ("timeline", "what a run or a simulation did: slices per rank (pure Python)"),
    ("sim", "the simulator: costs -> Timeline (pure Python)"),
    ("viz", "drawing timelines (matplotlib)"),
    ("runtime", "the executor on torch.distributed: Pipeline, DualPipe(V), comm, waits, weight-gradient store"),
    ("launch", "starting N local ranks"),
    ("utils", "dualpipe.utils' names, for migrating"),
    ("trace", "recording real runs, the one Chrome-trace writer, measured vs predicted"),
    ("overlap", "part-level F&B overlap engine"),
    ("moe", "MoE blocks with expert parallelism"),
    ("eplb", "expert placement and the live balancer (uses moe)"),
    ("train", "the trainer and its model description (GPTConfig)"),
    ("hf", "Hugging Face transformers causal LMs: stages for any schedule, expert parallelism, checkpoint weights (uses train; transformers imported lazily)"),
    ("plan", "the planner (pure Python; reads a GPTConfig without importing it)"),
    ("train_command", "the twinpipe train and check commands: their options, --model and --data checked before any rank starts (uses train and hf)"),
    ("__init__", "the public face: import twinpipe"),
    ("demo", "the demos twinpipe demo runs"),
    ("cli", "the twinpipe command"),
    ("__main__", "python -m twinpipe"),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
VERSION = "__version__"  # twinpipe.__version__: package metadata, readable from any layer


def _node(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    if rel[-1] == "__main__.py":  # ``python -m twinpipe.<package>``: an entry point, at the top like ``python -m twinpipe``
        return "__main__"
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def _top_level_names() -> set[str]:
    return {p.stem if p.is_file() else p.name for p in SRC.iterdir()
            if (p.is_file() and p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists())}


def _targets(path: Path, tree: ast.AST, names: set[str]) -> list[tuple[str, int]]:
    """(node, line) for every twinpipe import in ``tree``."""
    package = ".".join(("twinpipe", *path.relative_to(SRC).parts[:-1]))
    root_uses = {n.attr for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "twinpipe"}
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for alias in n.names:
                parts = alias.name.split(".")
                if parts[0] != "twinpipe":
                    continue
                if len(parts) > 1:
                    found.append((parts[1], n.lineno))
                else:  # import twinpipe: the facade, unless only its version is read
                    found.append((VERSION if root_uses <= {VERSION} else "__init__", n.lineno))
        elif isinstance(n, ast.ImportFrom):
            if n.level:  # relative: resolve against this file's package
                base = package.split(".")[: len(package.split(".")) - (n.level - 1)]
                module = ".".join(base + ([n.module] if n.module else []))
            else:
                module = n.module or ""
            parts = module.split(".")
            if parts[0] != "twinpipe":
                continue
            if len(parts) > 1:
                found.append((parts[1], n.lineno))
                continue
            for alias in n.names:  # from twinpipe import X: a submodule, the version, or the facade
                found.append((alias.name if alias.name in names else VERSION if alias.name == VERSION else "__init__", n.lineno))
    if any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(tree)):
        # A module imported by name (importlib.import_module): every "twinpipe.<package>" string it spells counts.
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                parts = n.value.split(".")
                if parts[0] == "twinpipe" and len(parts) > 1 and parts[1] in names:
                    found.append((parts[1], n.lineno))
    return found


def import_graph() -> dict[str, dict[str, list[str]]]:
    """node -> imported node -> ["file:line", ...] (imports inside one node left out)."""
    names = _top_level_names()
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(SRC.rglob("*.py")):
        source = _node(path)
        for target, line in _targets(path, ast.parse(path.read_text()), names):
            if target != source:
                graph[source][target].append(f"{path.relative_to(SRC)}:{line}")
    return graph


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(set(graph) | {w for targets in graph.values() for w in targets}):
        if v not in index:
            visit(v)
    return out


def test_every_package_has_a_place_in_the_table():
    assert _top_level_names() | {"__init__"} == set(RANK), "add the new package to LAYERS (or remove the stale entry)"


def test_imports_point_down_the_layers():
    upward = [f"{source} -> {target} ({', '.join(where)})"
              for source, targets in import_graph().items() for target, where in targets.items()
              if target != VERSION and RANK[target] >= RANK[source]]
    assert not upward, "imports that point up the layers (see LAYERS):\n" + "\n".join(upward)


def test_no_packages_import_each_other():
    graph = {s: {t for t in targets if t != VERSION} for s, targets in import_graph().items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_one_chrome_trace_writer():
    # Trace events are made in one module; everyone else calls it (reading a trace is fine).
    makers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                    if any(key in p.read_text() for key in ('"traceEvents":', '"ph": "X"', '"ph": "M"')))
    assert makers == ["trace/chrome.py"], makers


def test_overlap_keeps_its_module_level_state_in_one_module():
    # No `global` statement and no module-level dict/list/set in overlap/ outside state.py, but for
    # constants (UPPER_CASE names, never changed) and __all__.
    found = []
    for path in sorted((SRC / "overlap").glob("*.py")):
        if path.name == "state.py":
            continue
        tree = ast.parse(path.read_text())
        found += [f"{path.name}:{n.lineno} global" for n in ast.walk(tree) if isinstance(n, ast.Global)]
        for n in tree.body:
            value = n.value if isinstance(n, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
                    isinstance(value, ast.Call) and getattr(value.func, "id", "") in {"dict", "list", "set"}):
                target = n.targets[0] if isinstance(n, ast.Assign) else n.target
                name = getattr(target, "id", "?")
                if name != "__all__" and not name.lstrip("_").isupper():
                    found.append(f"{path.name}:{n.lineno} {name}")
    assert not found, found


def test_the_architecture_page_lists_the_layers_and_the_rules_where_they_live():
    """docs/architecture.md shows ``LAYERS`` in order, and every module its rules table names exists."""
    import re

    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    layers_part = text.split("## The layers", 1)[1].split("## Where each rule lives", 1)[0]
    shown = re.findall(r"^\| `([\w_]+)` \|", layers_part, re.M)
    assert shown == [name for name, _ in LAYERS], shown
    rules_part = text.split("## Where each rule lives", 1)[1].split("## One", 1)[0]
    modules = [m for row in re.findall(r"^\|[^|]+\| (.+) \|$", rules_part, re.M) for m in re.findall(r"`([\w/]+\.py)`", row)]
    assert len(modules) >= 15
    missing = [m for m in modules if not (SRC / m).exists()]
    assert not missing, missing


def _module_name(path: Path) -> str:
    parts = ("twinpipe", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph() -> dict[str, dict[str, list[int]]]:
    """module -> imported twinpipe module -> [line, ...], for every file in ``src/twinpipe``.

    Every ``import``/``from ... import`` counts, at module level or inside a function. ``from a
    import b`` is an edge to ``a.b`` when that is a module, else to ``a``; relative imports are
    resolved against the file's package.
    """
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name]  # every module is a node, even one that imports nothing
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - n.level + 1] if n.level else []
                module = ".".join(base + ([n.module] if n.module else []))
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in n.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # import a.b.c where c is a name: a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name][target].append(n.lineno)
    return graph


def test_no_modules_import_each_other():
    """No chain of imports (module level or inside functions) leads from a file back to itself."""
    graph = module_graph()
    found = cycles(graph)
    shown = []
    for component in found:
        members = set(component)
        edges = [f"{s} -> {t} (line {graph[s][t][0]})" for s in component for t in sorted(graph[s]) if t in members]
        shown.append(f"{', '.join(component)}:\n    " + "\n    ".join(edges))
    assert not found, f"{len(found)} circle(s) of imports between files:\n" + "\n".join(shown)


def test_the_module_graph_sees_function_level_and_relative_imports(monkeypatch, tmp_path):
    """A circle made of a function-level relative import and a module-level absolute one is found."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from .b import g\n")
    (tmp_path / "pkg" / "b.py").write_text("from twinpipe.pkg.a import f\ng = 1\n")
    (tmp_path / "pkg" / "c.py").write_text("from . import a\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    graph = module_graph()
    assert dict(graph["twinpipe.pkg.c"]) == {"twinpipe.pkg.a": [1]}
    assert cycles(graph) == [["twinpipe.pkg.a", "twinpipe.pkg.b"]]


# Names with one home: each is spelled as a string in code (docstrings and comments aside) in its
# home module only; everyone else imports the constant.
SPELLED_ONCE = {"pure": "precisions.py", "bf16-mixed": "precisions.py"}
SPELLED_ALSO: dict[str, set[str]] = {}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def test_precision_names_are_spelled_once():
    where = defaultdict(set)
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and n.value in SPELLED_ONCE and id(n) not in skip:
                where[n.value].add(str(path.relative_to(SRC)))
    spelled = {name: sorted(files - SPELLED_ALSO.get(name, set())) for name, files in where.items()}
    assert spelled == {name: [home] for name, home in SPELLED_ONCE.items()}, spelled
