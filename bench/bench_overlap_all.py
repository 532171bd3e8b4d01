"""Every schedule with the F&B overlap off and on, measured beside the simulator's prediction, in one run.

PP=2 x EP=2 on CPU (4 gloo processes), three models: a ``twinpipe.moe`` stack (``MoEStage`` of
MoE blocks, ``twinpipe.train.model.block``) and tiny ``transformers`` Qwen3-MoE and DeepSeek-V3
(``bench_hf._moe_model``: experts sharded over EP, layers in parts). For each model and schedule:

- off: the schedule as it is (DualPipe's and DualPipeV's F&B ops run F then B);
- on: DualPipe and DualPipeV with the part-level overlap inside their F&B ops; any other schedule
  with ``resolve(name, p, overlap=True)`` where the registry declares that option for it
  (``registry.get(name).options``; any other row says "no overlap").

Blocks of steps alternate between off and on (``bench_vs_torch.alternating_blocks``; the baseline
is off, in the same run). Printed: median step time off and on, the ratio on/off (median of the
paired blocks), the share of the all-to-alls' in-flight time during which a compute part ran
(``twinpipe.overlap.report.comm_hidden`` over the F&B ops' events), and the simulator's ratio for
the same costs: one traced off step's op times (``trace.estimate_costs``, cores shared as the run
shared them) simulated as they are, and the on schedule with each F&B op shortened by the ratio
``sim.overlap.predict_fb`` gives for the part times of F&B ops run F then B (DualPipe's off step;
for the other schedules, one step of their overlapped schedule with the part overlap off).

    python bench/bench_overlap_all.py [--models moe,qwen3_moe,deepseek_v3] [--schedules ...] [--blocks 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

# the one block timer, the tiny HF MoE models, an F&B op's part times (bench/ is on sys.path when a bench script runs)
from bench_hf import _moe_model
from bench_overlap import _part_times
from bench_vs_torch import alternating_blocks

from twinpipe.launch import run_local

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipe", "dualpipev")
MODELS = ("moe", "qwen3_moe", "deepseek_v3")
BLOCK = 2  # steps per timed block
CHUNKS = 8  # micro-batches per step
SEQ, HIDDEN, EXPERTS, ROWS = 32, 64, 4, 2  # tokens per sequence, width, experts, sequences per micro-batch and EP rank


def overlap_on_options(name: str) -> dict | None:
    """How to turn the overlap on for ``name``: {} (its F&B ops exist: the modules' ``overlap`` flag),
    {"overlap": True} (the registry declares the option for it), or None (no overlap)."""
    from twinpipe.schedule import registry

    if len(registry.placement_for(name, 2).chains) > 1 or name == "dualpipev":
        return {}
    return {"overlap": True} if "overlap" in (registry.get(name).options or ()) else None


def _moe_stages(name, pp_rank, ep_group):
    """``twinpipe.moe`` stages of this rank, inputs and labels for its first/last stages, the criterion."""
    import twinpipe
    from twinpipe.moe import MoEStage
    from twinpipe.train.model import GPTConfig, block

    cfg = GPTConfig(seq_len=SEQ, dim=HIDDEN, heads=4, layers=1, experts=EXPERTS, top_k=2)
    modules = []
    for s in twinpipe.stages_of_rank(name, 2, pp_rank):
        torch.manual_seed(100 + s)  # the same dense weights on every EP rank of a stage
        modules.append(MoEStage([block(cfg, expert_ffn=2 * HIDDEN, ep_group=ep_group)]))
    torch.manual_seed(7 + dist.get_rank(ep_group))
    x = torch.randn(CHUNKS * ROWS, SEQ, HIDDEN)
    return modules, (x,), (torch.randn_like(x),), lambda out, y: torch.nn.functional.mse_loss(out, y)


def _pipeline(model: str, name: str, options: dict, pp, ep):
    """(pipeline, modules, inputs, labels, criterion) of this rank for ``name`` with schedule ``options``."""
    import twinpipe
    from twinpipe.schedule.spec import resolve

    pp_rank = dist.get_rank(pp)
    if model == "moe":
        modules, inputs, labels, criterion = _moe_stages(name, pp_rank, ep)
        pipe = twinpipe.Pipeline(modules, schedule=resolve(name, 2, **options), process_group=pp)
    else:
        from twinpipe import hf
        from twinpipe.hf.experts import shard_experts_
        from twinpipe.hf.moe_layer import wrap_layer

        stages = hf.build(shard_experts_(_moe_model(model, HIDDEN, EXPERTS), ep), name, 2, pp_rank, wrap_layer=wrap_layer, **options)
        ids = torch.randint(0, 256, (CHUNKS * ROWS, SEQ), generator=torch.Generator().manual_seed(1 + dist.get_rank(ep)))
        inputs, labels = stages.batch(ids, None, ids, num_chunks=CHUNKS)
        modules, criterion, pipe = stages.modules, stages.criterion, stages.pipeline(pp, dynamic_shapes=False)
    placement = resolve(name, 2, **options).placement
    first = any(placement.is_first(s) for s in pipe.stages)
    last = any(placement.is_last(s) for s in pipe.stages)
    return pipe, modules, inputs if first else (), labels if last else (), criterion if last else None


def _step(pipe, modules, inputs, labels, criterion, overlap: bool, trace: bool = False) -> list:
    """One training step; the F&B ops' events it recorded."""
    for m in modules:
        if hasattr(m, "overlap"):
            m.overlap = overlap
            m.fb_events.clear()
    pipe.step(*inputs, num_chunks=CHUNKS, criterion=criterion, labels=labels, trace=trace)
    pipe.zero_grad(set_to_none=True)
    return [events for m in modules for events in getattr(m, "fb_events", ())]


def _shares(steps: list) -> tuple[float, float]:
    from twinpipe.overlap.report import comm_hidden

    pairs = [comm_hidden(events) for ops in steps for events in ops]
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def _fb_speedup(ops: list) -> float | None:
    """Mean of predict_fb / (the parts back to back) over recorded F&B ops run without overlap."""
    from twinpipe.sim.overlap import predict_fb

    ratios = []
    for events in ops:
        f, b, weights = _part_times(events)
        alone = sum(t for _, t in f + b) + sum(weights)
        if alone > 0:
            ratios.append(predict_fb(f, b, weights) / alone)
    return statistics.mean(ratios) if ratios else None


def _predicted(name: str, options: dict, timeline, speedup: float | None) -> float | None:
    """The simulator's step time on / off for the traced off run's costs, F&B ops at ``speedup``
    times their halves back to back (``t_fb`` for a pair with a full backward, ``t_fb_b`` with a B)."""
    from dataclasses import replace

    from twinpipe.schedule.spec import resolve
    from twinpipe.sim import simulate
    from twinpipe.trace import estimate_costs

    if speedup is None or timeline is None:
        return None
    costs = estimate_costs(timeline)
    spec = resolve(name, 2, **options)
    stage = costs.per_stage(spec.placement.num_stages)
    measured = stage.get("t_fb") or [None] * len(stage["t_f"])  # the off run's F&B ops, F then B: scaled as they ran
    t_fb = [speedup * (fb if fb is not None else f + b + w) for f, b, w, fb in zip(stage["t_f"], stage["t_b"], stage["t_w"], measured)]
    t_fb_b = [speedup * (f + b) for f, b in zip(stage["t_f"], stage["t_b"])]
    off = simulate(resolve(name, 2).build(CHUNKS), costs).makespan
    return simulate(spec.build(CHUNKS), replace(costs, t_fb=t_fb, t_fb_b=t_fb_b)).makespan / off


def _case(model: str, name: str, blocks: int, pp, ep) -> dict:
    from twinpipe.trace import gather_timeline

    on_options = overlap_on_options(name)
    row = {"model": model, "schedule": name, "on": on_options is not None}
    off = _pipeline(model, name, {}, pp, ep)
    # F&B ops built in: the same pipeline with its modules' overlap flag; an option: its own (same seeds, same weights)
    on = None if on_options is None else off if not on_options else _pipeline(model, name, on_options, pp, ep)
    runs = {"off": lambda: _step(*off, overlap=False), "on": (lambda: _step(*on, overlap=True)) if on else None}
    if on is None:
        runs["on"] = runs["off"]  # timed twice: the off time only is printed
    for fn in runs.values():  # warm-up
        fn()
    row["times"], outputs = alternating_blocks(runs, blocks, BLOCK)
    row["shares"] = {k: _shares(v) for k, v in outputs.items()}
    events = _step(*off, overlap=False, trace=True)
    timeline = gather_timeline(off[0], CHUNKS)
    if on is not None and on is not off:  # the option's F&B ops, run F then B: their parts' times alone
        events = _step(*on, overlap=False)
    row["predicted"] = _predicted(name, on_options, timeline, _fb_speedup(events)) if on is not None else None
    off[0].close()
    if on is not None and on is not off:
        on[0].close()
    return row


def _worker(rank, world, models, schedules, blocks):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    pp, ep = mesh["pp"].get_group(), mesh["ep"].get_group()
    rows = []
    for model in models:
        for name in schedules:
            try:
                rows.append(_case(model, name, blocks, pp, ep))
            except (ValueError, RuntimeError, TypeError) as error:  # a model/schedule pair that cannot run: say why
                rows.append({"model": model, "schedule": name, "error": f"{type(error).__name__}: {error}"[:160]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated registered schedules")
    ap.add_argument("--blocks", type=int, default=3, help=f"timed blocks of {BLOCK} steps per run (default: 3)")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise SystemExit(f"--models={args.models!r}: allowed are {', '.join(MODELS)}")
    out = run_local(4, _worker, models, [s for s in args.schedules.split(",") if s], args.blocks, timeout=3600)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"F&B overlap off vs on, PP=2 x EP=2 (4 gloo processes, 1 thread each) on {cores} CPU cores, load average "
          f"{os.getloadavg()[0]:.1f}; {CHUNKS} micro-batches of {ROWS}x{SEQ} tokens per EP rank, hidden {HIDDEN}, {EXPERTS} experts "
          f"top-2; {args.blocks} blocks of {BLOCK} steps per run, alternating; baseline: overlap off")
    print(f"{'model':<12} {'schedule':<17} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'hidden off':>10} {'hidden on':>9} {'sim on/off':>10}")
    for row in out[0]:
        head = f"{row['model']:<12} {row['schedule']:<17}"
        if "error" in row:
            print(f"{head} not run: {row['error']}")
            continue
        times, shares = row["times"], row["shares"]
        t_off = statistics.median(times["off"])
        if not row["on"]:
            print(f"{head} {t_off * 1e3:8.1f} {'-':>8} {'-':>7} {'-':>10} {'-':>9} {'-':>10}  no overlap: the schedule layer "
                  "does not take overlap=True for it")
            continue
        t_on = statistics.median(times["on"])
        ratio = statistics.median(a / b for a, b in zip(times["on"], times["off"]))
        hid = {k: (f"{h / f:.0%}" if f else "-") for k, (f, h) in shares.items()}  # "-": no F&B op ran
        pred = f"{row['predicted']:.3f}" if row["predicted"] else "-"
        print(f"{head} {t_off * 1e3:8.1f} {t_on * 1e3:8.1f} {ratio:7.3f} {hid['off']:>10} {hid['on']:>9} {pred:>10}")
    print(f"hidden: share of the F&B ops' all-to-all in-flight time (start to the return of its wait) during which a compute "
          f"part ran, rank 0. sim on/off: the simulator, fed the traced off step's op times, with each F&B op shortened by "
          f"the ratio sim.overlap.predict_fb gives for the parts of F&B ops run F then B.")
    if cores < 4:
        print(f"Honest note: 4 ranks share {cores} cores here, so a rank's all-to-all waits for a peer that is waiting for a "
              f"core, and an overlapped part has no idle core to run on: the measured on/off ratio says how the cores were "
              f"shared more than what the overlap hides. The simulator shares the cores too (trace.estimate_costs), but "
              f"takes op times alone; compare the two, not either with a GPU. Only the hidden share is about the overlap itself.")


if __name__ == "__main__":
    main()
