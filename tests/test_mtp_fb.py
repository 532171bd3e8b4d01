"""Parts a last stage's criterion adds (``twinpipe.overlap.tail``; DeepSeek-V3's MTP layers) run in the
stage's record: one backward for all of them, and in F&B ops interleaved with the other
micro-batch's parts. On one process with a toy stage, then DeepSeek-V3 with MTP and EP=2 (2 gloo
processes, each rank a one-rank pipeline): the MTP layer's dispatch and combine in the F&B ops'
part order, in flight while the other micro-batch computes, its weight gradients in W steps.
(Exactness against the unsplit model: tests/test_hf_mtp.py.)"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from distributed import run_world
from exactness import TOL
from models import grad_error
from twinpipe.overlap import Comm, Compute, Done, PartedStage, forward_backward
from twinpipe.overlap.graph import capture_backward

MTP_COMM = ("mtp1.dispatch", "mtp1.combine")  # the MTP layer's all-to-alls, as the F&B ops name them


# ---------------------------------------------------------------- the mechanism, on one process
class _Stage(PartedStage):
    """A linear, then a 'send' that adds a constant (no real comm)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()

    def parts(self):
        return [Compute("lin", lambda x: (self.lin(x),)),
                Comm("send", lambda y: Done(((y + 1.0,), None)), lambda ctx, g: Done(g))]


class _Criterion:
    """Adds parts that read the labels: ``w = block(y * target + 0.5)``, with a 'send' between; the
    loss is ``|y - target|^2 + |w|^2``."""

    def __init__(self):
        self.block = nn.Linear(4, 4).double()

    def stage_parts(self, target):
        return [Compute("tail.in", lambda y: (y, y * target)),
                Comm("tail.send", lambda y, z: Done(((y, z + 0.5), None)), lambda ctx, g: Done(g)),
                Compute("tail.block", lambda y, z: (y, self.block(z)))]

    def __call__(self, y, target):
        from twinpipe.overlap.tail import with_tail

        y, w = with_tail((y,), self.stage_parts(target))
        return (y - target).square().sum() + w.square().sum()


def _reference(stage, criterion, x, target):
    y = stage.lin(x) + 1.0
    return (y - target).square().sum() + criterion.block(y * target + 0.5).square().sum()


def _pair():
    torch.manual_seed(0)
    stage, criterion = _Stage(), _Criterion()
    ref_stage, ref_criterion = copy.deepcopy(stage), copy.deepcopy(criterion)
    x, target = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    return stage, criterion, ref_stage, ref_criterion, x, target


def _grads_match(modules, refs) -> None:
    for module, ref in zip(modules, refs):
        for (name, p), q in zip(module.named_parameters(), ref.parameters()):
            assert grad_error(p.grad, q.grad) <= TOL, name


def test_a_criterions_parts_join_the_stage_record_after_a_plain_forward():
    """Stage, then criterion: one record holds the stage's parts and the criterion's (an F&B op's
    backward captures it whole), and gradients are plain autograd's."""
    stage, criterion, ref_stage, ref_criterion, x, target = _pair()
    loss = criterion(stage(x), target)
    captured = capture_backward([loss], [torch.ones_like(loss)])
    assert [[p.name for p in record.parts] for record, _ in captured] == [["lin", "send", "tail.in", "tail.send", "tail.block"]]
    loss = criterion(stage(x), target)
    want = _reference(ref_stage, ref_criterion, x, target)
    assert torch.equal(loss, want)
    stage.zero_grad()
    criterion.block.zero_grad()
    loss.backward()
    want.backward()
    _grads_match([stage, criterion.block], [ref_stage, ref_criterion.block])


