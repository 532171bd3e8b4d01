"""The runtime's core reads in a few hops: short functions, constructors with few arguments.

Counted on the source with ``ast`` (nothing is imported or run). A function's length is its lines
from ``def`` to its last line, docstring and comments included. A constructor's arguments are its
named parameters besides ``self`` (positional and keyword-only; ``*args``/``**kwargs`` not
counted); a dataclass's are its fields, and one with more than the limit must be ``kw_only``, so
that every call site names each field.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parent.parent / "src" / "twinpipe" / "runtime"
MAX_LINES = 60
MAX_ARGUMENTS = 6
# The official API (DualPipe-compatible ``Pipeline(modules, schedule, batch_dim, process_group,
# rank_mapping, *, ...)``): its signature is the user's, not the runtime's wiring.
OFFICIAL = {"pipeline.py:Pipeline.__init__"}


def _modules() -> list[tuple[str, ast.Module]]:
    files = sorted(RUNTIME.glob("*.py"))
    assert files, f"no runtime sources under {RUNTIME}"
    return [(f.name, ast.parse(f.read_text(), str(f))) for f in files]


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


def test_no_function_in_runtime_is_over_60_lines():
    long = [
        f"{file}:{name} ({fn.end_lineno - fn.lineno + 1} lines)"
        for file, tree in _modules()
        for name, fn in _functions(tree)
        if fn.end_lineno - fn.lineno + 1 > MAX_LINES
    ]
    assert not long, f"functions in runtime/ over {MAX_LINES} lines: {long}"


def test_no_constructor_in_runtime_takes_more_than_6_arguments():
    wide = []
    for file, tree in _modules():
        for cls in _classes(tree):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__" and f"{file}:{cls.name}.__init__" not in OFFICIAL:
                    args = _arguments(fn)
                    if len(args) > MAX_ARGUMENTS:
                        wide.append(f"{file}:{cls.name}({', '.join(args)})")
            decorator = _dataclass(cls)
            if decorator is not None and not _keyword_only(decorator):
                fields = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                if len(fields) > MAX_ARGUMENTS:
                    wide.append(f"{file}:{cls.name}({', '.join(fields)}) (a dataclass: make it kw_only)")
    assert not wide, f"constructors in runtime/ with more than {MAX_ARGUMENTS} arguments: {wide}"


def test_the_official_pipeline_signature_is_kept():
    """The exemption above covers exactly the user's API, unchanged."""
    tree = dict(_modules())["pipeline.py"]
    init = next(fn for name, fn in _functions(tree) if name == "Pipeline.__init__")
    a = init.args
    assert [x.arg for x in a.args] == ["self", "modules", "schedule", "batch_dim", "process_group", "rank_mapping"]
    assert [x.arg for x in a.kwonlyargs] == ["tensor_shapes", "tensor_dtype", "dynamic_shapes", "timeout", "transport"]
    assert a.kwarg is not None and a.kwarg.arg == "schedule_options"


@pytest.mark.parametrize("checker", [test_no_function_in_runtime_is_over_60_lines,
                                     test_no_constructor_in_runtime_takes_more_than_6_arguments])
def test_the_checks_see_what_they_count(checker, monkeypatch, tmp_path):
    """Each check fails on a runtime with one long function and one wide constructor."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "wide.py").write_text(
        f"def long():\n{body}\n\n\nclass Wide:\n    def __init__(self, a, b, c, d, e, f, *, g):\n        pass\n"
    )
    monkeypatch.setitem(globals(), "RUNTIME", tmp_path)
    with pytest.raises(AssertionError):
        checker()
