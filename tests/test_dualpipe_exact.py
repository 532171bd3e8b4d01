"""DualPipe and DualPipeV against a single-process reference: losses bitwise, gradients <= 1e-13.

One 4-process gloo world runs every case; pipelines of 1..4 ranks use sub-groups of it.
"""

from __future__ import annotations

import pytest

from distributed import run_world
from exactness import Case, assert_case, run_all

WORLD = 4


def _cases() -> list[Case]:
    cases = []
    for p in (1, 2, 3, 4):
        for n in sorted({1, 2, 2 * p - 1, 2 * p, 2 * p + 3}):
            cases.append(Case("dualpipev", p, n))
        cases.append(Case("dualpipev", p, 2 * p + 2, "overlap"))
        cases.append(Case("dualpipev", p, 2 * p, "two"))
    for p in (2, 4):
        for n in sorted({2, p, 2 * p, 2 * p + 4}):
            cases.append(Case("dualpipe", p, n))
        cases.append(Case("dualpipe", p, 2 * p + 2, "overlap"))
        cases.append(Case("dualpipe", p, 2 * p, "two"))
    cases.append(Case("dualpipe", 4, 6, "overlap"))  # fewer than 2P micro-batches, overlapped
    # The same through gloo itself (the transport between hosts, and for GPUs NCCL's twin).
    for schedule, p, n, model in (("dualpipev", 1, 3, "mlp"), ("dualpipev", 3, 7, "overlap"), ("dualpipev", 4, 8, "two"),
                                  ("dualpipe", 2, 2, "mlp"), ("dualpipe", 4, 10, "overlap"), ("dualpipe", 4, 8, "two")):
        cases.append(Case(schedule, p, n, model, transport="process-group"))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def outcomes():
    return run_world(WORLD, run_all, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_exact(outcomes, case):
    assert_case(outcomes, case)
