"""Zero bubble composes with torch.compile and activation checkpointing.

Every schedule that splits B from W runs with compiled stages, checkpointed stages and both, in one
2-process gloo world, against a single-process eager reference: losses, outputs and gradients
bitwise where the arithmetic is the same (aot_eager, checkpointing; DualPipe's gradients, summed
over its mirrored copies, within 1e-13), within 1e-13 with inductor. The stages: the official
example's MLP, and a pre-norm LayerNorm + GELU MLP block (LayerNorm's weights not deferred).
In one process, eager against aot_eager over varied stages (norms, GELU and SwiGLU MLPs, causal
attention, deferred and plain Linears; a second input shape): bitwise, since aot_eager runs
eager's own ATen kernels; a backend that decomposes them (aot_eager_decomp_partition) within 1e-13.
A watcher on the pipeline's weight-gradient store checks that W really is deferred: no parameter's
``.grad`` changes while a deferred B runs, and every W changes its stage's weight gradients.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import models
from distributed import run_world
from twinpipe.runtime.weight_grad import DeferredLinear, GradStore, defer_weight_grads

WORLD = 2
SPLIT = ("zb-h1", "zb-h2", "zbv", "dualpipev", "dualpipe")
TOL = 1e-13


@dataclass(frozen=True)
class Case:
    schedule: str
    wrap: str  # compile | checkpoint | reentrant | compile+checkpoint | checkpoint+compile
    backend: str = "aot_eager"
    chunks: int = 4
    sabotage: bool = False  # force the store off, so weight gradients are computed during B
    stage: str = "mlp"  # a key of STAGES

    @property
    def id(self) -> str:
        backend = f"-{self.backend}" if "compile" in self.wrap else ""
        kind = "" if self.stage == "mlp" else f"-{self.stage}"
        return f"{self.schedule}-{self.wrap}{backend}-n{self.chunks}{kind}" + ("-sabotaged" if self.sabotage else "")


# ------------------------------------------------------------------------------ stages
H = models.HIDDEN


class LayerNormMLP(nn.Module):
    """Pre-norm block: ``x + down(gelu(up(norm(x))))`` (``tanh``: GELU's tanh approximation;
    ``plain``: nn.Linear, weight gradients not deferred)."""

    def __init__(self, tanh: bool = False, plain: bool = False):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(H), nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.approximate = "tanh" if tanh else "none"
        if not plain:
            defer_weight_grads(self)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x)), approximate=self.approximate))


class PostNormMLP(LayerNormMLP):
    """Post-norm: ``norm(x + down(gelu(up(x))))``."""

    def forward(self, x):
        return self.norm(x + self.down(nn.functional.gelu(self.up(x), approximate=self.approximate)))


class RMSSwiGLU(nn.Module):
    """``x + down(silu(gate(n)) * up(n))``, ``n = rmsnorm(x)`` (no biases)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(H)
        self.gate, self.up, self.down = (nn.Linear(a, b, bias=False) for a, b in ((H, 2 * H), (H, 2 * H), (2 * H, H)))
        defer_weight_grads(self)

    def forward(self, x):
        n = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(n)) * self.up(n))


class Attention(nn.Module):
    """Pre-norm causal self-attention with a residual (two heads, scaled_dot_product_attention)."""

    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.proj = nn.LayerNorm(H), nn.Linear(H, 3 * H), nn.Linear(H, H)
        defer_weight_grads(self)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, 2, h // 2).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, t, h))


STAGES = {
    "mlp": models.MLPStage,
    "layernorm-gelu-mlp": LayerNormMLP,
    "postnorm-tanh-gelu-mlp-plain": lambda: PostNormMLP(tanh=True, plain=True),
    "attention": Attention,
    "rmsnorm-swiglu": RMSSwiGLU,
}
# aot_eager runs eager's own ATen kernels, but each graph break (every deferred Linear is one) ends
# a compiled graph, whose backward adds up the gradient contributions a tensor gets inside it before
# autograd adds those from outside; eager adds them all in autograd's order. Three or more terms can
# round differently: RMSNorm (decomposed, it reads its input twice) under a residual around a
# deferred Linear does. LayerNorm is one op: one term.
BITWISE = ("mlp", "layernorm-gelu-mlp", "postnorm-tanh-gelu-mlp-plain", "attention")


class Checkpointed(nn.Module):
    """Recomputes ``inner``'s forward during backward (``torch.utils.checkpoint``)."""

    def __init__(self, inner: nn.Module, reentrant: bool = False):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, *xs):
        return checkpoint(self.inner, *xs, use_reentrant=self.reentrant)


