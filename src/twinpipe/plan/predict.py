"""Predict one schedule at one pipeline size (``predict_one``) or every registered one (``plan``).

The pipeline part is the simulator's makespan under the costs of ``plan.costs`` (the same engine
as ``twinpipe simulate``, costs scaled to each placement by ``sim.costs.for_model``). Then, not
overlapped with it: the data-parallel gradient all-reduce and, for placements whose chains are
copies of the model (DualPipe; Chimera, BitPipe), the all-reduce between the copies.

Large micro-batch counts are not simulated whole: once a pipeline is in its steady state its
makespan, busy times and peak memory grow linearly in m (exactly, for periodic schedules), so
simulations at three counts spaced q apart and congruent to m modulo q (q = p, or 2p for odd p)
are checked to lie on one line and extended to m (``extrapolated_from``); if they do not, later
triples are tried, then m itself if small enough (``DIRECT_PAIRS``), else the result is marked
approximate. The schedules that plan their order with a search (``registry`` ``max_pairs`` below
the default) are skipped when one simulation would exceed ``PLANNED_CAP`` (stage, micro-batch)
pairs, and say so; any schedule when one would pass the simulator's own size limit.

``plan`` predicts a row per schedule, variant (``registry.variants``) and pipeline size, in a pool of
forked processes when the plan is large (``workers``); rows are independent, so the answer is the
same in one process.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import KW_ONLY, dataclass, field

from twinpipe import checks
from twinpipe.plan import candidates
from twinpipe.plan.costs import Layout, all_reduce_time, layout, stage_costs
from twinpipe.plan.spec import Cluster, Model
from twinpipe.schedule import registry
from twinpipe.schedule.costs import op_costs
from twinpipe.schedule.limits import MAX_STAGE_MICROBATCHES
from twinpipe.sim.costs import CostModel, for_model, stage_sizes
from twinpipe.sim.engine import summarize

__all__ = ["Prediction", "predict_one", "plan", "default_pp_sizes", "simulate_metrics", "PLANNED_CAP"]

PLANNED_CAP = 1024  # the searching schedules: skipped above this many (stage, micro-batch) pairs in one simulation
DIRECT_PAIRS = 16384  # not linear yet: simulate m itself up to this many pairs
SHIFTS = 2  # later triples tried before an extrapolation is called approximate
GiB = 2**30


@dataclass
class Prediction:
    """One schedule at one pipeline size: step time and its parts (seconds), memory (bytes), verdict."""

    schedule: str
    pp: int
    microbatches: int
    _: KW_ONLY
    options: dict = field(default_factory=dict)  # the schedule's options (a variant: Chimera's pairs=k)
    dp: int = 1
    ep: int = 1
    fits: bool = False
    why: str = ""  # "does not fit: ...", "skipped: ..." or "" when it fits
    step_time: float = 0.0
    pipeline: float = 0.0  # simulated makespan
    compute: float = 0.0  # the busiest rank's compute alone
    a2a_exposed: float = 0.0  # all-to-all time on the busiest rank not hidden by F&B
    a2a_hidden: float = 0.0
    bubble: float = 0.0  # makespan - busiest rank's busy time: idle slots and pipeline messages
    dp_all_reduce: float = 0.0
    mirror_all_reduce: float = 0.0
    copies: int = 1  # copies of the model's weights on the pipeline (chains of the placement)
    memory: dict = field(default_factory=dict)  # the fullest rank: params, grads, optimizer, activations, total
    memory_per_rank: list = field(default_factory=list)  # every pipeline rank's total
    memory_parts: list = field(default_factory=list)  # with a GPTRun: every rank's parts (twinpipe.sim.gpt.RankPrediction dicts)
    tokens_per_s: float = 0.0
    extrapolated_from: tuple | None = None  # (m1, m2) extended linearly to m; a third entry "approximate"
    limit: str = ""

    @property
    def status(self) -> str:
        return "fits" if self.fits else self.why

    @property
    def label(self) -> str:
        """The schedule with its options: ``chimera pairs=2``."""
        return " ".join([self.schedule, *(f"{k}={v}" for k, v in sorted(self.options.items()))])


def _scaled(costs: CostModel, placement) -> CostModel:
    """Costs of one 1F1B stage scaled to ``placement`` (``for_model``); per-stage costs are used as given."""
    return costs if isinstance(costs.t_f, (list, tuple)) else for_model(costs, placement)


def simulate_metrics(name: str, p: int, m: int, costs: CostModel, options: dict | None = None) -> dict:
    """Makespan, per-rank busy time and peak activations (M_B of a 1F1B stage) of ``name`` (with
    ``options``) simulated at (p, m)."""
    info, options = registry.get(name), dict(options or {})
    placement = candidates.spec_of(name, p, options).placement
    scaled = _scaled(costs, placement)
    options |= {k: getattr(scaled, k) for k in ("t_f", "t_b", "t_w", "t_comm", "mw") if k in (info.options or ())}
    schedule = candidates.build(name, p, m, options)
    # Built-in generators are validated by their tests at every size; a registered one at every use.
    summary = summarize(schedule, scaled, check=info not in registry.BUILTIN)
    return {"makespan": summary.makespan, "busy": list(summary.busy), "peak": list(summary.peak)}


def _start(p: int, m: int) -> tuple[int, int]:
    """The first of three counts congruent to m modulo q (q = p, or 2p for odd p), and q."""
    q = p if p % 2 == 0 else 2 * p
    return p + (m - p) % q, q


def _linear(a: dict, b: dict, c: dict) -> bool:
    """Whether three equally spaced simulations lie on one line (makespan, busy time and peak memory)."""
    def flat(d):
        return [d["makespan"], *d["busy"], *d["peak"]]
    return all(abs((z - y) - (y - x)) <= 1e-9 * max(1.0, abs(z)) for x, y, z in zip(flat(a), flat(b), flat(c)))


def _extend(a, b, m1: int, m2: int, m: int):
    if isinstance(a, list):
        return [_extend(x, y, m1, m2, m) for x, y in zip(a, b)]
    return b + (b - a) * (m - m2) / (m2 - m1)


def _metrics(name: str, p: int, m: int, costs: CostModel, num_stages: int, max_pairs: int, options: dict) -> tuple[dict, tuple | None]:
    """Simulated metrics at m, or extended linearly from the first three counts (spaced q, congruent
    to m) that lie on one line; up to ``SHIFTS`` later triples are tried. ``None`` or the counts used,
    with ``"approximate"`` appended when no triple was linear (the last two are extended anyway).
    """
    m0, q = _start(p, m)
    largest = m if m <= m0 + 2 * q else m0 + 2 * q
    searching = max_pairs < MAX_STAGE_MICROBATCHES
    if searching and num_stages * largest > PLANNED_CAP:
        raise _Skip(f"skipped: {name} searches its order, and simulating it here ({num_stages} stages x {largest} micro-batches) "
                    f"is over the planner's cap of {PLANNED_CAP} pairs (docs/limits.md); try a smaller pp")
    if num_stages * largest > max_pairs:
        raise _Skip(f"skipped: simulating it here ({num_stages} stages x {largest} micro-batches) is over the simulator's limit "
                    f"of {max_pairs} pairs (docs/limits.md)")
    if m <= m0 + 2 * q:
        return simulate_metrics(name, p, m, costs, options), None
    try:
        runs = {k: simulate_metrics(name, p, k, costs, options) for k in (m0, m0 + q, m0 + 2 * q)}
        shifts = 0
        while (not _linear(*(runs[k] for k in (m0, m0 + q, m0 + 2 * q))) and shifts < SHIFTS and m > m0 + 3 * q
               and not (searching and num_stages * (m0 + 3 * q) > PLANNED_CAP)):
            m0, shifts = m0 + q, shifts + 1
            runs[m0 + 2 * q] = simulate_metrics(name, p, m0 + 2 * q, costs, options)
    except ValueError as error:  # a generator refuses a count by its size and residue: m's residue stands in for m
        text = str(error)
        for k in range(m0, m0 + 3 * q, q):
            text = re.sub(rf"={k}\b", f"={m}", text)  # "num_microbatches=24:" says 120 when 120 was asked
        raise _NoFit(text) from None
    used = (m0 + q, m0 + 2 * q)
    exact = _linear(*(runs[k] for k in (m0, *used)))
    if not exact and num_stages * m <= (PLANNED_CAP if searching else DIRECT_PAIRS):
        return simulate_metrics(name, p, m, costs, options), None
    a, b = runs[used[0]], runs[used[1]]
    return {key: _extend(a[key], b[key], *used, m) for key in a}, used + (() if exact else ("approximate",))


class _Skip(Exception):
    pass


class _NoFit(Exception):
    pass


def _rank_params(model: Model, placement, lay: Layout) -> list[tuple[float, float]]:
    """(replicated, expert) parameters on each pipeline rank: layers of its stages, embedding and head."""
    dense, expert = model.layer_params()
    sizes = stage_sizes(placement)
    per_rank = []
    for r in range(placement.num_ranks):
        d = e = 0.0
        for s in placement.stages_of(r):
            layers = model.layers * sizes[s] / lay.pp
            d += layers * dense + model.vocab * model.hidden * (placement.is_first(s) + placement.is_last(s))
            e += layers * expert / lay.ep
        per_rank.append((float(d), float(e)))
    return per_rank


def predict_one(name: str, model: Model | None, cluster: Cluster, pp: int, microbatches: int, costs: CostModel | None = None,
                options: dict | None = None, gpt=None) -> Prediction:
    """Predict schedule ``name`` (with ``options``, e.g. ``{"pairs": 2}``) at pipeline size ``pp``; an
    impossible case comes back with ``why``, never raised.

    ``costs``: the op times of one 1F1B stage to use instead of the model's (from a traced run), or
    per-stage op times of ``name``'s own stages at ``pp``, used as given (the traced schedule itself).
    With ``model`` None (only with ``costs``), memory and the gradient all-reduces are not counted.
    ``gpt``: a ``twinpipe.sim.gpt.GPTRun``: memory per rank and part as ``twinpipe train`` predicts it
    for its GPT (``memory_parts``; ``memory`` the fullest rank's) instead of the transformer estimate.
    """
    if model is None and costs is None:
        raise ValueError("model=None: give a Model, or the costs of a traced run")
    _check_count("pp", pp)
    _check_count("microbatches", microbatches)
    pred = Prediction(registry.get(name).name, pp, microbatches, options=dict(options or {}))
    try:
        lay = layout(model, cluster, pp)
        pred.dp, pred.ep = lay.dp, lay.ep
        placement = candidates.spec_of(name, pp, pred.options).placement
        pred.copies = len(placement.chains)
        a2a_op, m_b = 0.0, 0.0  # measured op times hold their all-to-alls (if any)
        if model is not None:
            # (twinpipe train's GPT is cut by parameters, embedding and head included: any count of its layers)
            if gpt is None and any((model.layers * size / pp).denominator != 1 for size in set(stage_sizes(placement))):
                raise _NoFit(f"{model.layers} layers do not split evenly into its {max(len(c) for c in placement.chains)}-stage "
                             f"chain(s) on {pp} ranks")
            model_costs, per_layer, m_b = stage_costs(model, cluster, lay)
            if costs is None:
                costs, a2a_op = model_costs, model.layers / pp * 4 * per_layer.a2a  # all-to-alls in one F + B of a 1F1B stage
            _memory(pred, model, lay, _rank_params(model, placement, lay), [0.0] * pp)
            if pred.memory["total"] > cluster.memory:  # the weights alone: no need to simulate
                pred.why = _too_big(pred, cluster, before_activations=True)
                return pred
        metrics, pred.extrapolated_from = _metrics(pred.schedule, pp, microbatches, costs, placement.num_stages, registry.get(name).max_pairs,
                                                   pred.options)
    except _Skip as skip:
        pred.why = str(skip)
        return pred
    except (_NoFit, ValueError) as error:
        pred.why = f"does not fit: {error}"
        return pred
    _pipeline(pred, placement, costs, a2a_op, metrics)
    if model is not None:
        _collectives_and_memory(pred, model, cluster, lay, placement, m_b, metrics["peak"])
    if gpt is not None:
        try:
            _gpt_memory(pred, gpt, cluster, lay.dp)
        except ValueError as error:
            pred.why = f"does not fit: {error}"
            return pred
    pred.step_time = pred.pipeline + pred.dp_all_reduce + pred.mirror_all_reduce
    if model is not None and pred.step_time > 0:
        pred.tokens_per_s = microbatches * model.tokens * lay.dp / pred.step_time
    pred.fits = not pred.why
    pred.limit = _limit(pred, cluster)
    return pred


def _pipeline(pred: Prediction, placement, costs: CostModel, a2a_op: float, metrics: dict) -> None:
    """Makespan, and on the busiest rank: compute alone, all-to-all exposed and hidden, bubble."""
    sizes = stage_sizes(placement)
    pred.pipeline = metrics["makespan"]
    busiest = max(range(placement.num_ranks), key=lambda r: metrics["busy"][r])
    busy = metrics["busy"][busiest]
    table = op_costs(_scaled(costs, placement), placement.num_stages)
    mine = placement.stages_of(busiest)
    per_chain = pred.microbatches / pred.copies
    share = float(sum(sizes[s] for s in mine)) * per_chain  # 1F1B stages' worth of micro-batches the rank runs
    a2a_total = share * a2a_op
    pred.compute = sum(table.microbatch_time(s) for s in mine) * per_chain - a2a_total
    pred.a2a_exposed = max(0.0, min(a2a_total, busy - pred.compute))
    pred.a2a_hidden = a2a_total - pred.a2a_exposed
    pred.bubble = max(0.0, pred.pipeline - busy)


def _collectives_and_memory(pred: Prediction, model: Model, cluster: Cluster, lay: Layout, placement, m_b: float, peak: list) -> None:
    """Gradient all-reduces (data-parallel; between weight copies) and the fullest rank's memory."""
    params = _rank_params(model, placement, lay)
    span = lay.pp * lay.dp  # the whole pipeline: mirrored ranks r and p-1-r are that far apart
    pred.dp_all_reduce = max(all_reduce_time(d * model.grad_bytes, lay.dp, cluster.bandwidth(lay.dp), cluster.latency)
                             + all_reduce_time(e * model.grad_bytes, lay.dp // lay.ep, cluster.bandwidth(lay.dp), cluster.latency)
                             for d, e in params)
    if pred.copies > 1:
        pred.mirror_all_reduce = max(all_reduce_time((d + e) * model.grad_bytes, pred.copies, cluster.bandwidth(span), cluster.latency)
                                     for d, e in params)
    _memory(pred, model, lay, params, [max(0.0, a) * m_b for a in peak])
    if pred.memory["total"] > cluster.memory:
        pred.why = _too_big(pred, cluster)


def _memory(pred: Prediction, model: Model, lay: Layout, params: list, activations: list) -> None:
    """The fullest rank's memory parts and every rank's total, from its parameters and activation bytes."""
    totals = []
    # The parts of the trainer's memory report (twinpipe.sim.memory.MemoryParts): FP32 masters apart
    # from the optimizer's moments where the weights are narrower (mixed precision).
    master = 4.0 if model.param_bytes < 4 and model.optimizer_bytes >= 4 else 0.0
    # ZeRO-1: each data-parallel rank updates a 1/dp share of the replicated weights and a 1/(dp/ep)
    # share of its experts (their replicas), so it keeps only that share's masters and moments.
    shards = (lay.dp, lay.dp // lay.ep) if model.zero1 else (1, 1)
    for (d, e), act in zip(params, activations):
        n, updated = d + e, d / shards[0] + e / shards[1]
        parts = {"params": n * model.param_bytes, "grads": n * model.grad_bytes, "master": updated * master,
                 "optimizer": updated * (model.optimizer_bytes - master), "activations_peak": act}
        parts["total"] = sum(parts.values())
        parts["activations"] = act  # the name it had before the report's
        totals.append(parts)
    pred.memory = max(totals, key=lambda t: t["total"])
    pred.memory_per_rank = [t["total"] for t in totals]


def _gpt_memory(pred: Prediction, gpt, cluster: Cluster, dp: int) -> None:
    """Memory per rank and part for twinpipe train's GPT (``GPTRun.predict``): the fullest rank's
    parts in ``memory``, every pipeline rank's largest total in ``memory_per_rank``."""
    ranks = gpt.predict(pred.schedule, pred.pp, pred.microbatches, dp, pred.options)
    pred.memory_parts = [r.to_dict() for r in ranks]
    fullest = max(ranks, key=lambda r: r.parts.total)
    pred.memory = {**fullest.parts.to_dict(), "activations": fullest.parts.activations_peak}
    pred.memory_per_rank = [max(r.parts.total for r in ranks if r.pp_rank == k) for k in range(pred.pp)]
    pred.why = _too_big(pred, cluster) if pred.memory["total"] > cluster.memory else ""


def _too_big(pred: Prediction, cluster: Cluster, before_activations: bool = False) -> str:
    mem = {k: v / GiB for k, v in pred.memory.items()}
    copies = f" in {pred.copies} copies" if pred.copies > 1 else ""
    what = "before any activation" if before_activations else f"{mem['activations']:.1f} activations"
    return (f"does not fit: needs {mem['total']:.1f} GiB on its fullest rank ({mem['params']:.1f} weights{copies}, "
            f"{mem['grads']:.1f} grads, {mem['optimizer']:.1f} optimizer, {what}), {cluster.memory / GiB:.1f} GiB available")


def _limit(pred: Prediction, cluster: Cluster) -> str:
    """One line: the largest cost beside compute, in a share of the step (and memory when tight)."""
    step = pred.step_time or 1.0
    parts = {
        "pipeline bubble and messages": pred.bubble,
        "exposed EP all-to-all": pred.a2a_exposed,
        "data-parallel gradient all-reduce": pred.dp_all_reduce,
        f"all-reduce between its {pred.copies} weight copies": pred.mirror_all_reduce,
    }
    name, value = max(parts.items(), key=lambda kv: kv[1])
    line = f"{name} {value / step:.0%} of the step" if value >= 0.005 * step else "compute bound"
    if pred.a2a_hidden > 1e-9 * step:
        line += f"; F&B hides {pred.a2a_hidden / (pred.a2a_hidden + pred.a2a_exposed):.0%} of the all-to-all"
    used = pred.memory.get("total", 0.0) / cluster.memory
    if used > 0.9:
        line += f"; memory {used:.0%} full"
    return line


def plan(model: Model, cluster: Cluster, microbatches: int, pp_sizes=None, schedules=None, costs_for=None,
         workers: int | None = None, gpt=None, rows=None) -> list[Prediction]:
    """Every schedule (default ``registry.names()``) at every pipeline size (default: powers of two
    dividing the GPUs, 2..64), ranked: fitting ones by throughput (by step time without a model), then the rest.

    Schedules with variants (``registry.variants``: Chimera's pipeline pairs) get a row for each.
    ``rows``: (schedule, options) pairs to plan instead (``candidates.decision_candidates()``), at every size.
    ``costs_for(name, pp, options)``: the op times to use instead of the model's (``predict_one``'s ``costs``).
    ``workers``: processes to predict in (None: one per core, up to ``MAX_WORKERS``, when the plan is
    large enough to pay for starting them; 1: in this process). The answer does not depend on it.
    ``gpt``: a ``twinpipe.sim.gpt.GPTRun`` (``predict_one``'s).
    """
    schedules = [registry.get(name).name for name in (schedules or registry.names())]
    pp_sizes = list(pp_sizes or default_pp_sizes(cluster.gpus))
    checks.check_ints(pp_sizes, "pp_sizes", low=1)
    _check_count("microbatches", microbatches)
    if workers is not None:
        _check_count("workers", workers)
    # Largest pipelines first, so that the pool's last tasks are short ones.
    def variants(p: int) -> list[tuple[str, dict]]:
        if rows is not None:
            return [(registry.get(name).name, dict(options)) for name, options in rows]
        return [(name, options) for name in schedules for options in registry.variants(name, p)]

    tasks = [(name, p, options, costs_for(name, p, options) if costs_for else None)
             for p in sorted(pp_sizes, reverse=True) for name, options in variants(p)]
    results = _predict_all(model, cluster, microbatches, tasks, _workers(workers, tasks, microbatches), gpt)
    return sorted(results, key=lambda r: (not r.fits, -r.tokens_per_s, r.step_time, r.pp, r.label))


MAX_WORKERS = 8
PARALLEL_PAIRS = 20_000  # (stage, micro-batch) pairs simulated, roughly, above which a forked pool pays for its start


def _workers(workers: int | None, tasks: list, m: int) -> int:
    if workers is not None:
        return min(workers, len(tasks))
    if "fork" not in multiprocessing.get_all_start_methods() or _threads() > 1:
        return 1  # see _predict_all: only a single-threaded process forks its workers unasked
    pairs = sum(p * min(m, 4 * p) for _, p, _, _ in tasks)  # a triple of simulations spans about 4p micro-batches
    return min(os.cpu_count() or 1, MAX_WORKERS, len(tasks)) if pairs > PARALLEL_PAIRS else 1


def _threads() -> int:
    """Threads of this process, the ones Python did not start (torch's, OpenMP's) included where the OS says."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _predict_all(model, cluster, m: int, tasks: list, workers: int, gpt=None) -> list[Prediction]:
    # Workers are forked: they start at once and never re-run the caller's script (spawn and
    # forkserver import its __main__ again, which runs any unguarded script a second time).
    # Forking a process that has other threads is unsafe in general; the workers only run this
    # module's pure Python, and an unasked pool is never forked from such a process (_workers).
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                return list(pool.map(_predict_task, *zip(*((model, cluster, m, *task, gpt) for task in tasks))))
        except (OSError, BrokenProcessPool):  # no processes here (a sandbox): the same answer, more slowly
            pass
    return [_predict_task(model, cluster, m, *task, gpt) for task in tasks]


def _predict_task(model, cluster, m: int, name: str, p: int, options: dict, costs, gpt=None) -> Prediction:
    return predict_one(name, model, cluster, p, m, costs, options, gpt)


def _check_count(name: str, value) -> None:
    checks.check_int(value, name, low=1)


def default_pp_sizes(gpus: int) -> list[int]:
    return [p for p in (2, 4, 8, 16, 32, 64) if gpus % p == 0] or [gpus]
