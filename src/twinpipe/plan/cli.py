"""``twinpipe plan``: rank every schedule and pipeline size for a model on a cluster, or for a traced run.

    twinpipe plan --layers 32 --dim 4096 --seq-len 4096 --gpus 64 --microbatches 64
    twinpipe plan --layers 60 --dim 7168 --seq-len 4096 --experts 256 --top-k 8 --expert-ffn 2048 --gpus 256 --microbatches 64 --plot plan.png
    twinpipe plan --from-trace out/trace.json            # the op times a `twinpipe demo --trace out` run measured
    twinpipe plan ... --zero1 --memory-limit 80           # DualPipe(V), interleaved 1F1B and ZB-V with/without overlap at 80 GiB
    twinpipe plan --gpt --layers 6 --dim 64 --seq-len 64 --vocab 256 --microbatch-size 2 --gpus 2 --pp 2 --microbatches 8

With ``--gpt`` the model is ``twinpipe train``'s GPT and each row's memory is predicted per rank and
part as ``twinpipe train`` predicts it (``twinpipe.sim.gpt``): a table per row, ``memory_parts`` in the JSON.

The model options are ``twinpipe train``'s (the fields of ``twinpipe.train.GPTConfig``) and mean
the same; ``twinpipe.plan.Model.from_config`` reads such a config in Python.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import twinpipe.cli_options as cli_options
from twinpipe import checks
from twinpipe.plan.candidates import decision_candidates
from twinpipe.plan.measured import load_traced
from twinpipe.plan.predict import PLANNED_CAP, default_pp_sizes, plan
from twinpipe.plan.report import as_dicts, draw_plan, print_table, verdict
from twinpipe.plan.spec import Cluster, Model
from twinpipe.precisions import BF16_MIXED
from twinpipe.schedule import registry
from twinpipe.sim.gpt_cli import add_gpt_options, check_gpt_options, gpt_run, memory_table

__all__ = ["add_plan_parser", "run_plan"]

_MODEL = ("layers", "dim", "seq_len")  # what a model needs; the other model options have defaults


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", allow_abbrev=False,
        help="rank every schedule and pipeline size for a model on a cluster (or a traced run)",
        description="Predict, for every registered schedule and pipeline size, the step time (pipeline simulated by the same "
                    "engine as `twinpipe simulate`, EP all-to-all and how much F&B hides, data-parallel and weight-copy "
                    "gradient all-reduces) and the fullest rank's memory; print them ranked, each with what limits it.")
    m = parser.add_argument_group("model (a decoder-only transformer: twinpipe train's model options)")
    cli_options.add(parser, "layers", group=m, more="required unless --from-trace")
    cli_options.add(parser, "dim", group=m, more="required unless --from-trace")
    cli_options.add(parser, "seq_len", group=m, more="required unless --from-trace")
    cli_options.add(parser, "microbatch_size", group=m, default=1)
    cli_options.add(parser, "ffn", group=m, default=0, default_text="4 x --dim")
    cli_options.add(parser, "vocab", group=m, default=32000)
    cli_options.add(parser, "experts", group=m, default=0)
    cli_options.add(parser, "top_k", group=m, default=2, more="MoE")
    cli_options.add(parser, "expert_ffn", group=m, default=0, more="MoE", default_text="--ffn")
    cli_options.add(parser, "ep", group=m, default=0, more="MoE, GPUs sharing a layer's experts",
                    default_text="the most within a node dividing the experts and the data-parallel size")
    m.add_argument("--activation-share", type=float, default=1.0, metavar="S",
                   help="share of a micro-batch's activations kept on the GPU until its backward, 0 < S <= 1 (default: 1, all; "
                        "less with recomputation, FP8 storage or offload to host)")
    m.add_argument("--optimizer-bytes", type=float, default=12.0, metavar="N",
                   help="bytes of optimizer state per parameter, FP32 masters included (default: 12, AdamW in FP32)")
    m.add_argument("--zero1", action="store_true",
                   help="FP32 masters and optimizer state sharded over the data-parallel replicas (ZeRO-1; experts' over dp/ep)")
    c = parser.add_argument_group("cluster")
    cli_options.add(parser, "gpus", group=c, default_text="the traced run's ranks, else required")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default: 8)")
    c.add_argument("--peak-tflops", type=float, default=989.0, help="peak TFLOP/s per GPU (default: 989, H100 bf16)")
    c.add_argument("--efficiency", type=float, default=0.5, help="share of the peak the layers reach (default: 0.5)")
    c.add_argument("--memory-gib", type=float, default=80.0, help="memory per GPU in GiB (default: 80)")
    c.add_argument("--memory-limit", metavar="GIB",
                   help="the memory budget per GPU in GiB (replaces --memory-gib): rows over it do not fit, and one line says which "
                        "row wins at it and why; without --schedules, plans the candidates: dualpipe, dualpipev, interleaved-1f1b "
                        "and zbv, each without and with overlap (k = 0..--max-warmup-extra extra warm-up micro-batches)")
    c.add_argument("--max-warmup-extra", type=int, default=2, metavar="K",
                   help="with --memory-limit: interleaved-1f1b with overlap at k = 0..K extra warm-up micro-batches (default: 2)")
    c.add_argument("--intra-gbps", type=float, default=400.0, help="per-GPU bandwidth inside a node, GB/s (default: 400)")
    c.add_argument("--inter-gbps", type=float, default=50.0, help="per-GPU bandwidth across nodes, GB/s (default: 50)")
    c.add_argument("--latency-us", type=float, default=10.0, help="latency of every message, microseconds (default: 10)")
    r = parser.add_argument_group("what to plan")
    cli_options.add(parser, "microbatches", group=r, more="per pipeline", default_text="the traced run's, else required")
    cli_options.add(parser, "pp", group=r, type=str, metavar="P1,P2,...", more="the sizes to plan, comma-separated",
                    default_text="powers of two dividing --gpus, 2..64; traced: its own")
    r.add_argument("--schedules", metavar="S1,S2,...", help=f"schedules (default all: {', '.join(registry.names())})")
    r.add_argument("--from-trace", metavar="TRACE_JSON", help="use the op times a traced run measured (twinpipe demo --trace DIR writes DIR/trace.json)")
    r.add_argument("--top", type=int, default=None, help="show only the best N fitting rows")
    cli_options.add(parser, "plot", group=r, metavar="PNG", more="each step's parts as stacked bars")
    cli_options.add(parser, "json", group=r)
    r.add_argument("--workers", type=int, default=None,
                   help="processes to plan in (default: one per core, up to 8, when the plan is large; 1: this process)")
    add_gpt_options(parser, have=("layers", "dim", "seq_len", "vocab", "microbatch_size", "dp", "experts", "top_k"))
    return parser


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise checks.bad(flag, text, "must be ints >= 1 separated by commas")
    return values


def _model(args) -> Model | None:
    given = [name for name in _MODEL if getattr(args, name) is not None]
    if not given and args.from_trace:
        return None
    missing = [f"--{name.replace('_', '-')}" for name in _MODEL if getattr(args, name) is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (the model; or give --from-trace alone)")
    sizes = {"optimizer_bytes": args.optimizer_bytes}
    if args.gpt:  # twinpipe train's GPT: its MLPs are 4 x dim; bytes per value as it trains
        for flag, value, default in (("--optimizer-bytes", args.optimizer_bytes, 12.0), ("--activation-share", args.activation_share, 1.0),
                                     ("--zero1", args.zero1, False)):
            if value != default:  # the GPT's memory is the trainer's prediction: its own precision, optimizer and --zero
                raise checks.bad(flag, value, "is not taken with --gpt (the trainer's own options say how it trains)")
        if args.ffn not in (0, 4 * args.dim):
            raise checks.bad("--ffn", args.ffn, f"must be 4 x --dim = {4 * args.dim} with --gpt (the GPT's MLP)")
        if args.expert_ffn not in (0, 4 * args.dim):
            raise checks.bad("--expert-ffn", args.expert_ffn, f"must be 4 x --dim = {4 * args.dim} with --gpt (the GPT's experts)")
        run = gpt_run(args)
        mixed = run.precision == BF16_MIXED
        sizes = dict(param_bytes=run.elsize, grad_bytes=4 if mixed else run.elsize, activation_bytes=run.elsize,
                     optimizer_bytes=12 if mixed else 2 * run.elsize)
    return Model(layers=args.layers, hidden=args.dim, seq=args.seq_len, microbatch_size=args.microbatch_size,
                 ffn=args.ffn, vocab=args.vocab, experts=args.experts, top_k=args.top_k, expert_ffn=args.expert_ffn, ep=args.ep,
                 zero1=args.zero1, activation_share=args.activation_share, **sizes)


def memory_limit(text: str | None) -> float | None:
    """``--memory-limit`` in bytes (None when not given); ValueError naming it unless a number of GiB > 0."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise checks.bad("--memory-limit", text, "must be a number of GiB > 0")
    return value * 2**30