class CountingBackend:
    """A compile backend that counts calls into what it compiled, so a case can prove it ran compiled code."""

    calls = 0

    def __init__(self, name: str):
        self.name = name

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        compiled = lookup_backend(self.name)(gm, example_inputs)

        def run(*args):
            CountingBackend.calls += 1
            return compiled(*args)

        return run


# One backend object per name: dynamo reuses compiled code across cases only for the same backend.
BACKENDS = {name: CountingBackend(name) for name in ("aot_eager", "inductor")}


def wrap_stage(module: nn.Module, case: Case) -> nn.Module:
    backend = BACKENDS[case.backend]
    if case.wrap == "compile":
        return torch.compile(module, backend=backend)
    if case.wrap == "checkpoint":
        return Checkpointed(module)
    if case.wrap == "reentrant":
        return Checkpointed(module, reentrant=True)
    if case.wrap == "compile+checkpoint":  # the checkpoint region inside the compiled module
        return torch.compile(Checkpointed(module), backend=backend)
    if case.wrap == "checkpoint+compile":  # a compiled module, recomputed by an eager checkpoint
        return Checkpointed(torch.compile(module, backend=backend))
    raise ValueError(f"wrap={case.wrap!r}")


class _StoreOff(GradStore):
    """A store that never turns on: every weight gradient is computed during B (deferral broken)."""

    enabled = property(lambda self: False, lambda self, value: None)


