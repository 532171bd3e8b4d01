"""Chimera and BitPipe: placements, and the simulator against the papers' numbers and our closed forms."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinpipe.schedule import registry
from twinpipe.schedule.chimera import slots
from twinpipe.sim import CostModel, simulate


def span_and_bubble(name: str, d: int, m: int, t_f: float, t_bw: float, **options):
    """Makespan and per-rank idle time (every rank holds as many stages, each runs its chain's
    m / chains F and BW)."""
    schedule = registry.build(name, d, m, **options)
    timeline = simulate(schedule, CostModel(t_f=t_f, t_b=t_bw, t_w=0))
    per_rank = schedule.placement.num_stages // d * (m // len(schedule.placement.chains))
    return timeline, timeline.makespan - per_rank * (t_f + t_bw)


# (D, k): every pair count the smaller D allow, and a few more.
PAIRS = [(4, 2), (6, 3), (8, 2), (8, 4), (12, 2), (12, 3), (12, 6), (16, 4)]


@pytest.mark.parametrize("name", ["chimera", "bitpipe"])
@pytest.mark.parametrize("d", [2, 4, 6])
def test_each_chain_is_a_whole_model_copy_mirrored(name, d):
    placement = registry.placement_for(name, d)
    down, up = placement.chains
    assert len(down) == len(up) == placement.num_stages // 2
    for a, b in zip(down, up):  # model stage k: its two copies sit on mirrored ranks
        assert placement.rank_of(b) == d - 1 - placement.rank_of(a)
    assert all(len(placement.stages_of(r)) == placement.num_stages // d for r in range(d))


@pytest.mark.parametrize("d,k", PAIRS)
def test_chimera_pairs_placement(d, k):
    # The paper's 2k pipelines: pair i is pair 0 rotated by i*D/k ranks; no rank holds two copies
    # of one model stage, and k = 1 is the dual placement.
    placement = registry.placement_for("chimera", d, pairs=k)
    assert len(placement.chains) == 2 * k and placement.num_model_stages == d
    for c, chain in enumerate(placement.chains):
        i, up = divmod(c, 2)
        assert [placement.rank_of(s) for s in chain] == [((d - 1 - q if up else q) + i * d // k) % d for q in range(d)]
    for r in range(d):
        held = [placement.model_stage(s) for s in placement.stages_of(r)]
        assert len(held) == 2 * k == len(set(held))
    assert registry.placement_for("chimera", d, pairs=1) == registry.placement_for("chimera", d)


@pytest.mark.parametrize("d,k", PAIRS)
@pytest.mark.parametrize("units", [1, 2, 3])
def test_chimera_pairs_span_is_2n_plus_d_over_k_minus_2_slots(d, k, units):
    # The module doc's slot argument, F = B: the bubble is D/k - 2 slots on every rank.
    m = units * d
    timeline, idle = span_and_bubble("chimera", d, m, 1.0, 1.0, pairs=k)
    assert timeline.makespan == 2 * m + d // k - 2
    assert idle == d // k - 2


@settings(max_examples=40, deadline=None)
@given(dk=st.sampled_from(PAIRS), units=st.integers(1, 3),
       t_f=st.sampled_from([0.5, 1.0, 1.5, 3.0]), t_bw=st.sampled_from([0.5, 1.0, 2.0, 4.5]))
def test_chimera_pairs_bubble_closed_form_for_any_costs(dk, units, t_f, t_bw):
    # The k = 1 form below with D/k for D.
    d, k = dk
    _, idle = span_and_bubble("chimera", d, units * d, t_f, t_bw, pairs=k)
    h = d // k
    assert idle == pytest.approx((h - 2) * max(t_f, t_bw) + (units - 1) * (h - 2) * abs(t_bw - t_f))


@pytest.mark.parametrize("d,k", PAIRS)
def test_chimera_pairs_peak_activations(d, k):
    # Simulated: D - h/2 + 1 + min(r, h-1-r) with h = D/k, r = rank mod h (k = 1: the paper's D/2 + 1 + ...).
    h = d // k
    expected = tuple(float(d - h // 2 + 1 + min(w % h, h - 1 - w % h)) for w in range(d))
    for m in (d, 3 * d):
        assert simulate(registry.build("chimera", d, m, pairs=k)).peak_activation == expected


@pytest.mark.parametrize("d,k", PAIRS)
def test_chimera_pairs_slots_never_collide(d, k):
    for m in (2 * k, d, 3 * d + 2 * k):
        for entries in slots(d, m, k):
            taken = [slot for slot, _ in entries]
            assert taken == sorted(set(taken))


@pytest.mark.parametrize("d", [2, 4, 6, 8, 10])
@pytest.mark.parametrize("units", [1, 2, 3])
def test_chimera_span_is_2n_plus_d_minus_2_slots(d, units):
    # The paper, F = B: a basic unit (N = D micro-batches) spans 2N + D - 2 slots; concatenated
    # units tile, so the bubble stays D - 2 slots for any number of whole units.
    m = units * d
    timeline, idle = span_and_bubble("chimera", d, m, 1.0, 1.0)
    assert timeline.makespan == 2 * m + d - 2
    assert idle == d - 2


@settings(max_examples=40, deadline=None)
@given(d=st.sampled_from([2, 4, 6, 8]), units=st.integers(1, 4),
       t_f=st.sampled_from([0.5, 1.0, 1.5, 3.0]), t_bw=st.sampled_from([0.5, 1.0, 2.0, 4.5]))
def test_chimera_bubble_closed_form_for_any_costs(d, units, t_f, t_bw):
    # Ours (derived from the slot table): (D-2) max(F, BW) for the first unit, and each further
    # unit adds (D-2) |BW - F| (the slots assume F = BW; the longer op pushes the shorter).
    _, idle = span_and_bubble("chimera", d, units * d, t_f, t_bw)
    assert idle == pytest.approx((d - 2) * max(t_f, t_bw) + (units - 1) * (d - 2) * abs(t_bw - t_f))


@pytest.mark.parametrize("d", [2, 4, 6, 8])
def test_chimera_peak_activations(d):
    # The paper: D/2 + 1 outstanding forwards at the end ranks up to D in the middle (D=8: 5,6,7,8,8,7,6,5).
    expected = tuple(float(d // 2 + 1 + min(w, d - 1 - w)) for w in range(d))
    for m in (d, 3 * d):
        assert simulate(registry.build("chimera", d, m)).peak_activation == expected
    if d == 8:
        assert expected == (5, 6, 7, 8, 8, 7, 6, 5)


@pytest.mark.parametrize("d", [2, 4, 6, 8])
@pytest.mark.parametrize("m", [2, 6, 10, 16])
def test_chimera_slots_never_collide(d, m):
    for entries in slots(d, m):
        taken = [slot for slot, _ in entries]
        assert taken == sorted(set(taken))


# The authors' reference generator (Shigangli/Chimera, chimera_pipeline_rank.py) for D = 4 and
# N = 8 (two basic units), one slot per cell: d/u = down/up pipeline, f/b = forward/backward, "-"
# = no compute (its gradient-sync cells are written "-" here).
AUTHORS_D4_N8 = [
    "df - df uf ub uf ub db df db df uf ub uf ub db - db",
    "- df uf df uf ub db ub db df uf df uf ub db ub db",
    "- uf df uf df db ub db ub uf df uf df db ub db ub",
    "uf - uf df db df db ub uf ub uf df db df db ub - ub",
]


def test_chimera_slots_equal_the_authors_generator():
    rows = []
    for entries in slots(4, 8):
        cells = ["-"] * (entries[-1][0] + 1)
        for slot, op in entries:
            direction = "d" if op.stage < 4 else "u"
            cells[slot] = direction + ("f" if op.kind.value == "F" else "b")
        rows.append(" ".join(cells))
    assert rows == AUTHORS_D4_N8


# The authors' generator for D = 8 with 2k = 4 pipelines (divisors=4) and N = 16 (two units): d0/d1
# and u0/u1 are the down and up pipelines rotated by 0 and D/k = 4 ranks. It matches ours cell for
# cell for every D <= 24 and k, in the one or two units it builds (it drops further units, and all
# but the first where a pipeline gets one micro-batch per unit, k = D/2).
AUTHORS_D8_K2_N16 = [
    "d0f - d0f u1f d1f u1f d1f u0f u0b u0f u0b d1b u1b d1b u1b d0b d0f d0b d0f u1f d1f u1f d1f u0f u0b u0f u0b d1b u1b d1b u1b d0b - d0b",
    "- d0f u1f d0f u1f d1f u0f d1f u0f u0b d1b u0b d1b u1b d0b u1b d0b d0f u1f d0f u1f d1f u0f d1f u0f u0b d1b u0b d1b u1b d0b u1b d0b",
    "- u1f d0f u1f d0f u0f d1f u0f d1f d1b u0b d1b u0b d0b u1b d0b u1b u1f d0f u1f d0f u0f d1f u0f d1f d1b u0b d1b u0b d0b u1b d0b u1b",
    "u1f - u1f d0f u0f d0f u0f d1f d1b d1f d1b u0b d0b u0b d0b u1b u1f u1b u1f d0f u0f d0f u0f d1f d1b d1f d1b u0b d0b u0b d0b u1b - u1b",
    "d1f - d1f u0f d0f u0f d0f u1f u1b u1f u1b d0b u0b d0b u0b d1b d1f d1b d1f u0f d0f u0f d0f u1f u1b u1f u1b d0b u0b d0b u0b d1b - d1b",
    "- d1f u0f d1f u0f d0f u1f d0f u1f u1b d0b u1b d0b u0b d1b u0b d1b d1f u0f d1f u0f d0f u1f d0f u1f u1b d0b u1b d0b u0b d1b u0b d1b",
    "- u0f d1f u0f d1f u1f d0f u1f d0f d0b u1b d0b u1b d1b u0b d1b u0b u0f d1f u0f d1f u1f d0f u1f d0f d0b u1b d0b u1b d1b u0b d1b u0b",
    "u0f - u0f d1f u1f d1f u1f d0f d0b d0f d0b u1b d1b u1b d1b u0b u0f u0b u0f d1f u1f d1f u1f d0f d0b d0f d0b u1b d1b u1b d1b u0b - u0b",
]


def test_chimera_two_pairs_equal_the_authors_generator():
    placement = registry.placement_for("chimera", 8, pairs=2)
    rows = []
    for entries in slots(8, 16, 2):
        cells = ["-"] * (entries[-1][0] + 1)
        for slot, op in entries:
            chain = placement.chain_of_stage(op.stage)
            cells[slot] = "du"[chain % 2] + str(chain // 2) + ("f" if op.kind.value == "F" else "b")
        rows.append(" ".join(cells))
    assert rows == AUTHORS_D8_K2_N16


def test_bitpipe_basic_unit_spans_28_for_24_of_work():
    # The paper's D = 4 figure: chunk forward 1, chunk backward 2.
    timeline, idle = span_and_bubble("bitpipe", 4, 4, 1.0, 2.0)
    assert (timeline.makespan, idle) == (28, 4)


@pytest.mark.parametrize("d", [2, 4, 6, 8])
def test_bitpipe_bubble_and_memory_stop_growing(d):
    # Units enter faster than they drain, forwards only fill idle time: after a few units neither
    # the idle time nor the peak grows (what the module doc claims).
    measured = []
    for units in (4, 8, 16):
        timeline, idle = span_and_bubble("bitpipe", d, units * d, 1.0, 2.0)
        measured.append((idle, max(timeline.peak_activation)))
    assert measured[0] == measured[1] == measured[2]
    assert measured[0][1] <= 3 * d  # half-size stages: at most 1.5 D activations of a 1F1B stage
    if d == 2:
        assert measured[0] == (0, 4)


def test_bitpipe_beats_chimera_on_many_units():
    # Same model (BitPipe's chunks are half a Chimera stage), T_B = T_W = T_F: Chimera's bubble
    # grows with every unit, BitPipe's does not.
    d, m = 4, 32
    chimera = simulate(registry.build("chimera", d, m), CostModel(t_f=2, t_b=2, t_w=2)).makespan
    bitpipe = simulate(registry.build("bitpipe", d, m), CostModel(t_f=1, t_b=1, t_w=1)).makespan
    assert bitpipe < chimera
