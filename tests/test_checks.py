"""twinpipe.checks: one phrasing for bad arguments (``name=value: must be ...``), used everywhere.

The validators' messages are pinned here; an AST scan of src/twinpipe keeps the hand-written
int/bool checks they replaced from coming back (the one timeout default: tests/test_waits.py).
"""

from __future__ import annotations

import ast
from functools import partial
from pathlib import Path

import pytest

from twinpipe.checks import bad, check_bool, check_choice, check_float, check_int, check_ints, checked_timeout

SRC = Path(__file__).resolve().parents[1] / "src" / "twinpipe"


class Refused(ValueError):
    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


PHRASES = [
    (lambda: check_int(0, "num_ranks", low=1), "num_ranks=0: must be >= 1"),
    (lambda: check_int(True, "num_ranks", low=1), "num_ranks=True: must be an int >= 1"),
    (lambda: check_int(2.0, "n"), "n=2.0: must be an int"),
    (lambda: check_int("3", "--pp", low=1, high=8), "--pp='3': must be an int >= 1 and <= 8"),
    (lambda: check_int(9, "rank", low=0, high=7), "rank=9: must be >= 0 and <= 7"),
    (lambda: check_int(3, "chimera: num_ranks", low=2, multiple_of=2), "chimera: num_ranks=3: must be >= 2 and even"),
    (lambda: check_int(6, "m", low=4, multiple_of=4), "m=6: must be >= 4 and a multiple of 4"),
    (lambda: check_int(0, "window", low=1, why="steps"), "window=0: must be >= 1 (steps)"),
    (lambda: check_ints([1, 0], "balance", low=1), "balance=[1, 0]: must be a non-empty sequence of ints >= 1"),
    (lambda: check_ints((1, 2), "sizes", length=3), "sizes=(1, 2): must be 3 ints"),
    (lambda: check_ints("12", "sizes"), "sizes='12': must be a non-empty sequence of ints"),
    (lambda: check_ints([True], "sizes", length=1), "sizes=[True]: must be 1 int"),
    (lambda: check_float(-1, "t_f", low=0), "t_f=-1: must be a finite number >= 0"),
    (lambda: check_float(float("nan"), "--lr", low=0, low_open=True), "--lr=nan: must be a finite number > 0"),
    (lambda: check_float(True, "x"), "x=True: must be a finite number"),
    (lambda: check_float(10**400, "x"), f"x={10**400}: must be a finite number"),
    (lambda: check_float(3, "efficiency", low=0, low_open=True, high=1), "efficiency=3: must be a finite number > 0 and <= 1"),
    (lambda: check_choice("sum", "dp_reduce", ("all-reduce", "ordered")), "dp_reduce='sum': allowed are 'all-reduce', 'ordered'"),
    (lambda: check_bool(1, "overlap_dp"), "overlap_dp=1: must be True or False"),
    (lambda: checked_timeout(0), "timeout=0: must be a finite number >= 0.001 and <= 2.592e+06"),
]


