"""Overlapped F&B ops in the 1F1B family (``overlap=True``, ``warmup_extra=k``): the builders, the
validator's pairing rule, the option checks, the memory they count, the simulator and the drawing.
Pure Python, no processes (the exactness runs are in test_overlap_steady.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from twinpipe.schedule import ScheduleError, resolve, validate
from twinpipe.schedule.ops import FB, B, BW, F, OpKind, parse_op
from twinpipe.sim.costs import CostModel
from twinpipe.sim.engine import simulate, summarize

FAMILY = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv")


def _sizes(name: str):
    """(P, M) pairs to build ``name`` at: few and many micro-batches (interleaved: multiples of P)."""
    for p in (1, 2, 3, 4, 6):
        counts = {p, 2 * p, 3 * p + (0 if name == "interleaved-1f1b" else 1)}
        if name != "interleaved-1f1b":
            counts |= {1, max(1, p - 1)}
        for m in sorted(counts):
            yield p, m


def _work(schedule) -> Counter:
    """How often each simple op (F, B, W, BW of a stage and micro-batch) is done."""
    return Counter((part.kind, part.stage, part.microbatch) for ops in schedule.ops for op in ops for part in op.parts())


@pytest.mark.parametrize("name", FAMILY)
def test_every_overlapped_schedule_validates_and_does_the_same_work(name):
    """Valid for many (P, M, k); the same F, B, W and BW as without overlap, fewer ops where
    paired; every FB pairs a forward with a backward that does not depend on it; a B/W-split
    schedule keeps its W's as ops of their own."""
    paired_somewhere = False
    for p, m in _sizes(name):
        base = resolve(name, p).build(m)
        for k in (0, 1, 2):
            over = resolve(name, p, overlap=True, warmup_extra=k).build(m)
            validate(over)
            assert _work(over) == _work(base), (name, p, m, k)
            pairs = [op for ops in over.ops for op in ops if op.kind is OpKind.FB]
            assert sum(map(len, over.ops)) == sum(map(len, base.ops)) - len(pairs)
            backward_kinds = {op.backward.kind for op in pairs}
            assert backward_kinds <= ({OpKind.B} if name in ("zb-h1", "zb-h2", "zbv") else {OpKind.BW}), backward_kinds
            assert over.options["overlap"] is True and over.options["warmup_extra"] == k
            paired_somewhere |= bool(pairs)
    assert paired_somewhere


@pytest.mark.parametrize("name", ("1f1b", "zb-h1", "interleaved-1f1b"))
def test_steady_phase_pairs_next_forward_with_oldest_backward(name):
    """Megatron's combined 1F1B: rank r's steady phase is (F(j + w_r); B(j)), w_r its warm-up;
    interleaved pairs consecutive F and B of different chunks. Every rank but the last pairs all
    its steady forwards; the last rank's F and B of one micro-batch cannot run at once and stay
    apart, until one extra warm-up forward (Kimi K2) lets it pair too."""
    p, m = 4, 8
    for k in (0, 1):
        over = resolve(name, p, overlap=True, warmup_extra=k).build(m)
        for r, ops in enumerate(over.ops):
            pairs = [op for op in ops if op.kind is OpKind.FB]
            if name == "interleaved-1f1b":
                assert pairs and all(op.stage != op.backward.stage or op.microbatch != op.backward.microbatch for op in pairs)
                continue
            warmup = p - 1 - r + k
            if r == p - 1 and k == 0:
                assert pairs == []
                continue
            assert [(op.microbatch, op.backward.microbatch) for op in pairs] == [(j + warmup, j) for j in range(m - warmup)], (r, k)


def test_extra_warmup_holds_k_more_activations_per_rank():
    """The memory of each (docs/schedules.md): pairing alone keeps every rank's peak; k extra warm-up
    forwards add k micro-batches' activations on each rank (1F1B, interleaved, ZB-H1/H2), at most k
    on ZB-V (whose first leg only takes them). The simulator's peak reads the ops; so does the planner."""
    for name, m in (("1f1b", 8), ("interleaved-1f1b", 8), ("zb-h1", 8), ("zb-h2", 12), ("zbv", 8)):
        for p in (2, 4):
            base = summarize(resolve(name, p).build(m)).peak
            for k in (0, 1, 2):
                over = summarize(resolve(name, p, overlap=True, warmup_extra=k).build(m)).peak
                if name == "zbv":
                    assert all(b <= o <= b + k for b, o in zip(base, over)), (name, p, k, base, over)
                else:
                    assert over == tuple(b + k for b in base), (name, p, k, base, over)


def test_pairs_couple_neighbour_ranks_unless_their_warmups_differ_by_two():
    """How to choose (docs/schedules.md): a pair's forward waits for its backward's gradient. On a
    linear placement (1F1B) rank r's pair i needs rank r+1's pair i, which needs rank r's pair i-1:
    neighbours take turns, and even a pair that costs 2/3 of F+BW (T_FB=2) loses to no overlap,
    whatever k. Interleaved 1F1B's warm-ups differ by 2 between neighbours: there it gains."""
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_fb=2.0)
    plain = summarize(resolve("1f1b", 4).build(16), costs).makespan
    assert all(summarize(resolve("1f1b", 4, overlap=True, warmup_extra=k).build(16), costs).makespan > plain for k in range(4))
    plain = summarize(resolve("interleaved-1f1b", 4).build(16), costs).makespan
    over = summarize(resolve("interleaved-1f1b", 4, overlap=True, warmup_extra=1).build(16), costs).makespan
    assert over < 0.8 * plain, (over, plain)


