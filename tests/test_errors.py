"""Bad input gets a clear error; a rank that fails makes the others fail in bounded time.

Every case gets a fresh sub-group, so that a case that leaves messages unmatched on purpose
cannot disturb the next one.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from distributed import run_cases, run_world

WORLD = 3
TIMEOUT = 3.0


class ViewStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(models.HIDDEN, models.HIDDEN).double()

    def forward(self, x):
        return self.lin(x)[:, :]  # a view


class FailingStage(models.MLPStage):
    """Raises on its third forward."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("boom: user code failed")
        return super().forward(x)


def _x(n=4):
    return torch.randn(2 * n, 3, models.HIDDEN, dtype=torch.float64)


def _error(fn):
    """Run fn; return (exception type name, message, seconds) or ('none', '', s)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # the test inspects what came out
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "none", "", time.monotonic() - start


def _pipeline(group, ranks, kinds=None, schedule="dualpipev", **kw):
    import twinpipe

    rank = dist.get_rank(group)
    stages = twinpipe.stages_of_rank(schedule, ranks, rank)
    kinds = kinds or {}
    mods = [kinds.get(s, models.MLPStage)().double() for s in stages]
    return twinpipe.Pipeline(mods, schedule, process_group=group, timeout=TIMEOUT, **kw)


def case_bad_num_chunks(group):
    pipe = _pipeline(group, 2)
    out = [_error(lambda n=n: pipe.step(_x(), num_chunks=n, criterion=models.mse, labels=(_x(),))) for n in (0, -2, "4")]
    return out


def case_dualpipe_odd_chunks(group):
    pipe = _pipeline(group, 2, schedule="dualpipe")
    return [_error(lambda: pipe.step(_x(), num_chunks=3, criterion=models.mse, labels=(_x(),)))]


def case_dualpipe_odd_ranks(group):
    import twinpipe

    return [_error(lambda: twinpipe.DualPipe([models.MLPStage().double()] * 2, process_group=group))]


def case_wrong_module_count(group):
    import twinpipe

    return [_error(lambda: twinpipe.DualPipeV([models.MLPStage().double()], process_group=group))]


def case_missing_criterion(group):
    pipe = _pipeline(group, 2)
    return [_error(lambda: pipe.step(_x(), num_chunks=4))]


def case_view(group):
    pipe = _pipeline(group, 2, kinds={0: ViewStage})
    return [_error(lambda: pipe.step(_x(), num_chunks=4, criterion=models.mse, labels=(_x(),)))]


def case_declared_shapes_mismatch(group):
    pipe = _pipeline(group, 2, tensor_shapes=[(2, 3, 99)], tensor_dtype=torch.float64)
    return [_error(lambda: pipe.step(_x(), num_chunks=4, criterion=models.mse, labels=(_x(),)))]


def case_shapes_change_between_steps(group):
    pipe = _pipeline(group, 2)
    first = _error(lambda: pipe.step(_x(), num_chunks=4, criterion=models.mse, labels=(_x(),)))
    x = torch.randn(8, 5, models.HIDDEN, dtype=torch.float64)  # another sequence length
    second = _error(lambda: pipe.step(x, num_chunks=4, criterion=models.mse, labels=(x,)))
    return [first, second]


def case_dynamic_shapes_allow_change(group):
    pipe = _pipeline(group, 2, dynamic_shapes=True)
    out = []
    for seq in (3, 5):
        x = torch.randn(8, seq, models.HIDDEN, dtype=torch.float64)
        out.append(_error(lambda: pipe.step(x, num_chunks=4, criterion=models.mse, labels=(x,))))
    return out


def case_rank_raises_mid_step(group):
    pipe = _pipeline(group, 3, kinds={1: FailingStage})
    return [_error(lambda: pipe.step(_x(), num_chunks=6, criterion=models.mse, labels=(_x(),)))]


def case_absurd_num_chunks(group):
    """A registered schedule and a user's generator meet the same size limit, before any work."""
    import twinpipe
    from twinpipe.schedule.registry import get

    out = []
    for schedule in ("1f1b", get("1f1b").generator):
        pipe = twinpipe.Pipeline([models.MLPStage().double()], schedule, process_group=group, timeout=TIMEOUT)
        out.append(_error(lambda: pipe.step(_x(), num_chunks=10**5, criterion=models.mse, labels=(_x(),))))
    return out