def test_an_fb_op_interleaves_a_criterions_parts_in_both_directions():
    """F&B of the last stage on one micro-batch with the backward of another: the criterion's comm
    part in flight in F and in B while the other stream computes; loss and gradients as F then BW."""
    stage, criterion, ref_stage, ref_criterion, x, target = _pair()
    x1, target1 = x.flip(0).clone().requires_grad_(), target.flip(0).clone()
    loss1 = criterion(stage(x1), target1)
    outputs0, loss0, events = forward_backward(stage, [x], criterion, [target], stage, loss1, [], [])
    steps = [(action, stream, part) for action, stream, part, *_ in events]
    assert ("start", "F", "tail.send") in steps and ("start", "B", "tail.send") in steps
    for stream, other in (("F", "B"), ("B", "F")):
        begin, end = steps.index(("start", stream, "tail.send")), steps.index(("wait", stream, "tail.send"))
        assert any(a == "run" and s == other for a, s, _ in steps[begin:end]), (stream, steps)
    r1 = x1.detach().clone().requires_grad_()
    want1 = _reference(ref_stage, ref_criterion, r1, target1)
    want0 = _reference(ref_stage, ref_criterion, x, target)
    assert torch.equal(loss0, want0) and torch.equal(outputs0[0], ref_stage.lin(x) + 1.0)
    want1.backward()
    assert grad_error(x1.grad, r1.grad) <= TOL
    _grads_match([stage, criterion.block], [ref_stage, ref_criterion.block])


def test_a_criterion_without_parts_leaves_the_stage_record_as_it_was():
    stage, _, _, _, x, target = _pair()
    loss = (stage(x) - target).square().sum()
    (record, _), = capture_backward([loss], [torch.ones_like(loss)])
    assert [p.name for p in record.parts] == ["lin", "send"]


# ---------------------------------------------------------------- DeepSeek-V3 with MTP, EP=2
def _mtp_fb(group) -> list:
    """This rank's one-rank DualPipeV pipeline (both stages, MoE layers in parts, the MTP layer's experts
    spread over the 2 ranks as the main layers'), one training step: what its F&B ops did with
    the MTP layer's parts."""
    import hf_models
    from twinpipe import hf
    from twinpipe.hf.experts import shard_experts_
    from twinpipe.hf.moe_layer import wrap_layer

    rank = torch.distributed.get_rank(group)
    pp_group = [torch.distributed.new_group([0]), torch.distributed.new_group([1])][rank]
    model = shard_experts_(hf_models.model("deepseek_v3", layers=5), group)
    # Stage 0 longer than the last stage (its four layers): the F&B ops' other micro-batch still
    # computes while the last stage's MTP layer, at the end of its forward, exchanges tokens.
    stages = hf.build(model, "dualpipev", 1, 0, layout="E,t,t,t,t|t,L", mtp_depth=1, wrap_layer=wrap_layer)
    ids, mask, labels = hf_models.batch(4, 8, seed=1 + rank)
    with stages.pipeline(pp_group, timeout=60) as pipe:
        inputs, labs = stages.batch(ids, mask, labels, num_chunks=4)
        pipe.step(*inputs, num_chunks=4, criterion=stages.criterion, labels=labs)
    ops = [[(action, stream, part) for action, stream, part, *_ in e] for m in stages.modules for e in m.fb_events]
    problems = []
    for stream in ("F", "B"):
        for part in MTP_COMM:
            if not any(_hidden(steps, stream, part) for steps in ops):
                problems.append(f"no F&B op with {part}({stream}) in flight while another stream computes")
    if not any(("run", "W", "mtp1.in") in steps for steps in ops):
        problems.append("no F&B op runs the MTP layer input projection's weight gradients as a W step")
    return problems


def _hidden(steps: list, stream: str, part: str) -> bool:
    """Comm ``part`` of ``stream`` started in these steps, and a part of another stream (the other
    micro-batch's, or W) run before its wait."""
    if ("start", stream, part) not in steps:
        return False
    flight = steps[steps.index(("start", stream, part)):steps.index(("wait", stream, part))]
    return any(action == "run" and other != stream for action, other, _ in flight)


def _world(rank: int, world: int) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    try:
        return {"mtp-fb": _mtp_fb(dist.group.WORLD)}
    except Exception as exc:
        return {"mtp-fb": [f"{type(exc).__name__}: {exc}"]}


@pytest.fixture(scope="module")
def world():
    pytest.importorskip("transformers", reason="twinpipe.hf needs transformers (pip install twinpipe[hf])")
    return run_world(2, _world, timeout=300)


def test_the_mtp_layers_all_to_alls_are_in_the_fb_ops_part_order_hidden_by_the_other_microbatch(world):
    assert [r["mtp-fb"] for r in world] == [[], []]


def test_the_hf_page_says_what_this_module_checks():
    text = (Path(__file__).resolve().parents[1] / "docs" / "hf.md").read_text()
    assert all(f"`{part}`" in text for part in MTP_COMM) and "tests/test_mtp_fb.py" in text
