"""Activation memory per rank, per schedule: predicted against measured, with and without early release.

Every registered schedule on ``--pp`` CPU ranks (gloo), ``--microbatches`` micro-batches of a
Linear-Tanh-Linear-Tanh float64 stage with deferred weight gradients (``--model mlp``) or the
training GPT's stages (``--model gpt``) or a tiny ``transformers`` model cut by ``twinpipe.hf``
(``--model hf-llama``, ``--model hf-qwen3-moe``: float32, sequence 16). Per rank: the peak the step's activations reach
(``Pipeline.step(measure_memory=True)``, with message layouts known: declared, or for the
``transformers`` models fixed and learnt in an unmeasured first step), the prediction
(``Pipeline.predict_activation_peak`` from each stage measured alone) and their ratio; then the
same step with the runtime's early releases off (``--no-release``: all, or some of
``twinpipe.runtime.releases.RELEASES``) and what they save. Sizes are in units of one activation message (``rows x hidden`` values).
``--dynamic-shapes`` measures the ``transformers`` models as ``twinpipe.hf`` pipelines run by default
(``dynamic_shapes=True``): a header precedes every message, and a receive is posted only once its
header has arrived, later than the model's "as early as the order allows" (the prediction is then
an upper bound, by up to a message per channel).

    python bench/bench_memory.py --pp 2 --microbatches 8
"""

from __future__ import annotations

import argparse
import sys

import twinpipe.cli_options as cli_options


def _world(rank: int, world: int, names: list[str], args) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import twinpipe
    from twinpipe.runtime import releases
    from twinpipe.runtime.batches import batch_layout
    from twinpipe.runtime.memory import measure_stage
    from twinpipe.train.model import GPT, GPTConfig, lm_loss
    from twinpipe.train.stages import split, stage_modules

    out = {}
    m, rows, hidden = args.microbatches, args.rows, args.hidden
    off = set(releases.RELEASES) if args.no_release == "all" else set(args.no_release.split(","))
    for name in names:
        spec = twinpipe.schedule.resolve(name, world, **({"stages_per_rank": 2} if name == "interleaved-1f1b" else {}))
        placement = spec.placement
        torch.manual_seed(0)
        if args.model == "mlp":
            modules = [twinpipe.defer_weight_grads(nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                                                 nn.Tanh())).double() for _ in placement.stages_of(rank)]
            x = torch.randn(rows * m, hidden, dtype=torch.float64)
            y = torch.randn_like(x)
            samples = {s: (x[:rows],) for s in placement.stages_of(rank)}
            criterion, shapes = F.mse_loss, dict(tensor_shapes=[(rows, hidden)], tensor_dtype=torch.float64)
        elif args.model == "gpt":
            cfg = GPTConfig(vocab=64, seq_len=16, dim=hidden, heads=2, layers=max(2, placement.num_model_stages))
            cut = split(GPT(cfg), placement.num_model_stages)
            x = torch.randint(0, cfg.vocab, (rows * m, cfg.seq_len))
            y = torch.randint(0, cfg.vocab, (rows * m, cfg.seq_len))
            samples, h = {}, x[:rows]
            with torch.no_grad():
                for k, module in enumerate(cut):
                    samples.update({s: (h,) for s in placement.stages_of(rank) if placement.model_stage(s) == k})
                    h = module(h)
            modules = [twinpipe.defer_weight_grads(mod) for mod in stage_modules(cut, spec, world, rank)]
            criterion, shapes = lm_loss, dict(tensor_shapes=[(rows, cfg.seq_len, hidden)], tensor_dtype=torch.float32)
        else:
            made = _hf_world(args, spec, world, rank)
            stages, inputs, labels, samples, last_labels = made
            modules, criterion = stages.modules, stages.criterion
        if not args.model.startswith("hf-"):
            layout = batch_layout(spec, world, rank, m)
            inputs, labels, last_labels = layout.inputs(x), layout.labels(y), (y[:rows],)
            make = lambda: twinpipe.Pipeline(modules, spec, transport=args.transport, **shapes)  # noqa: E731
        else:
            make = lambda: stages.pipeline(transport=args.transport, dynamic_shapes=args.dynamic_shapes)  # noqa: E731
        peaks = []
        with make() as pipe:
            if args.model.startswith("hf-") and not args.dynamic_shapes:  # learn the layouts: the steps after the first
                pipe.step(*inputs, num_chunks=m, criterion=criterion, labels=labels)
            for turned_on in (set(releases.RELEASES), set(releases.RELEASES) - off):
                releases.EARLY_RELEASE = turned_on
                pipe.step(*inputs, num_chunks=m, criterion=criterion, labels=labels, measure_memory=True)
                peaks.append(pipe.last_memory.activations_peak)
            releases.EARLY_RELEASE = set(releases.RELEASES)
            stages = {s: measure_stage(mod, samples[s], first=placement.is_first(s), criterion=criterion if placement.is_last(s) else None,
                                       labels=last_labels if placement.is_last(s) else ()) for s, mod in zip(pipe.stages, pipe.module)}
            out[name] = (pipe.predict_activation_peak(m, stages), *peaks)
    return out


