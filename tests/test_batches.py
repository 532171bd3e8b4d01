"""batch_layout: which rows of a full batch each rank passes to step(), and which micro-batches its
losses are; checked against the schedules' own ops and against how step() splits its inputs."""

from __future__ import annotations

import pytest
import torch

from twinpipe.runtime.batches import batch_layout, microbatch_rows
from twinpipe.schedule import registry
from twinpipe.schedule.ops import OpKind

CASES = [(name, p, m) for name in registry.names() for p in (1, 2, 3, 4) for m in (2, 4, 6, 8)]


def _built(name, p, m):
    try:
        return registry.build(name, p, m)
    except ValueError:
        return None


def _forward_microbatches(schedule, rank, stage_is):
    """Micro-batches of this rank's forwards on the stages ``stage_is`` picks."""
    return sorted(part.microbatch for op in schedule.ops[rank] for part in op.parts()
                  if part.kind == OpKind.F and stage_is(part.stage))


@pytest.mark.parametrize("name", registry.names())
def test_layout_matches_the_schedules_own_forwards(name):
    built = 0
    for n, p, m in CASES:
        schedule = _built(n, p, m) if n == name else None
        if schedule is None:
            continue
        built += 1
        placement = schedule.placement
        for rank in range(p):
            layout = batch_layout(name, p, rank, m)
            firsts = _forward_microbatches(schedule, rank, placement.is_first)
            lasts = _forward_microbatches(schedule, rank, placement.is_last)
            assert list(layout.input_microbatches) == firsts, (name, p, m, rank)
            assert list(layout.label_microbatches) == lasts, (name, p, m, rank)
            assert batch_layout(schedule, p, rank, m) == layout
    assert built >= 4


def test_dualpipe_ends_pass_opposite_halves():
    p, m = 4, 8
    first, last = batch_layout("dualpipe", p, 0, m), batch_layout("dualpipe", p, p - 1, m)
    assert (first.input_microbatches, first.label_microbatches) == (range(0, 4), range(4, 8))
    assert (last.input_microbatches, last.label_microbatches) == (range(4, 8), range(0, 4))
    for middle in (1, 2):
        layout = batch_layout("dualpipe", p, middle, m)
        assert not layout.input_microbatches and not layout.label_microbatches
        assert layout.inputs(torch.zeros(8)) == () and layout.labels(torch.zeros(8)) == ()


@pytest.mark.parametrize("batch", [8, 11, 13, 24])
@pytest.mark.parametrize("name", ["dualpipe", "dualpipev", "1f1b"])
def test_rows_split_by_step_are_the_full_batch_microbatches(name, batch):
    """step() splits what a rank passes into its chain's micro-batches with tensor_split: those must
    be exactly the full batch's micro-batches, also when the batch does not divide evenly."""
    p, m = 2, 4
    x = torch.arange(batch * 3).reshape(3, batch)  # batch along dim 1
    full = torch.tensor_split(x, m, dim=1)
    for rank in range(p):
        layout = batch_layout(name, p, rank, m)
        for picked, mbs in ((layout.inputs(x, dim=1), layout.input_microbatches),
                            (layout.labels(x, -x, dim=-1), layout.label_microbatches)):
            if not mbs:
                assert picked == ()
                continue
            parts = torch.tensor_split(picked[0], len(mbs), dim=1)
            assert [t.tolist() for t in parts] == [full[j].tolist() for j in mbs]
    covered = [microbatch_rows(batch, m, range(j, j + 1)) for j in range(m)]
    assert [s.stop - s.start for s in covered] == [t.shape[1] for t in full]


@pytest.mark.parametrize("call, message", [
    (lambda: batch_layout("dualpipe", 4, 0, 7), r"num_chunks=7: must be a multiple of 2"),
    (lambda: batch_layout("dualpipe", 4, 4, 8), r"rank=4: must be >= 0 and <= 3"),
    (lambda: batch_layout("dualpipev", 2, True, 8), r"rank=True"),
    (lambda: batch_layout("dualpipev", 2, 0, 0), r"num_chunks=0: must be >= 1"),
    (lambda: batch_layout("nope", 2, 0, 4), r"schedule='nope': allowed are "),
    (lambda: batch_layout(3, 2, 0, 4), r"schedule=3: must be a registered name"),
    (lambda: batch_layout(registry.build("1f1b", 2, 4), 2, 0, 6), r"asked for num_ranks=2, num_chunks=6"),
    (lambda: batch_layout("1f1b", 2, 0, 4).inputs(torch.zeros(3)), r"batch_size=3: must be >= 4 \(num_chunks=4: one row per micro-batch"),
    (lambda: batch_layout("1f1b", 2, 0, 4).inputs([1, 2, 3, 4]), r"tensors\[0\] is a list"),
    (lambda: batch_layout("1f1b", 2, 0, 4).inputs(torch.zeros(4), dim=1), r"dim=1: tensors\[0\] has 1 dimension"),
])
def test_bad_input_is_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()
