"""The dependency rule lives in one module (schedule/deps.py) and every layer reads it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from twinpipe.schedule import registry
from twinpipe.schedule.deps import Work, dependency_table, needs, required_work, work_done
from twinpipe.schedule.lower import lower
from twinpipe.schedule.ops import BW, FB, OpKind, F, parse_op
from twinpipe.schedule.placement import dual, linear, vshape

SRC = Path(__file__).resolve().parents[1] / "src" / "twinpipe"


def test_rule_on_a_linear_pipeline():
    p = linear(3)
    assert needs(p, parse_op("0F4")) == []
    assert needs(p, parse_op("1F4")) == [(Work.F, 0, 4)]
    assert needs(p, parse_op("1B4")) == [(Work.F, 1, 4), (Work.B, 2, 4)]
    assert needs(p, parse_op("2BW4")) == [(Work.F, 2, 4)]  # the last stage starts the backward
    assert needs(p, parse_op("1W4")) == [(Work.B, 1, 4)]
    assert work_done(parse_op("1BW4")) == [(Work.B, 1, 4), (Work.W, 1, 4)]


def test_fb_needs_both_halves_and_the_v_turn_is_local():
    v = vshape(2)  # rank 0: stages 0, 3; rank 1: stages 1, 2
    op = FB(F(2, 5), BW(1, 3))
    assert needs(v, op) == [(Work.F, 1, 5), (Work.F, 1, 3), (Work.B, 2, 3)]
    table = dependency_table(v)
    assert [n.local for n in table.needs[OpKind.F][2]] == [True]  # stage 1 -> 2 stays on rank 1
    assert [n.local for n in table.needs[OpKind.F][1]] == [False]


def test_consumers_invert_needs():
    table = dependency_table(dual(4))
    pairs = {(n.work, n.stage, kind, s) for kind, per_stage in table.needs.items() for s, ns in enumerate(per_stage) for n in ns}
    inverse = {(work, stage, kind, s) for (work, stage), users in table.consumers.items() for kind, s in users}
    assert pairs == inverse
    # DualPipe's two chains never depend on each other.
    assert all((stage < 4) == (s < 4) for _, stage, _, s in pairs)


def test_required_work_follows_the_chains():
    items = set(required_work(dual(2), 4))
    assert len(items) == 4 * 2 * 3  # 4 stages, 2 micro-batches per chain, F B W
    assert (Work.F, 2, 2) in items and (Work.F, 2, 0) not in items
    assert set(required_work(linear(2), 1, forward_only=True)) == {(Work.F, 0, 0), (Work.F, 1, 0)}


@pytest.mark.parametrize("name", registry.names())
def test_messages_are_exactly_the_needs_across_ranks(name):
    schedule = registry.build(name, 4, 8)
    placement = schedule.placement
    for program in lower(schedule).programs:
        for op, recvs, sends in zip(program.ops, program.recvs, program.sends):
            expected = {(s, j) for work, s, j in needs(placement, op) if placement.rank_of(s) != program.rank}
            assert {(m.src_stage, m.microbatch) for m in recvs} == expected
            for m in sends:
                assert placement.rank_of(m.dst_stage) != program.rank


def test_the_rule_is_written_only_in_deps():
    # Outside deps.py (and placement.py, which defines the neighbours), the pure-Python layers
    # must not ask for a stage's neighbours to work out what an op waits for.
    offenders = []
    for layer in ("schedule", "sim", "trace", "viz"):
        for path in (SRC / layer).rglob("*.py"):
            if path.name in ("deps.py", "placement.py"):
                continue
            if re.search(r"\.(prev_stage|next_stage)\(", path.read_text()):
                offenders.append(str(path.relative_to(SRC)))
    assert offenders == []
