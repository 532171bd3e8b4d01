"""The validator and lowering reject corrupted schedules, naming rank, op index and rule."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from twinpipe.schedule.check import ScheduleError, validate
from twinpipe.schedule.lower import LoweredSchedule, check_channels, lower
from twinpipe.schedule.ops import BW, FB, F, OpKind, parse_op
from twinpipe.schedule.registry import build


def _moved(schedule, rank, src, dst):
    ops = [list(r) for r in schedule.ops]
    ops[rank].insert(dst, ops[rank].pop(src))
    return schedule.with_ops(ops)


@pytest.mark.parametrize("name,p,m", [("dualpipev", p, m) for p in (1, 2, 3, 4) for m in (1, 3, 2 * p, 2 * p + 5)]
                         + [("dualpipe", p, m) for p in (2, 4, 6) for m in (2, 4, 2 * p, 2 * p + 6)])
def test_generated_schedules_are_valid(name, p, m):
    schedule = build(name, p, m)
    lower(schedule)
    for rank_ops in schedule.ops:
        for op in rank_ops:
            assert parse_op(str(op)) == op


def test_official_counts_per_rank():
    # Each rank runs every micro-batch of each of its stages once through F and once through a backward.
    s = build("dualpipe", 8, 20)
    for rank, ops in enumerate(s.ops):
        parts = [part for op in ops for part in op.parts()]
        assert sum(p.kind is OpKind.F for p in parts) == 20
        assert sum(p.kind in (OpKind.B, OpKind.BW) for p in parts) == 20


def test_official_dualpipev_order_p2_n6():
    # Worked by hand from the official 8-step program (rank 1 is the last rank: step 4 starts unoverlapped).
    s = build("dualpipev", 2, 6)
    assert " ".join(s.to_strings()[1]) == (
        "1F0 2F0 1F1 2F1 1F2 2BW0 (2F2;1BW0) (1F3;2BW1) (2F3;1BW1) (1F4;2BW2) (2F4;1BW2) "
        "(1F5;2BW3) (2F5;1BW3) 2BW4 1BW4 2B5 1B5 2W5 1W5"
    )
    assert " ".join(s.to_strings()[0]) == (
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 (0F3;3BW1) (3F2;0BW0) (0F4;3BW2) (3F3;0BW1) (0F5;3BW3) "
        "(3F4;0BW2) 3BW4 (3F5;0BW3) 3BW5 0B4 0W4 0B5 0W5"
    )


def test_swapped_pair_breaks_dependency_order():
    s = build("dualpipev", 2, 6)
    ops = [list(r) for r in s.ops]
    i, j = ops[0].index(parse_op("3F0")), ops[0].index(parse_op("3B0"))
    ops[0][i], ops[0][j] = ops[0][j], ops[0][i]
    with pytest.raises(ScheduleError) as err:
        validate(s.with_ops(ops))
    assert err.value.rule == "dependency order" and err.value.rank == 0 and err.value.index == i
    assert f"rank 0, op {i}" in str(err.value) and "3B0 needs 3F0" in str(err.value)


def test_swap_across_ranks_is_a_deadlock():
    s = build("dualpipev", 2, 6)
    # Rank 0 first waits for stage 2 (rank 1), which waits for stage 0 that rank 0 has not run.
    corrupted = _moved(s, 0, s.ops[0].index(parse_op("3F0")), 0)
    with pytest.raises(ScheduleError) as err:
        validate(corrupted)
    assert err.value.rule == "deadlock"
    assert "rank 0 op 0 (3F0) waits for 2F0" in str(err.value)


def test_missing_op():
    s = build("dualpipe", 4, 8)
    ops = [list(r) for r in s.ops]
    w = next(op for op in ops[1] if op.kind is OpKind.W)
    ops[1].remove(w)
    with pytest.raises(ScheduleError) as err:
        validate(s.with_ops(ops))
    assert err.value.rule == "missing op" and f"{w.stage}W{w.microbatch}" in str(err.value)


def test_repeated_and_misplaced_ops():
    s = build("dualpipev", 2, 4)
    ops = [list(r) for r in s.ops]
    ops[0].append(ops[0][0])
    with pytest.raises(ScheduleError, match="repeated op"):
        validate(s.with_ops(ops))
    ops = [list(r) for r in s.ops]
    ops[0].append(F(1, 0))
    with pytest.raises(ScheduleError) as err:
        validate(s.with_ops(ops))
    assert err.value.rule == "wrong rank" and err.value.index == len(ops[0]) - 1


def test_reversed_send_order_is_rejected():
    lowered = lower(build("dualpipev", 3, 6))
    program = lowered.programs[0]
    channels = dict(program.channels)
    channels[1] = tuple(reversed(channels[1]))
    programs = list(lowered.programs)
    programs[0] = dataclasses.replace(program, channels=channels)
    with pytest.raises(ScheduleError) as err:
        check_channels(LoweredSchedule(lowered.schedule, tuple(programs)))
    assert err.value.rule == "send/receive order" and err.value.rank == 0
    assert "same order" in str(err.value)


def test_receive_queued_behind_a_later_send_is_rejected():
    lowered = lower(build("dualpipev", 2, 4))
    # Swap the first send and the first receive that rank 1 exchanges with rank 0, on both sides:
    # consistent between the pair, but rank 1 would then wait for a receive stuck behind its own send.
    programs = list(lowered.programs)
    chan = list(programs[1].channels[0])
    first_send = next(i for i, m in enumerate(chan) if m.src_rank == 1)
    later_recv = next(i for i, m in enumerate(chan) if i > first_send and m.src_rank == 0)
    chan.insert(first_send, chan.pop(later_recv))
    for rank, peer in ((1, 0), (0, 1)):
        channels = dict(programs[rank].channels)
        channels[peer] = tuple(chan)
        programs[rank] = dataclasses.replace(programs[rank], channels=channels)
    with pytest.raises(ScheduleError, match="wait forever"):
        check_channels(LoweredSchedule(lowered.schedule, tuple(programs)))


def test_fb_needs_a_full_backward_half():
    with pytest.raises(ValueError):
        FB(F(0, 0), F(1, 0))
    assert str(FB(F(0, 5), BW(7, 2))) == "(0F5;7BW2)"
    with pytest.raises(ValueError, match="not of the form"):
        parse_op("F3")


@pytest.mark.parametrize("name,p,m", [("dualpipe", 3, 6), ("dualpipe", 4, 5), ("dualpipe", 0, 4), ("dualpipev", 2, 0)])
def test_bad_counts(name, p, m):
    with pytest.raises(ValueError, match="num_ranks|num_chunks|num_microbatches"):
        build(name, p, m)


def test_schedule_layer_does_not_import_torch():
    code = "import sys, twinpipe.schedule.registry as r; r.build('dualpipe', 4, 8); import twinpipe; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
