"""The cost of an op is written in one place, ``schedule/costs.py``: no other module under src/
spells the memory rule (what F, B, W and BW do to the activations a rank holds) or the time of a
full backward or of an F&B pair. A new copy of a rule fails here, naming the file and the line."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "twinpipe"
HOME = SRC / "schedule" / "costs.py"

B_TIMES = {"t_b", "b"}  # an input-gradient time
W_TIMES = {"t_w", "w"}  # a weight-gradient time
F_TIMES = {"t_f", "f"}
BW_TIMES = {"t_bw"}


_CONVERSIONS = {"float", "int", "abs"}  # calls whose argument is still the operand


def _names(node: ast.AST) -> set[str]:
    """Identifiers an expression computes with: names, attributes and string keys (``per["t_b"]``);
    not the arguments of a call (``memory_delta(kind, 1.0, mw)`` uses the rule) nor f-strings."""
    out = set()
    todo = [node]
    while todo:
        sub = todo.pop()
        if isinstance(sub, ast.JoinedStr) or (isinstance(sub, ast.Call) and not (isinstance(sub.func, ast.Name) and sub.func.id in _CONVERSIONS)):
            continue
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
        elif isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) and isinstance(sub.slice.value, str):
            out.add(sub.slice.value)
        todo.extend(ast.iter_child_nodes(sub))
    return out


def _addends(node: ast.BinOp) -> list[ast.AST]:
    """The operands of a chain of additions ``a + b + c``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _addends(node.left) + _addends(node.right)
    return [node]


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def say(node: ast.AST, what: str) -> None:
        found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {what}: {ast.unparse(node)}")

    for node in ast.walk(tree):
        if isinstance(node, (ast.BinOp, ast.UnaryOp)) and "mw" in _names(node):
            say(node, "arithmetic on M_W/M_B (memory_delta's rule)")
        elif isinstance(node, ast.AugAssign) and ("mw" in _names(node.value) or (
                "m_b" in _names(node.value) and any("mem" in name for name in _names(node.target)))):
            say(node, "memory changed by M_B or M_W directly (memory_delta's rule)")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            terms = [_names(term) for term in _addends(node)]
            has = lambda group: any(term & group for term in terms)  # noqa: E731
            if has(B_TIMES) and has(W_TIMES):
                say(node, "a full backward's time (full_backward_time's rule)")
            elif (has(F_TIMES) and has(BW_TIMES)) or has({"t_fb"}):
                say(node, "an F&B pair's time (pair_time's rule)")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p != HOME)


def test_one_module_spells_op_costs():
    found = [v for path in _modules() for v in _violations(path)]
    assert not found, "op costs spelled outside schedule/costs.py:\n" + "\n".join(found)


def test_the_checks_see_the_rules_where_they_live():
    """The checks are not blind: in the home of the rules they find each of them."""
    found = "\n".join(_violations(HOME))
    for what in ("memory_delta's rule", "full_backward_time's rule", "pair_time's rule"):
        assert what in found
