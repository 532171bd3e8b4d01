"""The part-level F&B overlap: its order, its prediction, the part protocol, and PP=2 x EP=2
pipelines (4 gloo processes) with overlap on and off against the single-process reference."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import moe_models as mm
from distributed import run_world
from exactness import TOL
from models import grad_error
from twinpipe.overlap import Comm, Compute, Done, PartedStage, Step, fb_order, forward_backward, predict_fb

LAYER_F = ["attn", "dispatch", "mlp", "combine", "mix"]
KIND = {"attn": "compute", "dispatch": "comm", "mlp": "compute", "combine": "comm", "mix": "compute"}


def _named_order(layers: int, overlap: bool = True) -> list[str]:
    f = LAYER_F * layers
    b = list(reversed(f))
    names = {"F": f, "B": b, "W": b}
    return [f"{s.action} {names[s.stream][s.index]}({s.stream})"
            for s in fb_order([KIND[n] for n in f], [KIND[n] for n in b], overlap)]


def test_order_hides_every_comm_behind_the_other_stream():
    """DeepSeek's layer order, as steps: each comm of one micro-batch is in flight while the
    other micro-batch computes, and W fills the time when both wait."""
    order = _named_order(2)
    flying, hidden = {"F": set(), "B": set()}, set()
    for step in order:
        action, rest = step.split(" ")
        name, stream = rest[:-3], rest[-2]
        if action == "start":
            flying[stream].add(name + str(len(hidden)))
        elif action == "wait":
            flying[stream] = {n for n in flying[stream] if not n.startswith(name)}
        elif stream != "W" and flying["B" if stream == "F" else "F"]:
            hidden.add(("B" if stream == "F" else "F"))
    assert hidden == {"F", "B"}
    # DeepSeek: combine(B) attn(F) mlp(B) dispatch(F) dispatch(B) mlp(W) mlp(F) attn(B) attn(W) combine(F)
    first = [s for s in order if not s.startswith("wait")][:9]
    assert first == ["run mix(B)", "start combine(B)", "run attn(F)", "start dispatch(F)", "run mix(W)",
                     "run mlp(B)", "start dispatch(B)", "run mlp(W)", "run mlp(F)"]


def test_order_without_overlap_is_f_then_b():
    order = _named_order(1, overlap=False)
    assert order[:7] == ["run attn(F)", "start dispatch(F)", "wait dispatch(F)", "run mlp(F)",
                         "start combine(F)", "wait combine(F)", "run mix(F)"]
    assert all("(F)" not in s for s in order[7:])


def test_fb_order_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="forward"):
        fb_order(["compute", "gemm"], [])


def test_prediction():
    f = [(KIND[n], 1.0) for n in LAYER_F]
    b = [(KIND[n], 1.0) for n in reversed(LAYER_F)]
    assert predict_fb(f, b, overlap=False) == 10.0
    assert predict_fb(f, b) < 10.0
    no_comm = [(k, 0.0 if k == "comm" else t) for k, t in f]
    assert predict_fb(no_comm, [(k, 0.0 if k == "comm" else t) for k, t in b], [0.5] * 5) == 6 + 3 * 0.5  # W follows compute parts only
    with pytest.raises(ValueError, match="weight"):
        predict_fb(f, b, [1.0])


def _deepseek_order(layers: int) -> list[Step]:
    """DeepSeek's published per-layer order, combine(B) attn(F) mlp(B) dispatch(F) dispatch(B)
    mlp(W) mlp(F) attn(B) attn(W) combine(F), as steps over our five parts (mix runs next to attn)."""
    back = list(reversed(LAYER_F))
    steps = []
    for j in range(layers):
        f, b = (lambda p: 5 * j + LAYER_F.index(p)), (lambda p: 5 * j + back.index(p))
        steps += [Step("run", "B", b("mix")), Step("start", "B", b("combine"))]
        if j:
            steps += [Step("wait", "F", 5 * (j - 1) + 3), Step("run", "F", 5 * (j - 1) + 4)]
        steps += [Step("run", "F", f("attn")), Step("wait", "B", b("combine")), Step("run", "B", b("mlp")),
                  Step("start", "F", f("dispatch")), Step("start", "B", b("dispatch")), Step("run", "W", b("mlp")),
                  Step("wait", "F", f("dispatch")), Step("run", "F", f("mlp")), Step("wait", "B", b("dispatch")),
                  Step("run", "B", b("attn")), Step("run", "W", b("attn")), Step("run", "W", b("mix")),
                  Step("start", "F", f("combine"))]
    return steps + [Step("wait", "F", 5 * layers - 2), Step("run", "F", 5 * layers - 1)]


def test_order_is_never_slower_than_deepseeks():
    """On random part times (one link, compute one part at a time), our order's predicted F&B
    time is at most that of DeepSeek's order: it issues every comm at least as early."""
    rng = random.Random(0)
    f_kinds = [KIND[n] for n in LAYER_F * 2]
    b_kinds = list(reversed(f_kinds))
    theirs = _deepseek_order(2)
    for _ in range(300):
        f = [(k, rng.uniform(0, 2)) for k in f_kinds]
        b = [(k, rng.uniform(0, 2)) for k in b_kinds]
        w = [rng.uniform(0, 1) for _ in b_kinds]
        assert predict_fb(f, b, w) <= predict_fb(f, b, w, order=theirs) + 1e-12