def test_validator_rejects_a_pairing_whose_halves_depend_on_each_other():
    """The wrong pairing: the last rank's forward of micro-batch 0 with its own backward, and a
    forward with the backward of the stage that reads its output."""
    base = resolve("1f1b", 2).build(2)
    ops = [list(r) for r in base.ops]
    assert ops[1][:2] == [F(1, 0), BW(1, 0)]
    own = base.with_ops([ops[0], [FB(F(1, 0), BW(1, 0))] + ops[1][2:]])
    with pytest.raises(ScheduleError, match=r"\[FB pairing\].*\(1F0;1BW0\).*1F0") as err:
        validate(own)
    assert (err.value.rule, err.value.rank, err.value.index) == ("FB pairing", 1, 0)
    v = resolve("zbv", 2).build(2)  # rank 1 holds stages 1 and 2: 2F0 reads 1F0's output
    rank1 = [op for op in v.ops[1] if op not in (F(1, 0), B(2, 0))]
    i = rank1.index(F(2, 0))
    rank1[i:i + 1] = [FB(F(2, 0), B(2, 0))]
    with pytest.raises(ScheduleError, match=r"\[FB pairing\]"):
        validate(v.with_ops([v.ops[0], [F(1, 0)] + rank1]))


def test_fb_with_an_input_gradient_half_parses_and_prints():
    op = FB(F(0, 5), B(0, 2))
    assert str(op) == "(0F5;0B2)" and parse_op("(0F5;0B2)") == op
    assert parse_op("(0F5;7BW2)") == FB(F(0, 5), BW(7, 2))
    with pytest.raises(ValueError, match="BW or B"):
        FB(F(0, 1), F(0, 2))


@pytest.mark.parametrize("name,fragment", [
    ("gpipe", "gpipe: option overlap=True: not taken by gpipe; schedules that take it: 1f1b, interleaved-1f1b, zb-h1, zb-h2, zbv"),
    ("chimera", "chimera: option overlap=True: not taken by chimera"),
    ("dualpipev", "dualpipev: option overlap=True: not taken by dualpipev (it overlaps F&B ops already)"),
])
def test_overlap_on_a_schedule_without_a_steady_phase_names_both(name, fragment):
    with pytest.raises(ValueError) as err:
        resolve(name, 4, overlap=True)
    assert fragment in str(err.value)


@pytest.mark.parametrize("options,fragment", [
    (dict(overlap=1), "1f1b: overlap=1: must be True or False"),
    (dict(overlap=True, warmup_extra=-1), "1f1b: warmup_extra=-1: must be >= 0"),
    (dict(warmup_extra=2), "1f1b: warmup_extra=2: is the extra warm-up of overlapped F&B ops: give overlap=True too"),
])
def test_bad_overlap_options_are_refused_at_resolve(options, fragment):
    with pytest.raises(ValueError) as err:
        resolve("1f1b", 4, **options)
    assert fragment in str(err.value)


def test_overlappable_lists_the_family():
    from twinpipe.schedule.registry import overlappable

    assert set(FAMILY) <= set(overlappable())
    assert not {"gpipe", "dualpipe", "dualpipev", "chimera", "bitpipe"} & set(overlappable())


def test_simulator_times_fb_ops_with_a_backward_half_of_either_kind():
    """An FB op takes T_FB where given for a BW half, else its halves back to back (a B half: T_F + T_B);
    a B half leaves the W to its own op."""
    costs = CostModel(t_f=1.0, t_b=2.0, t_w=0.5, t_fb=2.0)
    for name, t_pair in (("1f1b", 2.0), ("zb-h1", 3.0)):
        timeline = simulate(resolve(name, 2, overlap=True).build(4), costs)
        fb = [s for s in timeline.slices if s.op is not None and s.op.kind is OpKind.FB]
        assert fb and all(s.end - s.start == pytest.approx(t_pair) for s in fb), name
        ws = [s for s in timeline.slices if s.op is not None and s.op.kind is OpKind.W]
        assert len(ws) == (8 if name == "zb-h1" else 0)


def test_draw_shows_both_halves_of_each_fb_op():
    """Each FB op is one cell split in two: its forward half (F) and its backward half (B here,
    ZB-H1 splitting B and W), with one divider per pair."""
    pytest.importorskip("matplotlib")
    from twinpipe.viz.cells import timeline_cells
    from twinpipe.viz.style import KIND_COLOURS

    timeline = simulate(resolve("zb-h1", 2, overlap=True).build(4))
    cells = timeline_cells(timeline)
    fb = [s for s in timeline.slices if s.op is not None and s.op.kind is OpKind.FB]
    assert fb and cells.has_fb and len(cells.dividers) == len(fb)
    assert KIND_COLOURS["B"][0] in cells.faces and KIND_COLOURS["F"][0] in cells.faces


def test_torch_csv_refuses_an_fb_op_with_an_input_gradient_half():
    from twinpipe.schedule.torch_csv import to_torch_csv

    with pytest.raises(ValueError, match="OVERLAP_F_B pairs a forward with a full backward only"):
        to_torch_csv(resolve("zb-h1", 2, overlap=True).build(4))
    assert "OVERLAP_F_B" in to_torch_csv(resolve("1f1b", 2, overlap=True).build(4))