HF_ARCHS = {"hf-llama": "LlamaConfig", "hf-qwen3-moe": "Qwen3MoeConfig"}
HF_SEQ, HF_VOCAB = 16, 64


def _hf_world(args, spec, world: int, rank: int):
    """A tiny float32 ``transformers`` model (``--model hf-llama`` or ``hf-qwen3-moe``, random
    weights, a layer per stage at least) cut by ``twinpipe.hf.build``: this rank's stages, its
    inputs and labels, and each of its stages' input on micro-batch 0 (every rank's stages, built
    on copies of the model, run in model order)."""
    import torch
    import transformers as tf

    from twinpipe import hf

    options = {"stages_per_rank": 2} if spec.name == "interleaved-1f1b" else {}
    layers = max(2, spec.placement.num_model_stages)
    common = dict(vocab_size=HF_VOCAB, hidden_size=args.hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=2 * args.hidden, max_position_embeddings=HF_SEQ,
                  attn_implementation="sdpa", pad_token_id=0)
    if args.model == "hf-qwen3-moe":
        common.update(moe_intermediate_size=args.hidden // 2, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[], experts_implementation="eager", head_dim=args.hidden // 4)
    config = getattr(tf, HF_ARCHS[args.model])(**common)

    def model():
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()

    m, rows = args.microbatches, args.rows
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, HF_VOCAB, (rows * m, HF_SEQ), generator=g)
    mask = torch.ones_like(ids)
    stages = hf.build(model(), spec.name, world, rank, **options)
    inputs, labels = stages.batch(ids, mask, ids, num_chunks=m)
    placement = spec.placement
    by_stage = {}
    for r in range(world):
        built = stages if r == rank else hf.build(model(), spec.name, world, r, **options)
        for s, mod in zip(placement.stages_of(r), built.modules):
            by_stage.setdefault(placement.model_stage(s), mod)
    flows, flow = {}, (ids[:rows], mask[:rows])
    with torch.no_grad():
        for k in range(placement.num_model_stages):
            flows[k] = flow
            out = by_stage[k](*flow)
            flow = out if isinstance(out, tuple) else (out,)
    samples = {s: flows[placement.model_stage(s)] for s in placement.stages_of(rank)}
    counts = torch.full((rows,), hf.count_items(ids), dtype=torch.long)
    return stages, inputs, labels, samples, (ids[:rows], counts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    cli_options.add(parser, "pp", default=2)
    cli_options.add(parser, "microbatches", default=8)
    parser.add_argument("--model", choices=("mlp", "gpt", *HF_ARCHS), default="mlp",
                        help="the stage: mlp, gpt, or a tiny transformers model cut by twinpipe.hf (default: mlp)")
    parser.add_argument("--transport", choices=("auto", "process-group"), default="auto",
                        help="auto: shared memory between ranks on this host; process-group: gloo (default: auto)")
    parser.add_argument("--rows", type=int, default=32, help="rows of one micro-batch (default: 32)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default: 64)")
    parser.add_argument("--schedules", default=None, help="comma-separated names (default: every registered schedule)")
    parser.add_argument("--no-release", default="all", metavar="NAMES",
                        help="the early releases the comparison step turns off: all (default) or comma-separated names "
                             "from: losses, input grad, last message, sends")
    parser.add_argument("--dynamic-shapes", action="store_true",
                        help="transformers models: twinpipe.hf's default dynamic_shapes=True (a header before every message; "
                             "default here: fixed shapes, learnt in a first unmeasured step)")
    args = parser.parse_args(argv)
    from twinpipe.runtime.releases import RELEASES

    if args.no_release != "all" and not set(args.no_release.split(",")) <= set(RELEASES):
        parser.error(f"--no-release={args.no_release}: must be all or comma-separated names from: {', '.join(RELEASES)}")

    from twinpipe.launch import run_local
    from twinpipe.schedule.registry import names

    chosen = args.schedules.split(",") if args.schedules else sorted(
        n for n in names() if not (args.pp % 2 and n in ("dualpipe", "chimera", "bitpipe")))
    results = run_local(args.pp, _world, chosen, args, threads=1)
    unit = args.rows * args.hidden * (8 if args.model == "mlp" else 4 * (HF_SEQ if args.model.startswith("hf-") else 16))
    print(f"activation peak per rank, units of one message ({unit} B); {args.model} stage, pp={args.pp}, "
          f"{args.microbatches} micro-batches, transport {args.transport}")
    print(f"without: the same step with these early releases off: {args.no_release}")
    print("schedule           rank  predicted  measured  ratio     without  saved")
    worst = 0.0
    for name in chosen:
        for rank in range(args.pp):
            predicted, measured, before = results[rank][name]
            ratio = measured / predicted if predicted else float("nan")
            worst = max(worst, abs(ratio - 1))
            print(f"{name:18s} {rank:4d}  {predicted / unit:9.2f}  {measured / unit:8.2f}  {ratio:5.3f}   "
                  f"{before / unit:9.2f}  {1 - measured / before:5.1%}")
    print(f"largest |measured / predicted - 1|: {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