def test_prediction_rejects_foreign_orders():
    f = [(KIND[n], 1.0) for n in LAYER_F]
    b = [(KIND[n], 1.0) for n in reversed(LAYER_F)]
    with pytest.raises(ValueError, match="order"):
        predict_fb(f, b, order=_deepseek_order(1)[:-1])
    swapped = _deepseek_order(1)
    swapped[1], swapped[5] = swapped[5], swapped[1]  # wait for combine(B) before starting it
    with pytest.raises(ValueError, match="before its start"):
        predict_fb(f, b, order=swapped)


# ---------------------------------------------------------------- the protocol, on one process
class _Shift(PartedStage):
    """A user's own stage: scale, a 'send' that adds a constant (no real comm), a linear."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def parts(self):
        return [
            Compute("scale", lambda x: (x * self.scale, x)),
            Comm("send", lambda y, x: Done(((y + 1.0, x), None)), lambda ctx, g: Done(g)),
            Compute("lin", lambda y, x: (self.lin(y) + x,)),
        ]


def _plain(stage, x):
    return stage.lin(x * stage.scale + 1.0) + x


def test_user_stage_gradients_equal_plain_autograd():
    torch.manual_seed(0)
    stage = _Shift()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out = stage(x)
    ref = copy.deepcopy(stage)
    want = _plain(ref, x2)
    assert torch.equal(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    assert grad_error(x.grad, x2.grad) <= TOL
    for p, q in zip(stage.parameters(), ref.parameters()):
        assert grad_error(p.grad, q.grad) <= TOL


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_on_one_rank_equals_f_then_bw(overlap):
    """F&B through the engine: outputs, loss and every gradient as F then a full backward."""
    torch.manual_seed(1)
    stages = [mm.make_stage("grouped", blocks=2, uneven=True) for _ in range(2)]
    refs = copy.deepcopy(stages)
    x0, x1 = (torch.randn(2, mm.SEQ, mm.HIDDEN, dtype=torch.float64) for _ in range(2))
    label = torch.randn_like(x0)
    inputs1 = x1.clone().requires_grad_()
    out1 = stages[1](inputs1)
    g1 = torch.randn_like(out1)
    outputs0, loss0, events = forward_backward(stages[0], [x0], mm.mse, [label], stages[1], None, [out1], [g1], overlap=overlap)
    r_in1 = x1.clone().requires_grad_()
    r_out1 = refs[1](r_in1)
    r_out0 = refs[0](x0)
    r_loss0 = mm.mse(r_out0, label)
    r_out1.backward(g1)
    assert torch.equal(outputs0[0], r_out0) and torch.equal(loss0, r_loss0)
    assert grad_error(inputs1.grad, r_in1.grad) <= TOL
    for stage, ref in zip(stages, refs):
        for (name, p), q in zip(stage.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert grad_error(p.grad, q.grad) <= TOL, name
    assert mm.interleaved(events) == overlap


class _Checkpointed(_Shift):
    """The same stage with its last part under activation checkpointing (recomputed in backward)."""

    def parts(self):
        first, send, last = super().parts()
        return [first, send, Compute("lin", lambda y, x: torch.utils.checkpoint.checkpoint(last.fn, y, x, use_reentrant=False))]


def test_engine_composes_with_activation_checkpointing():
    torch.manual_seed(2)
    stages = [_Checkpointed(), _Checkpointed()]
    refs = copy.deepcopy(stages)
    x0, x1, g1 = (torch.randn(3, 4, dtype=torch.float64) for _ in range(3))
    out1 = stages[1](x1)
    outputs0, _, events = forward_backward(stages[0], [x0], None, [], stages[1], None, [out1], [g1])
    assert torch.equal(outputs0[0], _plain(refs[0], x0))
    _plain(refs[1], x1).backward(g1)
    for p, q in zip(stages[1].parameters(), refs[1].parameters()):
        assert grad_error(p.grad, q.grad) <= TOL
    assert [e[2] for e in events if e[0] == "run" and e[1] == "B"] == ["lin", "scale"]


def test_parted_sequential_mixes_plain_modules_and_part_layers():
    """An embedding-like Linear, a MoE block and a Tanh as one stage: plain autograd's results,
    and through an F&B op the plain modules are compute parts like any other."""
    from twinpipe.overlap import PartedSequential

    torch.manual_seed(3)
    make = lambda: PartedSequential([nn.Linear(mm.HIDDEN, mm.HIDDEN), mm.make_stage("grouped").blocks[0], nn.Tanh()]).double()
    stage = make()
    ref = copy.deepcopy(stage)
    x = torch.randn(2, mm.SEQ, mm.HIDDEN, dtype=torch.float64)
    out = stage(x)
    lin, block, tanh = ref.layers
    want = tanh(mm.reference_block(block, [lin(x)])[0])
    assert torch.equal(out, want)
    out.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(stage.named_parameters(), ref.parameters()):
        assert grad_error(p.grad, q.grad) <= TOL, name
    assert [p.name for p in stage.parts()][0] == "0.Linear" and stage.parts()[1].name == "1.attn"
    other = make()
    out1 = other(x)
    _, _, events = forward_backward(make(), [x], None, [], other, None, [out1], [torch.ones_like(out1)])
    assert mm.interleaved(events)  # the order comes from the kinds, with or without real comm
    assert {e[2] for e in events if e[1] == "B"} >= {"0.Linear", "1.mlp", "2.Tanh"}
    with pytest.raises(ValueError, match="layers"):
        PartedSequential([])


class _Bad(PartedStage):
    def __init__(self, parts):
        super().__init__()
        self._parts = parts

    def parts(self):
        return self._parts


@pytest.mark.parametrize("parts,match", [
    ([], "non-empty"),
    ([lambda x: x], "allowed are Compute and Comm"),
    ([Compute("a", lambda x: x * 2)], "must be a tuple"),
    ([Compute("a", lambda x: (x, "meta"))], "tensors only"),
    ([Comm("c", lambda x: Done((x,)), lambda ctx, g: Done(g))], r"\(state, ctx\)"),
])
def test_inconsistent_parts_are_rejected(parts, match):
    with pytest.raises(ValueError, match=match):
        _Bad(parts)(torch.randn(2, requires_grad=True))


def test_comm_backward_must_give_one_gradient_per_input():
    stage = _Bad([Compute("a", lambda x: (x * 2, x * 3)),
                  Comm("c", lambda y, z: Done(((y + z,), None)), lambda ctx, g: Done(g)),
                  Compute("b", lambda y: (y * 1,))])
    out = stage(torch.randn(2, requires_grad=True))
    with pytest.raises(ValueError, match="gave 1 gradients for 2 input entries"):
        out.sum().backward()


# ---------------------------------------------------------------- PP=2 x EP=2
PIPE_CASES = [
    ("dualpipev", True, "grouped", True), ("dualpipev", False, "grouped", True),
    ("dualpipe", True, "shared", False), ("dualpipe", False, "softmax", True),
    ("1f1b", True, "shared", True), ("1f1b", False, "grouped", False),
]


def _world(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    return mm.run_pipeline_cases(mesh, PIPE_CASES)


@pytest.fixture(scope="module")
def outcomes():
    return run_world(4, _world, timeout=300)


@pytest.mark.parametrize("case", PIPE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_pp2_ep2_pipeline_matches_reference(outcomes, case):
    """Losses bitwise, gradients within 1e-13; with overlap the F&B parts interleave, without not."""
    assert {r: o[case] for r, o in enumerate(outcomes) if o[case]} == {}


def test_comm_hidden_counts_compute_under_comm_in_flight():
    from twinpipe.overlap import comm_hidden

    events = [("start", "B", "c", 0.0, 0.1), ("run", "F", "a", 0.1, 0.6), ("wait", "B", "c", 0.6, 1.0),
              ("start", "F", "d", 1.0, 1.0), ("wait", "F", "d", 1.0, 1.5)]
    in_flight, hidden = comm_hidden(events)
    assert in_flight == pytest.approx(1.5) and hidden == pytest.approx(0.5)
    from twinpipe.overlap import fb_spans

    assert fb_spans(events) == [("parts", "a(F)", 0.1, 0.6), ("comm B", "c(B)", 0.0, 1.0), ("comm F", "d(F)", 1.0, 1.5)]


def test_comm_without_backward_hands_gradients_back_unchanged():
    """A comm part with no start_backward (a metadata exchange) is an empty step in backward."""
    stage = _Bad([Compute("a", lambda x: (x * 2, None)), Comm("meta", lambda y, m: Done(((y, 3), None))),
                  Compute("b", lambda y, m: (y * m,))])
    x = torch.randn(2, dtype=torch.float64, requires_grad=True)
    stage(x).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 6.0))
    shrinking = _Bad([Compute("a", lambda x: (x * 2, None)), Comm("meta", lambda y, m: Done(((y,), None))),
                      Compute("b", lambda y: (y * 1,))])
    with pytest.raises(ValueError, match="must keep its 2 entries"):
        shrinking(torch.randn(2, requires_grad=True)).sum().backward()
