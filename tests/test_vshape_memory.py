"""V-Half and V-Min (controllable-memory V schedules): valid, the authors' bubble rates, memory
within the target, measured closed forms, bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinpipe.schedule.check import validate
from twinpipe.schedule.registry import build
from twinpipe.schedule.vshape_memory import block_offsets
from twinpipe.sim import CostModel, simulate

NAMES = ("v-min", "v-half")
GRID = [(p, m) for p in (1, 2, 3, 4, 5, 6, 8) for m in (1, 2, 3, 4, 5, 7, 8, 12, 16, 24)]


def target(name: str, p: int) -> int:
    """The memory the paper targets, in half-size V stages' M_B (2 per 1F1B-size micro-batch)."""
    return 2 * ((p + 4) // 3 if name == "v-min" else (p + 2) // 2)


@pytest.mark.parametrize("variant", ["min", "half"])
def test_building_blocks_never_collide(variant):
    # Each rank's four offsets differ mod 6, so blocks shifted by 6k never share a slot.
    for p in range(1, 65):
        for offsets in block_offsets(p, variant):
            assert len({o % 6 for o in offsets}) == 4, (p, offsets)


def test_block_offsets_are_the_papers():
    assert block_offsets(4, "min") == [(0, 7, 8, 15), (1, 6, 9, 14), (2, 5, 10, 13), (3, 4, 11, 12)]
    assert block_offsets(3, "min")[0] == (0, 5, 8, 13)  # delta = 2 when p % 3 == 0
    assert block_offsets(4, "half")[1] == (2, 9, 16, 24)  # delta = 3 when p is even
    with pytest.raises(ValueError, match="variant='third': allowed are 'min', 'half'"):
        block_offsets(4, "third")


@pytest.mark.parametrize("name", NAMES)
def test_valid_and_within_target_memory_on_a_grid(name):
    for p, m in GRID:
        for mw in (0.5, 1.0):
            schedule = build(name, p, m, mw=mw)
            validate(schedule)
            assert schedule.placement.kind == "v" and schedule.num_microbatches == m
            timeline = simulate(schedule, CostModel(mw=mw))
            assert max(timeline.peak_activation) <= target(name, p), (p, m, mw, timeline.peak_activation)
            assert timeline.cost == schedule.options["cost"]


# Bubble rates the authors' code computes (zero-bubble.md, uniform times, T_comm = 0) and the
# largest per-rank span behind them: busy = 6m, rate = (span - 6m) / span.
AUTHORS = [
    (4, 8, "v-min", 0.1864, 59), (4, 8, "v-half", 0.0943, 53),
    (8, 24, "v-min", 0.1579, 171), (8, 24, "v-half", 0.1056, 161),
    (8, 32, "v-min", 0.1233, 219), (8, 32, "v-half", 0.0813, 209),
    (16, 48, "v-min", 0.1700, 347), (16, 48, "v-half", 0.1246, 329),
]


@pytest.mark.parametrize("p,m,name,rate,span", AUTHORS)
@pytest.mark.parametrize("mw", [0.5, 1.0])
def test_reproduces_the_authors_bubble_rates(p, m, name, rate, span, mw):
    timeline = simulate(build(name, p, m, mw=mw), CostModel(mw=mw))
    assert timeline.cost == span
    assert round(timeline.bubble_rate, 4) == rate
    assert max(timeline.peak_activation) <= target(name, p)


@pytest.mark.parametrize("p", range(2, 13))
def test_measured_closed_forms_for_unit_times(p):
    """Idle per rank (span - busy, unit times) for m >= 2p: V-Min 4p-5 (4p-7 if 3 | p), V-Half
    3p-4 (3p-7 for even p; p >= 3): about 2/3 and 1/2 of 1F1B's 6(p-1) in half-stage times."""
    for m in (2 * p, 3 * p):
        idle_min = build("v-min", p, m).options["cost"] - 6 * m
        assert idle_min == 4 * p - (7 if p % 3 == 0 else 5)
        if p >= 3:
            idle_half = build("v-half", p, m).options["cost"] - 6 * m
            assert idle_half == 3 * p - (7 if p % 2 == 0 else 4)


def test_memory_and_bubble_sit_between_zbv_and_less():
    p, m = 8, 32
    zbv = simulate(build("zbv", p, m))
    half = simulate(build("v-half", p, m))
    low = simulate(build("v-min", p, m))
    assert max(low.peak_activation) < max(half.peak_activation) < max(zbv.peak_activation)
    assert zbv.bubble_rate < half.bubble_rate < low.bubble_rate


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    p=st.integers(1, 6),
    m=st.integers(1, 14),
    t_f=st.sampled_from([0.5, 1.0, 1.7]),
    t_b=st.sampled_from([0.5, 1.0, 2.0]),
    t_w=st.sampled_from([0.3, 1.0, 1.5]),
    t_comm=st.sampled_from([0.0, 0.2, 1.0]),
    mw=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
)
def test_planned_cost_is_the_simulated_cost_for_any_costs(name, p, m, t_f, t_b, t_w, t_comm, mw):
    schedule = build(name, p, m, t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm, mw=mw)
    validate(schedule)
    timeline = simulate(schedule, CostModel(t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm, mw=mw))
    assert timeline.cost == pytest.approx(schedule.options["cost"])
    assert max(timeline.peak_activation) <= target(name, p) + 1e-9


def test_per_stage_times():
    times = [1.0 + 0.1 * s for s in range(8)]
    schedule = build("v-half", 4, 8, t_f=times, t_b=times, t_w=times)
    timeline = simulate(schedule, CostModel(t_f=times, t_b=times, t_w=times))
    assert timeline.cost == pytest.approx(schedule.options["cost"])


BAD = [
    ("v-min", 0, 4, {}, r"v-min: num_ranks=0: must be >= 1"),
    ("v-half", 4, 0, {}, r"v-half: num_microbatches=0: must be >= 1"),
    ("v-half", 4, 8, {"t_f": 0}, r"v-half: t_f=0: must be a finite number > 0"),
    ("v-min", 4, 8, {"t_b": [1, 2]}, r"v-min: t_b=\[1, 2\]: must be one number or 8"),
    ("v-min", 4, 8, {"t_comm": -1}, r"v-min: t_comm=-1: must be a finite number >= 0"),
    ("v-half", 4, 8, {"mw": -0.5}, r"v-half: mw=-0.5: must be a finite number >= 0"),
]


@pytest.mark.parametrize("name,p,m,options,message", BAD)
def test_bad_input_names_argument_value_and_allowed(name, p, m, options, message):
    with pytest.raises(ValueError, match=message):
        build(name, p, m, **options)