@pytest.mark.parametrize("call, message", PHRASES, ids=[str(i) for i in range(len(PHRASES))])
def test_one_phrasing(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert str(error.value) == message and type(error.value) is ValueError


def test_values_that_pass_come_back_checked():
    assert check_int(4, "n", low=1, high=4, multiple_of=2) == 4
    assert check_ints([1, 2], "b", low=1, length=2) == (1, 2)
    assert check_float(2, "x", low=0) == 2.0 and type(check_float(2, "x")) is float
    assert checked_timeout(5) == 5.0 and check_choice("a", "c", "ab") == "a" and check_bool(False, "b") is False


def test_an_error_class_of_its_own_keeps_the_phrasing():
    # A module whose errors have their own class (eplb's EplbArgumentError) passes a factory.
    error = partial(Refused, "num_gpus")
    for call in (lambda: check_int(0, "num_gpus", low=1, error=error), lambda: check_float(-1.0, "num_gpus", low=0, error=error),
                 lambda: check_ints([], "num_gpus", error=error), lambda: check_choice(3, "num_gpus", (1, 2), error=error),
                 lambda: check_bool(3, "num_gpus", error=error)):
        with pytest.raises(Refused) as caught:
            call()
        assert caught.value.argument == "num_gpus" and str(caught.value).startswith("num_gpus=")
    assert isinstance(bad("x", 1, "must be 2", error), Refused)


def test_eplb_errors_keep_their_class_and_speak_the_phrasing():
    from twinpipe.eplb import EplbArgumentError
    from twinpipe.eplb.checks import check_count, check_layout

    with pytest.raises(EplbArgumentError) as caught:
        check_count("num_gpus", True)
    assert caught.value.argument == "num_gpus" and str(caught.value) == "num_gpus=True: must be an int >= 1"
    with pytest.raises(EplbArgumentError) as caught:
        check_layout(4, 15, 2, 1, 8)
    assert caught.value.argument == "num_replicas" and str(caught.value).startswith("num_replicas=15: must be a multiple of num_gpus=8")


# --- the tree: no hand-written int/bool checks outside twinpipe.checks -------------------------

def _isinstance_of(node: ast.AST, *names: str):
    """The checked expression of ``isinstance(x, T)`` when T (or a member of a tuple T) is one of ``names``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" and len(node.args) == 2):
        return None
    kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
    return ast.dump(node.args[0]) if any(isinstance(k, ast.Name) and k.id in names for k in kinds) else None


def _raises_value_error(body) -> bool:
    for node in body:
        if isinstance(node, ast.Raise) and node.exc is not None:
            call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(call, ast.Name) and call.id == "ValueError":
                return True
    return False


def inline_checks(source: str) -> list[int]:
    """Lines of ``source`` that check an argument's type by hand: a condition testing one value for
    both ``bool`` and ``int`` (the "a bool is not a count" idiom), or an ``if not isinstance(x, int
    or float) ...: raise ValueError(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BoolOp):
            parts = [n for v in node.values for n in ast.walk(v)]
            bools = {_isinstance_of(n, "bool") for n in parts} - {None}
            ints = {_isinstance_of(n, "int") for n in parts} - {None}
            if bools & ints:
                found.append(node.lineno)
        if isinstance(node, ast.If) and _raises_value_error(node.body):
            negated = [n.operand for n in ast.walk(node.test) if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not)]
            if any(_isinstance_of(n, "int", "float") for n in negated):
                found.append(node.lineno)
    return sorted(set(found))


def test_the_scan_sees_every_old_phrasing():
    old = [
        "if isinstance(n, bool) or not isinstance(n, int) or n < 1:\n    raise ValueError('n')",
        "ok = isinstance(n, int) and not isinstance(n, bool) and n >= 1",
        "if not isinstance(n, int) or isinstance(n, bool):\n    raise ValueError('n')",
        "if not isinstance(n, int) or n < 1:\n    raise ValueError(f'n={n!r}: must be a positive int')",
        "if x is not None and (isinstance(x, bool) or not isinstance(x, int)):\n    raise ValueError('x')",
        "if not isinstance(x, (int, float)) or x <= 0:\n    raise ValueError('x')",
    ]
    assert [bool(inline_checks(code)) for code in old] == [True] * len(old)
    fine = [
        "check_int(n, 'n', low=1)",
        "if isinstance(value, bool) or value is None:\n    return value",
        "if isinstance(v, int) and not 0 <= v < 8:\n    raise ValueError('v')",
        "if not isinstance(s, int):\n    raise ScheduleError('s')",
    ]
    assert [inline_checks(code) for code in fine] == [[]] * len(fine)


def test_no_inline_int_or_bool_checks_outside_the_checks_module():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel != "checks.py":
            found += [f"{rel}:{line}" for line in inline_checks(path.read_text())]
    assert found == [], f"use twinpipe.checks (check_int, check_float, ...) instead of: {found}"