def _cluster(args, gpus: int, budget: float | None) -> Cluster:
    for flag, value in (("--peak-tflops", args.peak_tflops), ("--memory-gib", args.memory_gib), ("--intra-gbps", args.intra_gbps),
                        ("--inter-gbps", args.inter_gbps), ("--latency-us", args.latency_us)):
        checks.check_float(value, flag, low=0)
    return Cluster(gpus=gpus, gpus_per_node=args.gpus_per_node, peak_flops=args.peak_tflops * 1e12, efficiency=args.efficiency,
                   memory=budget or args.memory_gib * 2**30, intra_bw=args.intra_gbps * 1e9, inter_bw=args.inter_gbps * 1e9,
                   latency=args.latency_us * 1e-6)


def plan_from_args(args) -> tuple[list, str, str]:
    """The ranked predictions, a title and a caption; ValueError naming the bad option."""
    check_gpt_options(args)
    budget = memory_limit(args.memory_limit)
    checks.check_int(args.max_warmup_extra, "--max-warmup-extra", low=0)
    traced = load_traced(args.from_trace) if args.from_trace else None
    model = _model(args)
    gpus = args.gpus if args.gpus is not None else (traced.pp if traced else None)
    if gpus is None:
        raise ValueError("missing --gpus (the cluster's GPUs in all)")
    cluster = _cluster(args, gpus, budget)
    m = args.microbatches if args.microbatches is not None else (traced.microbatches if traced else None)
    if m is None:
        raise ValueError("missing --microbatches (per pipeline per step)")
    pp = _ints(args.pp, "--pp") if args.pp else ([traced.pp] if traced else default_pp_sizes(gpus))
    schedules = [registry.get(n.strip()).name for n in args.schedules.split(",") if n.strip()] if args.schedules else None
    if args.gpt and model is None:
        raise ValueError("--gpt needs the model (--layers, --dim, --seq-len), not --from-trace alone")
    gpt = gpt_run(args) if args.gpt else None
    rows = decision_candidates(args.max_warmup_extra) if budget and not schedules else None
    results = plan(model, cluster, m, pp, schedules, costs_for=traced.costs_for if traced else None, workers=args.workers, gpt=gpt,
                   rows=rows)
    if traced:
        c = traced.costs
        title = (f"plan from {args.from_trace} ({traced.schedule}, p={traced.pp}, m={traced.microbatches}): "
                 f"1F1B-stage T_F={c.t_f * 1e3:.2f} ms, T_B={c.t_b * 1e3:.2f} ms, T_W={c.t_w * 1e3:.2f} ms, T_comm={c.t_comm * 1e6:.0f} us"
                 + (" (the run had only full backwards: T_B and T_W are its halves)" if traced.split_assumed else "")
                 + (f"; its {traced.pp} ranks shared {c.cores} cores: op times alone, cores shared again" if c.cores else ""))
    else:
        kind = f"MoE {model.experts} experts top-{model.top_k}" if model.moe else "dense"
        title = (f"plan: {model.layers} layers x {model.hidden} ({kind}, {model.total_params() / 1e9:.1f}B params), seq {model.seq} x "
                 f"{model.microbatch_size}, {m} micro-batches; {gpus} GPUs ({cluster.gpus_per_node}/node)")
    caption = ("step = simulated pipeline + DP all-reduce + all-reduce between weight copies (not overlapped). 'simulated': "
               f"m=a,b→M: extended linearly from two exact simulations (~: not yet periodic, approximate); searching schedules "
               f"skipped above {PLANNED_CAP} (stage, micro-batch) pairs.")
    if model is None:
        caption += " No model given: memory and gradient all-reduces are not counted."
    return results, title, caption


