"""Every registered schedule, run by the one executor, against a single-process reference.

Losses bitwise, gradients <= 1e-13 (float64), forward-only outputs equal, and the number of live
activation sets per rank equal to the simulator's peak. One 4-process gloo world; pipelines of
1, 2 and 4 ranks use sub-groups of it.
"""

from __future__ import annotations

import pytest

from distributed import run_world
from exactness import Case, assert_case, run_all
from twinpipe.schedule.registry import names

WORLD = 4
MICROBATCHES = {1: (1, 3), 2: (1, 2, 4, 7), 4: (4, 8, 10)}


def _cases() -> list[Case]:
    cases = []
    for name in names():
        for p, counts in MICROBATCHES.items():
            for m in counts:
                options = ()
                if name == "interleaved-1f1b":
                    if m % p:
                        continue  # Megatron's rule: m a multiple of p
                    options = (("stages_per_rank", 2),)
                if name in ("dualpipe", "chimera", "bitpipe") and (p % 2 or m % 2):
                    continue  # two directions: an even number of ranks and micro-batches
                cases.append(Case(name, p, m, "mlp", options))
    cases.append(Case("interleaved-1f1b", 2, 6, "mlp", (("stages_per_rank", 3),)))
    cases.append(Case("zb-h2", 4, 8, "two"))
    cases.append(Case("zb-auto", 4, 8, "mlp", (("mem_limit", 8),)))
    cases.append(Case("zbv", 2, 4, "two"))
    cases.append(Case("bitpipe", 2, 6, "two"))
    for name, p, m in (("gpipe", 4, 8), ("1f1b", 2, 7), ("zb-h1", 4, 8), ("zbv", 4, 10), ("chimera", 4, 8)):
        cases.append(Case(name, p, m, "mlp", transport="process-group"))
    # Chimera with two pipeline pairs: four copies of each model stage, summed by sync_mirrored_grads.
    cases += [Case("chimera", 4, m, "mlp", (("pairs", 2),)) for m in (4, 8, 12)]
    cases.append(Case("chimera", 4, 8, "two", (("pairs", 2),), transport="process-group"))
    cases.append(Case("chimera", 2, 4, "mlp", (("pairs", 1),)))
    return cases


CASES = _cases()


def test_every_registered_schedule_is_covered():
    covered = {c.schedule for c in CASES}
    assert covered == set(names())
    assert {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zbv", "dualpipe", "dualpipev", "chimera", "bitpipe"} <= covered


@pytest.fixture(scope="module")
def outcomes():
    return run_world(WORLD, run_all, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_exact(outcomes, case):
    assert_case(outcomes, case)
