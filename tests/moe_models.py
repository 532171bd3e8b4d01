"""Tiny MoE stages and a single-process reference with all experts local, for the MoE tests.

The reference follows expert parallelism's arithmetic without its machinery, as
docs/moe-overlap.md ("The order of every sum") writes it down: each EP rank's tokens go through
attention, router and shared expert on their own (as on that rank); each expert slot runs once on
the rows routed to it from every rank, rank by rank in token order (the order in which the
all-to-all delivers them; ``run_expert``, as the block runs a slot); the outputs are mixed back
per token, top-k terms left to right, then the shared expert, then the residual. Plain autograd,
no parts. With a placement (``phy2log``), copies are spread over an expert's replicas by the rule
of ``twinpipe.moe.placement`` (written out again here): each replica runs on its own rows, as the
real block runs it (fewer rows per product than one slot per expert would give: on some CPUs not
the same bits).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from twinpipe.moe import MoEBlock, MoEStage, reduce_replica_grads
from twinpipe.moe.block import run_expert
from twinpipe.overlap import Comm, Compute, PartedStage, Then, all_to_all

HIDDEN, SEQ = 8, 3

VARIANTS = {
    "softmax": dict(score="softmax"),
    "shared": dict(score="softmax", shared_hidden=6),
    "grouped": dict(score="sigmoid", groups=2, top_groups=1, shared_hidden=4, swiglu=True, route_scale=2.5),
}


def make_stage(variant: str = "shared", blocks: int = 1, experts: int = 4, top_k: int = 2, uneven=False) -> MoEStage:
    """One stage with all experts (float64). ``uneven=True``: expert 0 takes most token copies,
    the last expert none; ``"starved"``: the second half of the experts (EP rank 1's) get none
    (through the router's choice bias)."""
    made = []
    for _ in range(blocks):
        block = MoEBlock(HIDDEN, 2, experts, top_k, 6, **VARIANTS[variant])
        if uneven:
            bias = torch.zeros(experts)
            if uneven == "starved":
                bias[: experts // 2], bias[experts // 2 :] = 5.0, -5.0
            else:
                bias[0], bias[-1] = 4.0, -4.0
            block.router.bias.copy_(bias)
        made.append(block)
    return MoEStage(made).double()


def sharded(stage: MoEStage, ep_group, phy2log=None) -> MoEStage:
    return copy.deepcopy(stage).shard_experts_(ep_group, phy2log)


def spread_copies(experts: torch.Tensor, phy2log: torch.Tensor, rank: int) -> torch.Tensor:
    """The slot of each token copy (``experts`` [n], logical ids in token order) of EP rank ``rank``:
    the n-th copy routed to expert e goes to its replica ``(n + rank) % count[e]``, the replicas of
    e ordered by slot (docs/moe-overlap.md; ``twinpipe.moe.placement``, written out plainly)."""
    replicas = {e: [s for s, x in enumerate(phy2log.tolist()) if x == e] for e in set(phy2log.tolist())}
    seen: dict[int, int] = {}
    slots = []
    for e in experts.tolist():
        n = seen.get(e, 0)
        seen[e] = n + 1
        slots.append(replicas[e][(n + rank) % len(replicas[e])])
    return torch.tensor(slots, dtype=torch.long)


def reference_block(block: MoEBlock, xs: list[torch.Tensor], phy2log=None) -> list[torch.Tensor]:
    """``block`` (all experts) on the inputs of every EP rank at once; returns each rank's output.
    ``phy2log``: the placement of the block it stands for (default: one slot per expert)."""
    k, hid = block.top_k, block.hidden
    placement = torch.arange(block.num_experts) if phy2log is None else torch.as_tensor(phy2log)
    hs, tokens, slots, weights = [], [], [], []
    for r, x in enumerate(xs):
        h = block.attention(x)
        t = block.norm2(h).reshape(-1, hid)
        experts, w = block.router(t)
        hs.append(h)
        tokens.append(t)
        slots.append(spread_copies(experts.reshape(-1), placement, r))
        weights.append(w)
    outs = [torch.zeros(len(p), hid, dtype=xs[0].dtype) for p in slots]
    for slot, e in enumerate(placement.tolist()):
        where = [torch.nonzero(p == slot).reshape(-1) for p in slots]  # copies token*k+j, in order
        y = run_expert(block.experts[e], torch.cat([t.index_select(0, w // k) for t, w in zip(tokens, where)]))
        for r, chunk in enumerate(torch.split(y, [len(w) for w in where])):
            outs[r] = outs[r].index_copy(0, where[r], chunk)
    results = []
    for x, h, t, w, y in zip(xs, hs, tokens, weights, outs):
        y = y.view(-1, k, hid)
        acc = y[:, 0] * w[:, 0:1]
        for j in range(1, k):
            acc = acc + y[:, j] * w[:, j : j + 1]
        if block.shared is not None:
            acc = acc + block.shared(t)
        results.append(h + acc.view(x.shape))
    return results


def reference_stages(stages: list[MoEStage], xs: list[torch.Tensor], phy2log=None) -> list[torch.Tensor]:
    """The stages' blocks in turn (``reference_block``); ``phy2log``: one placement for every block,
    or a list of one per block (in run order)."""
    blocks = [block for stage in stages for block in stage.blocks]
    placements = phy2log if isinstance(phy2log, list) and phy2log and not isinstance(phy2log[0], int) else [phy2log] * len(blocks)
    for block, placement in zip(blocks, placements):
        xs = reference_block(block, xs, placement)
    return xs


def mse(out, label):
    return F.mse_loss(out, label).clone()


# ---------------------------------------------------------------- pipelines on a (pp, ep) mesh
def interleaved(events) -> bool:
    """True when, in one F&B op's steps, a compute part of one stream ran while a comm part of
    the other stream was in flight (started, not yet waited for), in both directions."""
    seen = set()
    flying: dict[str, set] = {"F": set(), "B": set()}
    for action, stream, name, *_ in events:
        if action == "start":
            flying[stream].add(name)
        elif action == "wait":
            flying[stream].discard(name)
        elif stream in ("F", "B"):
            other = "B" if stream == "F" else "F"
            if flying[other]:
                seen.add(other)  # other's comm hidden behind this compute
    return seen == {"F", "B"}


def run_pipeline_case(mesh, schedule: str, overlap: bool, variant: str, uneven: bool, phy2log=None, chunks: int = 4) -> list[str]:
    """One training step of ``schedule`` over the mesh's pp dimension with MoE stages sharded over
    its ep dimension (expert slots following ``phy2log``, default one per expert), against the
    reference; returns what differs."""
    import torch.distributed as dist

    import twinpipe
    from exactness import TOL
    from models import grad_error
    from twinpipe.schedule.registry import placement_for

    pp_group, ep_group = mesh["pp"].get_group(), mesh["ep"].get_group()
    pp, ep = mesh["pp"].size(), mesh["ep"].size()
    pp_rank, ep_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    placement = placement_for(schedule, pp)
    torch.manual_seed(11)
    model = [make_stage(variant, uneven=uneven) for _ in range(placement.num_model_stages)]
    modules = [sharded(model[placement.model_stage(s)], ep_group, phy2log) for s in placement.stages_of(pp_rank)]
    for m in modules:
        m.overlap = overlap
    xs = [torch.randn(chunks * 2, SEQ, HIDDEN, dtype=torch.float64) for _ in range(ep)]
    ys = [torch.randn(chunks * 2, SEQ, HIDDEN, dtype=torch.float64) for _ in range(ep)]
    x_mb = [torch.tensor_split(x, chunks) for x in xs]
    y_mb = [torch.tensor_split(y, chunks) for y in ys]

    ref_loss = {}
    for c, chain in enumerate(placement.chains):
        for j in placement.microbatches_of_chain(c, chunks):
            outs = reference_stages([model[placement.model_stage(s)] for s in chain], [x[j] for x in x_mb], phy2log)
            losses = [mse(o, y[j]) for o, y in zip(outs, y_mb)]
            sum(losses).backward()
            ref_loss[j] = losses[ep_rank].detach()

    if schedule == "dualpipe":
        pipe = twinpipe.DualPipe(modules, process_group=pp_group)
    elif schedule == "dualpipev":
        pipe = twinpipe.DualPipeV(modules, process_group=pp_group)
    else:
        pipe = twinpipe.Pipeline(modules, schedule, process_group=pp_group)
    args, labels, mine = (), (), None
    for c, chain in enumerate(placement.chains):
        mbs = list(placement.microbatches_of_chain(c, chunks))
        if chain[0] in pipe.stages:
            args = (torch.cat([x_mb[ep_rank][j] for j in mbs]),)
        if chain[-1] in pipe.stages:
            labels, mine = (torch.cat([y_mb[ep_rank][j] for j in mbs]),), mbs
    loss, _ = pipe.step(*args, num_chunks=chunks, criterion=mse, labels=labels, trace=True)

    problems = []
    # The parts of overlapped F&B ops land on the trace's extra lanes, comm beside compute.
    lanes = {kind for kind, *_ in pipe.last_trace if kind.startswith("part:")}
    has_fb = any(op.kind.value == "FB" for op in pipe.schedule_for(chunks).ops[pipe.rank])
    if has_fb and overlap and not {"part:parts", "part:comm F", "part:comm B"} <= lanes:
        problems.append(f"trace lanes {sorted(lanes)} lack the F&B parts")
    if mine is not None:
        expected = torch.stack([ref_loss[j] for j in mine])
        if not torch.equal(loss, expected):
            problems.append(f"loss {loss.tolist()} != reference {expected.tolist()}")
    with torch.no_grad():  # forward only: the same losses
        again, _ = pipe.step(*args, num_chunks=chunks, criterion=mse, labels=labels)
    if mine is not None and not torch.equal(again, expected):
        problems.append(f"forward-only loss {again.tolist()} != reference {expected.tolist()}")
    if schedule == "dualpipe":
        pipe.sync_mirrored_grads()
    for module in modules:
        reduce_replica_grads(module)
    for s, module in zip(placement.stages_of(pp_rank), modules):
        ref = dict(model[placement.model_stage(s)].named_parameters())
        for name, p in module.named_parameters():
            got = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            if "experts" not in name.split("."):  # data-parallel over ep: the reference saw every ep rank's tokens
                dist.all_reduce(got, group=ep_group)
            want = ref[reference_name(module, name)].grad
            want = want if want is not None else torch.zeros_like(got)
            err = grad_error(got, want)
            if not err <= TOL:
                problems.append(f"stage {s} {name}: gradient error {err:.3g} > {TOL}")
    logs = [m.last_fb_events for m in modules if getattr(m, "last_fb_events", None)]
    has_fb = any(op.kind.value == "FB" for op in pipe.schedule_for(chunks).ops[pp_rank])
    if has_fb and not logs:
        problems.append("no F&B op ran through the overlap engine")
    if logs and interleaved(logs[-1]) != overlap:
        problems.append(f"F&B parts interleaved={not overlap} with overlap={overlap}")
    return problems


# ---------------------------------------------------------------- the docs' example of a user stage


class ExchangeStage(PartedStage):
    """docs/moe-overlap.md section 4, verbatim but for the sizes."""

    def __init__(self, group, width: int = 8):
        super().__init__()
        self.group, self.pre, self.post = group, torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def parts(self):
        return [
            Compute("pre", lambda x: (self.pre(x), x)),
            Comm("exchange", self._send, self._send_backward),
            Compute("post", lambda y, x: (self.post(y) + x,)),
        ]

    def _send(self, y, x):
        n = [len(y) // 2] * 2
        sent = all_to_all(y.detach(), n, n, self.group)
        return Then(sent, lambda got: ((got.requires_grad_(y.requires_grad), x), n))

    def _send_backward(self, n, grads):
        g_y, g_x = grads
        return Then(all_to_all(g_y, n, n, self.group), lambda g: (g, g_x))


def run_pipeline_cases(mesh, cases) -> dict:
    """``run_pipeline_case`` for each case on one mesh; an exception becomes that case's problem."""
    import torch.distributed as dist

    results = {}
    for case in cases:
        try:
            results[case] = run_pipeline_case(mesh, *case)
        except Exception as exc:  # report the case, keep the world going
            results[case] = [f"{type(exc).__name__}: {exc}"]
        dist.barrier()
    return results


def reference_name(stage, name: str) -> str:
    """The reference model's name for ``stage``'s parameter ``name`` (with all experts local): an
    expert slot is named after the logical expert it holds."""
    parts = name.split(".")
    if "experts" in parts:
        i = parts.index("experts") + 1
        block = stage.blocks[int(parts[1])]
        parts[i] = str(int(block.phy2log[block.first_slot + int(parts[i])]))
    return ".".join(parts)