def run_plan(args) -> int:
    started = time.perf_counter()
    try:
        results, title, caption = plan_from_args(args)
        picture = draw_plan(results, args.plot, title) if args.plot else None
    except ValueError as error:
        print(f"twinpipe plan: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_dicts(results), indent=1))
        return 0
    print_table(results, title, caption + f" Planned in {time.perf_counter() - started:.2f} s.", args.top)
    if args.memory_limit is not None:
        print(verdict(results, memory_limit(args.memory_limit)))
    if args.gpt:
        _print_gpt_memory(results, args)
    if picture:
        print(f"picture: {picture}")
    return 0


def _print_gpt_memory(results: list, args) -> None:
    """Per-rank memory tables of the rows shown (fitting ones, ``--top``), twinpipe train's GPT."""
    from rich.console import Console

    from twinpipe.sim.gpt import RankPrediction
    from twinpipe.sim.memory import MemoryParts

    shown = [p for p in results if p.fits][: args.top] if args.top else [p for p in results if p.fits]
    console = Console()
    for p in shown:
        ranks = [RankPrediction(r["pp_rank"], r["dp_rank"], MemoryParts.from_dict(r)) for r in p.memory_parts]
        console.print(memory_table(f"{p.label}, pp={p.pp} x dp={p.dp}: memory per rank, bytes (twinpipe train's GPT)", ranks,
                                   bound=args.experts > 0))