CASES = {
    "bad_num_chunks": (2, case_bad_num_chunks),
    "absurd_num_chunks": (2, case_absurd_num_chunks),
    "dualpipe_odd_chunks": (2, case_dualpipe_odd_chunks),
    "dualpipe_odd_ranks": (3, case_dualpipe_odd_ranks),
    "wrong_module_count": (2, case_wrong_module_count),
    "missing_criterion": (2, case_missing_criterion),
    "view": (2, case_view),
    "declared_shapes_mismatch": (2, case_declared_shapes_mismatch),
    "shapes_change_between_steps": (2, case_shapes_change_between_steps),
    "dynamic_shapes_allow_change": (2, case_dynamic_shapes_allow_change),
    "rank_raises_mid_step": (3, case_rank_raises_mid_step),
}


@pytest.fixture(scope="module")
def out():
    return run_world(WORLD, run_cases, CASES)


def test_bad_num_chunks(out):
    for rank in (0, 1):
        for kind, msg, _ in out[rank]["bad_num_chunks"]:
            assert kind == "ValueError" and "num_chunks" in msg


def test_absurd_num_chunks_fail_fast(out):
    for rank in (0, 1):
        for kind, msg, seconds in out[rank]["absurd_num_chunks"]:
            assert kind in ("ValueError", "PipelineAbortedError") and "100000" in msg, (kind, msg)
            assert seconds < TIMEOUT


def test_dualpipe_needs_even_chunks(out):
    kind, msg, _ = out[0]["dualpipe_odd_chunks"][0]
    assert kind == "ValueError" and "num_chunks=3" in msg and "even" in msg


def test_dualpipe_needs_even_ranks(out):
    kind, msg, _ = out[0]["dualpipe_odd_ranks"][0]
    assert kind == "ValueError" and "even" in msg and "3" in msg


def test_wrong_module_count(out):
    kind, msg, _ = out[0]["wrong_module_count"][0]
    assert kind == "ValueError" and "needs 2 module(s)" in msg


def test_missing_criterion_is_named_and_peer_learns_at_once(out):
    kind, msg, _ = out[0]["missing_criterion"][0]  # rank 0 holds the last stage of the V
    assert kind == "ValueError" and "criterion" in msg
    kind, msg, seconds = out[1]["missing_criterion"][0]
    assert kind == "PipelineAbortedError" and "rank 1" in msg and "rank 0 rejected it" in msg and "criterion" in msg
    assert seconds < TIMEOUT


def test_view_output_is_accepted(out):
    for rank in (0, 1):
        assert out[rank]["view"][0][0] == "none", out[rank]["view"][0]


def test_declared_shape_mismatch(out):
    kinds = {out[r]["declared_shapes_mismatch"][0][0] for r in (0, 1)}
    msgs = " ".join(out[r]["declared_shapes_mismatch"][0][1] for r in (0, 1))
    assert "ValueError" in kinds and "99" in msgs and "expects" in msgs


def test_shapes_changing_between_steps_is_caught(out):
    first, second = out[0]["shapes_change_between_steps"]
    assert first[0] == "none"
    kinds = {out[r]["shapes_change_between_steps"][1][0] for r in (0, 1)}
    assert kinds == {"ValueError", "PipelinePeerFailedError"}, kinds  # the receiver hears of the sender's error
    assert any("dynamic_shapes=True" in out[r]["shapes_change_between_steps"][1][1] for r in (0, 1))


def test_dynamic_shapes(out):
    for rank in (0, 1):
        assert [k for k, _, _ in out[rank]["dynamic_shapes_allow_change"]] == ["none", "none"]


def test_failing_rank_brings_others_down_in_bounded_time(out):
    kind, msg, _ = out[1]["rank_raises_mid_step"][0]
    assert kind == "RuntimeError" and "boom" in msg
    for rank in (0, 2):
        kind, msg, seconds = out[rank]["rank_raises_mid_step"][0]
        assert kind == "PipelinePeerFailedError" and "boom" in msg, msg  # told at once, not at the timeout
        assert f"rank {rank}" in msg and "waiting for" in msg
        assert seconds < 2 * TIMEOUT + 5