class DeferralWatch:
    """Wraps a pipeline's store and lists every weight gradient not deferred to its W."""

    def __init__(self, pipe, sabotage: bool):
        self.store = pipe.store
        if sabotage:
            self.store.__class__ = _StoreOff
        # Only DeferredLinear layers defer their weight gradients (a LayerNorm's are computed in B).
        self.params = {s: [p for layer in m.modules() if isinstance(layer, DeferredLinear) for p in layer.parameters(recurse=False)]
                       for s, m in zip(pipe.stages, pipe.module)}
        self.problems: list[str] = []
        self.deferred_bs = self.ws = 0
        self._last_b = None  # weight gradients before and after the latest backward graph run
        running, flush, pop = self.store.running_backward, self.store.flush, self.store.pop
        watch = self

        class _Running:  # the executor runs every backward graph inside store.running_backward()
            def __enter__(self):
                watch._last_b = None
                self.before = watch._grads(watch._all())
                self.inner = running()
                return self.inner.__enter__()

            def __exit__(self, *exc):
                self.inner.__exit__(*exc)
                watch._last_b = (self.before, watch._grads(watch._all()))

        def flushed(key=None):  # a flush follows exactly the backward graphs whose W is deferred
            if watch._last_b is not None:
                watch.deferred_bs += 1
                before, after = watch._last_b
                if not all(_same(a, b) for a, b in zip(before, after)):
                    watch.problems.append(f"B {key}: a deferred B changed weight gradients (W was not deferred)")
            watch._last_b = None
            flush(key)

        def popped(key=None):
            before = watch._grads(watch.params[key[0]])
            pop(key)
            watch.ws += 1
            if all(_same(a, b) for a, b in zip(before, watch._grads(watch.params[key[0]]))):
                watch.problems.append(f"W {key}: no weight gradient changed (nothing was deferred to it)")

        self.store.running_backward, self.store.flush, self.store.pop = _Running, flushed, popped

    def _all(self):
        return [p for ps in self.params.values() for p in ps]

    @staticmethod
    def _grads(params) -> list:
        return [None if p.grad is None else p.grad.clone() for p in params]


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _close(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    return torch.equal(a, b) if exact else models.grad_error(a, b) <= TOL


def run_case(rank: int, group, case: Case) -> list[str]:
    import twinpipe
    from twinpipe.schedule.registry import placement_for

    CountingBackend.calls = 0
    placement = placement_for(case.schedule, WORLD)
    model = models.make_model(STAGES[case.stage], placement.num_model_stages, seed=7)
    stages = [wrap_stage(copy.deepcopy(model[placement.model_stage(s)]), case) for s in placement.stages_of(rank)]
    torch.manual_seed(1234)
    n = case.chunks
    x = torch.randn(n * 2, 3, models.HIDDEN, dtype=torch.float64)
    if case.wrap == "reentrant":  # reentrant checkpoint drops the weight gradients of a stage whose inputs need none
        x.requires_grad_()
    label = torch.randn_like(x)
    xs, labels = [(t,) for t in torch.tensor_split(x, n)], list(torch.tensor_split(label, n))
    ref_losses, ref_outputs = models.reference(model, placement, xs, labels, models.mse)

    if case.schedule == "dualpipe":
        pipe = twinpipe.DualPipe(stages, process_group=group)
    elif case.schedule == "dualpipev":
        pipe = twinpipe.DualPipeV(stages, process_group=group)
    else:
        pipe = twinpipe.Pipeline(stages, case.schedule, process_group=group)
    watch = DeferralWatch(pipe, case.sabotage)

    args, labs, mbs = (), (), None
    for c, chain in enumerate(placement.chains):
        chain_mbs = list(placement.microbatches_of_chain(c, n))
        if chain[0] in pipe.stages:
            args = (torch.cat([xs[j][0] for j in chain_mbs]),)
        if chain[-1] in pipe.stages:
            labs, mbs = (torch.cat([labels[j] for j in chain_mbs]),), chain_mbs
    loss, outputs = pipe.step(*args, num_chunks=n, criterion=models.mse, labels=labs, return_outputs=True)

    problems = list(watch.problems)
    exact = case.backend != "inductor" or "compile" not in case.wrap
    if mbs is not None:
        expected = torch.stack([ref_losses[j].detach() for j in mbs])
        if not _close(loss, expected, exact):
            problems.append(f"loss {loss.tolist()} != reference {expected.tolist()}")
        out_ref = torch.cat([ref_outputs[j][0].detach() for j in mbs])
        if not _close(outputs, out_ref, exact):
            problems.append("outputs differ from the reference")
    if case.schedule == "dualpipe":
        pipe.sync_mirrored_grads()
    # DualPipe's mirrored copies add their gradients in another order than one process does.
    bitwise = exact and case.schedule != "dualpipe"
    for s, module in zip(placement.stages_of(rank), pipe.module):
        ref = model[placement.model_stage(s)]
        for (name, p), q in zip(module.named_parameters(), ref.parameters()):
            if p.grad is None or not _close(p.grad, q.grad, bitwise):
                err = "missing" if p.grad is None else f"error {models.grad_error(p.grad, q.grad):.3g}"
                problems.append(f"stage {s} {name}: gradient {err}{' (bitwise expected)' if bitwise else ''}")
    if watch.deferred_bs == 0 or watch.ws == 0:
        problems.append(f"the watcher saw {watch.deferred_bs} deferred B and {watch.ws} W ops")
    if case.wrap in ("compile", "checkpoint+compile") and CountingBackend.calls == 0:
        problems.append("no compiled code ran")
    return problems


# --------------------------------------------- one stage in one process: when is W decided?
def _one_backward(stage: nn.Module, x, store: GradStore, defer: bool, trace_with: bool | None = None) -> tuple[int, bool]:
    """Forward (with the store set to ``trace_with`` while it runs, if given), backward with the store
    set to ``defer``, then W; returns (closures filed, whether a .grad was set during backward)."""
    x = x.detach().requires_grad_()
    with store.active():
        store.enabled = defer if trace_with is None else trace_with
        out = stage(x)
        store.enabled = defer
        with store.running_backward():
            out.sum().backward()
        store.enabled = False
        set_during_b = any(p.grad is not None for p in stage.parameters())
        filed = len(store.cache)
        store.flush("k")
        store.pop("k")
    return filed, set_during_b


def _grads_equal(stage: nn.Module, eager: nn.Module) -> bool:
    return all(p.grad is not None and torch.equal(p.grad, q.grad) for p, q in zip(stage.parameters(), eager.parameters()))


def decided_at_backward(traced_on: bool) -> list[str]:
    """A stage compiled while the store was ``traced_on`` defers exactly when the store is on at B."""
    torch._dynamo.reset()  # trace afresh, with the store as this check sets it
    CountingBackend.calls = 0
    torch.manual_seed(0)
    eager = models.MLPStage().double()
    stage = copy.deepcopy(eager)
    compiled = torch.compile(stage, backend=BACKENDS["aot_eager"])
    store, problems = GradStore(), []
    for step, defer in enumerate((not traced_on, traced_on, not traced_on)):
        for p in (*stage.parameters(), *eager.parameters()):
            p.grad = None
        x = torch.randn(4, 3, models.HIDDEN, dtype=torch.float64)
        got = _one_backward(compiled, x, store, defer, trace_with=traced_on if step == 0 else None)
        if got != ((2, False) if defer else (0, True)):
            problems.append(f"run {step} with the store {'on' if defer else 'off'}: (closures filed, .grad set in B) = {got}")
        _one_backward(eager, x, GradStore(), False)
        if not _grads_equal(stage, eager):
            problems.append(f"run {step}: weight gradients differ from eager")
    if CountingBackend.calls == 0:
        problems.append("no compiled code ran")
    return problems


def compiled_autograd_defers_or_refuses() -> list[str]:
    """Compiled autograd traces backward functions: a deferred W still runs at W with the eager
    gradients; an immediate weight gradient, which it would silently drop, raises instead."""
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    eager = models.MLPStage().double()
    stage = copy.deepcopy(eager)
    store, problems = GradStore(), []
    x = torch.randn(4, 3, models.HIDDEN, dtype=torch.float64)
    with compiled_autograd._enable(torch.compile(backend=BACKENDS["aot_eager"])):
        got = _one_backward(stage, x, store, True)
    _one_backward(eager, x, GradStore(), False)
    if got != (2, False) or not _grads_equal(stage, eager):
        problems.append(f"deferred under compiled autograd: (closures filed, .grad set in B) = {got}, "
                        f"gradients equal to eager: {_grads_equal(stage, eager)}")
    for p in stage.parameters():
        p.grad = None
    with compiled_autograd._enable(torch.compile(backend=BACKENDS["aot_eager"])):
        try:
            got = _one_backward(stage, x, store, False)
            problems.append(f"an immediate weight gradient under compiled autograd did not raise ({got})")
        except RuntimeError as exc:
            if "compiled autograd" not in str(exc):
                problems.append(f"unexpected error: {exc}")
    return problems


def _backward(stage: nn.Module, x: torch.Tensor, g: torch.Tensor, defer: bool):
    """Output, input gradient and weight gradients of one forward and backward (with ``defer``, the
    weight gradients deferred during backward and run afterwards, as B then W)."""
    x = x.detach().requires_grad_()
    store = GradStore()
    with store.active():
        out = stage(x)
        store.enabled = defer
        with store.running_backward():
            out.backward(g)
        store.enabled = False
        store.flush("w")
        store.pop("w")
    return out.detach(), x.grad, [p.grad for p in stage.parameters()]


def eager_against_compiled(kind: str, backend: str) -> list[str]:
    """One stage of ``kind``, eager against ``torch.compile(backend=...)`` on the same weights and
    inputs (a second shape recompiles): outputs and gradients bitwise for aot_eager on the ``BITWISE``
    kinds, else within TOL."""
    torch.manual_seed(0)
    eager = STAGES[kind]().double()
    stage = copy.deepcopy(eager)
    counting = CountingBackend(backend)
    compiled = torch.compile(stage, backend=counting)
    exact = backend == "aot_eager" and kind in BITWISE
    problems = []
    for rows, defer in ((3, False), (3, True), (5, True)):
        for p in (*eager.parameters(), *stage.parameters()):
            p.grad = None
        x = torch.randn(2, rows, H, dtype=torch.float64)
        g = torch.randn_like(x)
        want, got = _backward(eager, x, g, False), _backward(compiled, x, g, defer)
        for what, a, b in [("output", got[0], want[0]), ("input gradient", got[1], want[1]),
                           *((f"gradient of {n}", a, b) for (n, _), a, b in zip(stage.named_parameters(), got[2], want[2]))]:
            if a is None or not _close(a, b, exact):
                err = "missing" if a is None else f"differs by {float((a - b).abs().max()):.3g}"
                problems.append(f"{rows} rows, W {'deferred' if defer else 'in backward'}: {what} {err}")
    if CountingBackend.calls == 0:
        problems.append("no compiled code ran")
    return problems


# In this order so that rank 0 runs both traced checks and rank 1 the compiled-autograd one (about as long).
LOCAL = {
    "traced-with-store-off": lambda: decided_at_backward(False),
    "compiled-autograd": compiled_autograd_defers_or_refuses,
    "traced-with-store-on": lambda: decided_at_backward(True),
}


# ----------------------------------------------------------------------------- the world
def run_all(rank: int, world: int, cases: list) -> dict[str, list[str]]:
    """The one-process checks first, check i on rank ``i % world`` alone (side by side, not one rank
    running them all while the other waits), then every pipeline case on both ranks."""
    import torch.distributed as dist

    torch._dynamo.config.recompile_limit = 64  # every case compiles fresh modules
    results = {}
    local = [name for name in cases if isinstance(name, str)]
    for name in local[rank::world]:
        results[name] = _reported(LOCAL[name])
    dist.barrier()
    for case in cases:
        if not isinstance(case, str):
            results[case.id] = _reported(lambda case=case: run_case(rank, dist.group.WORLD, case))
            dist.barrier()
    return results


def _reported(check) -> list[str]:
    """``check()``'s problems, an exception among them (report the case, keep the world going)."""
    try:
        return check()
    except Exception as exc:
        return [f"{type(exc).__name__}: {exc}"]


def _local(outcomes, name: str) -> list[str]:
    """The problems of one-process check ``name``, from the one rank that ran it."""
    found = [o[name] for o in outcomes if name in o]
    assert len(found) == 1, f"{name}: run by {len(found)} ranks"
    return found[0]


WRAPS = ("compile", "checkpoint", "reentrant", "checkpoint+compile")
CASES = [Case(s, w) for s in SPLIT for w in WRAPS] + [Case(s, "compile+checkpoint") for s in ("zb-h1", "dualpipev")]
CASES += [Case(s, w, stage="layernorm-gelu-mlp") for s in ("zbv", "dualpipev") for w in ("compile", "checkpoint+compile")]
# inductor compiles C++ on first use (~25 s on 2 cores with a cold cache): two cases share it.
INDUCTOR = [Case("dualpipev", "checkpoint+compile", "inductor"), Case("zb-h1", "compile", "inductor")]
SABOTAGED = [Case(s, w, sabotage=True) for s in ("zb-h1", "dualpipev") for w in ("compile", "checkpoint")]


@pytest.fixture(scope="module")
def outcomes():
    return run_world(WORLD, run_all, [*LOCAL, *CASES, *INDUCTOR, *SABOTAGED])


def _assert(outcomes, case):
    problems = {r: outcomes[r][case.id] for r in range(WORLD) if outcomes[r][case.id]}
    assert not problems, problems


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_exact_and_deferred(outcomes, case):
    _assert(outcomes, case)


@pytest.mark.parametrize("case", INDUCTOR, ids=lambda c: c.id)
def test_inductor_within_tolerance_and_deferred(outcomes, case):
    _assert(outcomes, case)


@pytest.mark.parametrize("case", SABOTAGED, ids=lambda c: c.id)
def test_watch_catches_weight_grads_computed_during_b(outcomes, case):
    problems = [p for r in range(WORLD) for p in outcomes[r][case.id]]
    assert any("deferred B changed weight gradients" in p for p in problems), problems


@pytest.mark.parametrize("name", ("traced-with-store-off", "traced-with-store-on"))
def test_deferral_is_decided_when_backward_runs_not_when_traced(outcomes, name):
    assert _local(outcomes, name) == []


def test_compiled_autograd_defers_exactly_or_refuses_to_lose_weight_grads(outcomes):
    assert _local(outcomes, "compiled-autograd") == []


@pytest.mark.parametrize("kind", [k for k in BITWISE if k != "mlp"])  # the MLP: in every pipeline case above
def test_aot_eager_stage_is_bitwise_eager(kind):
    assert eager_against_compiled(kind, "aot_eager") == []


@pytest.mark.parametrize("kind, backend", [("rmsnorm-swiglu", "aot_eager"), ("layernorm-gelu-mlp", "aot_eager_decomp_partition")])
def test_compiled_stage_within_tolerance(kind, backend):
    assert eager_against_compiled(kind, backend) == []


def test_aot_eager_regroups_a_gradient_sum_across_a_graph_break():
    """``x + Linear(RMSNorm(x))``, the Linear deferred (a graph break): x's gradient has three terms,
    two summed inside the compiled norm's backward first; eager adds them in another order."""

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = nn.RMSNorm(H), DeferredLinear(H, H)

        def forward(self, x):
            return x + self.lin(self.norm(x))

    torch.manual_seed(0)
    eager = Stage().double()
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager")
    differ = 0
    for _ in range(5):
        x = torch.randn(2, 3, H, dtype=torch.float64)
        g = torch.randn_like(x)
        (_, want, _), (_, got, _) = _backward(eager, x, g, False), _backward(compiled, x, g, False)
        assert models.grad_error(got, want) <= TOL
        differ += not torch.equal(got, want)
    assert differ > 0, "bitwise in 5 of 5 inputs: docs/compose.md says aot_eager can differ here"
