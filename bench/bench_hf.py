"""twinpipe.hf: F&B overlap of an HF MoE model with EP=2; twinpipe vs torch.distributed.pipelining on HF Llama.

``ep``: a small Qwen3-MoE (``--arch deepseek_v3``: DeepSeek-V3; random weights, float32) under DualPipeV on PP=2 x EP=2 (4 gloo
processes): its experts sharded by ``twinpipe.hf.experts.shard_experts_``, its layers in parts
(``twinpipe.hf.moe_layer.wrap_layer``); a step is ``Pipeline.step`` (no gradient reduction over the EP
group, no optimizer). Timed blocks of BLOCK steps with the F&B overlap on and off
alternate (the baseline is overlap off, measured in the same run); we print the median step time of
each, the median of the paired ratios on/off, and, from the F&B ops' recorded events
(``PartedStage.fb_events``, ``twinpipe.overlap.report.comm_hidden``), the share of the all-to-alls'
in-flight time during which a compute part ran (on: the overlap at work; off: should be ~0).

``vs-torch``: an HF Llama (random weights, float32) on 2 gloo processes, for every schedule both
libraries have: twinpipe as ``twinpipe.hf.build(...).pipeline()`` gives it, PyTorch with its
``PipelineStage`` on the same stage modules (``HFStage``: ``(input_ids, mask)`` in, ``(hidden,
mask)`` between stages, logits out) of an identical model, the same loss. Blocks of the two
libraries alternate as in ``bench_vs_torch.py``; baseline: torch's step; ratio twinpipe / torch,
the median of paired blocks.

    python bench/bench_hf.py [--parts ep,vs-torch] [--arch qwen3_moe] [--blocks 7] [--hidden 64] [--seq 32] [--rows 2]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

# the one block timer (bench/ is on sys.path when a bench script runs)
from bench_vs_torch import alternating_blocks

from twinpipe.launch import run_local

BLOCK = 2  # steps per timed block
CHUNKS = 8  # micro-batches per step
# twinpipe's name -> torch.distributed.pipelining class name (as bench_vs_torch.py)
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
PARTS = ("ep", "vs-torch")


def _ids(rows: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _paired(times: dict, a: str, b: str) -> tuple[float, float, float]:
    """Median of ``a``, of ``b``, and of the paired ratios a/b."""
    return (statistics.median(times[a]), statistics.median(times[b]),
            statistics.median(x / y for x, y in zip(times[a], times[b])))


# ---------------------------------------------------------------- EP: overlap on vs off
ARCHS = {"qwen3_moe": "Qwen3-MoE", "deepseek_v3": "DeepSeek-V3"}


def _moe_model(arch: str, hidden: int, experts: int):
    """Every layer a MoE layer, top-2, expert width 2*hidden (DeepSeek-V3: one shared expert, MLA,
    2 expert groups of which the router picks 1)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3MoeConfig

    common = {"vocab_size": 256, "hidden_size": hidden, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 2 * hidden, "moe_intermediate_size": 2 * hidden,
              "num_experts_per_tok": 2, "norm_topk_prob": True, "attn_implementation": "sdpa"}
    if arch == "deepseek_v3":
        config = DeepseekV3Config(**common, n_routed_experts=experts, n_shared_experts=1, n_group=2, topk_group=1,
                                  first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=hidden // 4,
                                  qk_rope_head_dim=hidden // 8, qk_nope_head_dim=hidden // 8, v_head_dim=hidden // 4,
                                  routed_scaling_factor=2.5)
    else:
        config = Qwen3MoeConfig(**common, head_dim=hidden // 4, num_experts=experts, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def _ep_worker(rank, world, arch, blocks, hidden, seq, rows, experts):
    from torch.distributed.device_mesh import init_device_mesh

    from twinpipe import hf
    from twinpipe.hf.experts import shard_experts_
    from twinpipe.hf.moe_layer import wrap_layer
    from twinpipe.overlap.report import comm_hidden

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    pp, ep = mesh["pp"].get_group(), mesh["ep"].get_group()
    model = shard_experts_(_moe_model(arch, hidden, experts), ep)
    stages = hf.build(model, "dualpipev", 2, dist.get_rank(pp), layout="E,t|t|t|t,L", wrap_layer=wrap_layer)
    ids = _ids(CHUNKS * rows, seq, 256, seed=1 + dist.get_rank(ep))  # each EP rank its own batch
    inputs, labels = stages.batch(ids, None, ids, num_chunks=CHUNKS)
    pipe = stages.pipeline(pp, dynamic_shapes=False)

    def step(overlap: bool) -> list:
        for m in stages.modules:
            m.overlap = overlap
            m.fb_events.clear()
        pipe.step(*inputs, num_chunks=CHUNKS, criterion=stages.criterion, labels=labels)
        pipe.zero_grad(set_to_none=True)
        return [events for m in stages.modules for events in m.fb_events]

    for overlap in (False, True):  # warm-up
        step(overlap)
    times, outputs = alternating_blocks({"off": lambda: step(False), "on": lambda: step(True)}, blocks, BLOCK)
    shares = {"on": [0.0, 0.0], "off": [0.0, 0.0]}
    for label, steps in outputs.items():
        for events in (e for ops in steps for e in ops):
            in_flight, hid = comm_hidden(events)
            shares[label][0] += in_flight
            shares[label][1] += hid
    pipe.close()
    return times, shares


def run_ep(arch: str, blocks: int, hidden: int, seq: int, rows: int, experts: int) -> None:
    out = run_local(4, _ep_worker, arch, blocks, hidden, seq, rows, experts, timeout=1800)
    times, _ = out[0]  # every rank's block ends at the same barrier
    t_on, t_off, ratio = _paired(times, "on", "off")
    flight = {k: sum(o[1][k][0] for o in out) for k in ("on", "off")}
    hidden_s = {k: sum(o[1][k][1] for o in out) for k in ("on", "off")}
    print(f"\n{ARCHS[arch]} (4 layers, hidden {hidden}, {experts} experts, top-2, float32) under DualPipeV, PP=2 x EP=2 "
          f"(4 gloo processes), {CHUNKS} micro-batches of {rows}x{seq} tokens per EP rank; {blocks} blocks of {BLOCK} steps "
          f"each, medians; baseline: overlap off")
    print(f"{'overlap':>8} {'step ms':>9} {'a2a in flight ms':>17} {'hidden by compute':>18}")
    steps = blocks * BLOCK
    for k, t in (("off", t_off), ("on", t_on)):
        share = hidden_s[k] / flight[k] if flight[k] else float("nan")
        print(f"{k:>8} {t * 1e3:9.1f} {flight[k] / steps / 4 * 1e3:17.2f} {100 * share:17.0f}%")
    print(f"step time on/off: {ratio:.3f} (median of paired blocks); a2a in flight: the all-to-alls of the F&B ops, "
          f"start to the return of their wait (peer waits included), per rank and step, mean of the 4 ranks; hidden: "
          f"the share of that time a compute part ran alongside")


# ---------------------------------------------------------------- twinpipe vs torch.distributed.pipelining
def _llama(hidden: int, layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def _vs_torch_case(name, rank, blocks, hidden, seq, rows, layers):
    """One schedule: paired block times, the layout, and the largest difference between the two
    libraries' micro-batch losses of the first step (on the rank with the last stage; else None)."""
    from torch.distributed import pipelining

    from twinpipe import hf

    ours_stages = hf.build(_llama(hidden, layers), name, 2, rank)
    theirs_stages = hf.build(_llama(hidden, layers), name, 2, rank, layout=ours_stages.layout, defer=False)
    ids = _ids(CHUNKS * rows, seq, 256, seed=1)
    mask = torch.ones_like(ids)
    inputs, labels = ours_stages.batch(ids, mask, ids, num_chunks=CHUNKS)
    ours = ours_stages.pipeline(dynamic_shapes=False)

    numbers, total = ours_stages.stages, len(ours_stages.layout.split("|"))
    crit, items = theirs_stages.criterion, torch.full((CHUNKS * rows,), hf.count_items(ids))
    stages = [pipelining.PipelineStage(m, s, total, torch.device("cpu")) for s, m in zip(numbers, theirs_stages.modules)]
    cls = getattr(pipelining.schedules, SCHEDULES[name])
    theirs = cls(stages if len(stages) > 1 else stages[0], n_microbatches=CHUNKS,
                 loss_fn=lambda logits, y: crit(logits, y, items), scale_grads=False)
    first, last = 0 in numbers, total - 1 in numbers

    def step_ours():
        loss, _ = ours.step(*inputs, num_chunks=CHUNKS, criterion=ours_stages.criterion, labels=labels)
        ours.zero_grad(set_to_none=True)
        return loss

    def step_theirs():
        losses = []
        theirs.step(*((ids, mask) if first else ()), **({"target": ids, "losses": losses} if last else {}))
        for m in theirs_stages.modules:
            m.zero_grad(set_to_none=True)
        return losses

    mine, torchs = step_ours(), step_theirs()  # warm-up, and the check that both compute the same
    diff = float((mine.detach().reshape(-1) - torch.stack(torchs).detach().reshape(-1)).abs().max()) if last else None
    step_ours(), step_theirs()
    times, _ = alternating_blocks({"twinpipe": step_ours, "torch": step_theirs}, blocks, BLOCK)
    ours.close()
    return times, ours_stages.layout, diff


def _torch_worker(rank, world, names, blocks, hidden, seq, rows, layers):
    return {name: _vs_torch_case(name, rank, blocks, hidden, seq, rows, layers) for name in names}


def run_vs_torch(names: list[str], blocks: int, hidden: int, seq: int, rows: int, layers: int) -> None:
    print(f"\nLlama ({layers} layers, hidden {hidden}, float32) on 2 gloo processes, {CHUNKS} micro-batches of {rows}x{seq} "
          f"tokens; {blocks} blocks of {BLOCK} steps per library, alternating; medians; baseline: torch's step")
    print(f"{'schedule':>16} {'layout':>16} {'torch ms':>9} {'twinpipe ms':>11} {'ratio':>6} {'loss diff':>9}")
    out = run_local(2, _torch_worker, names, blocks, hidden, seq, rows, layers, timeout=1800)
    for name in names:
        times, layout, _ = out[0][name]
        diff = max(o[name][2] for o in out if o[name][2] is not None)
        t_ours, t_torch, ratio = _paired(times, "twinpipe", "torch")
        print(f"{name:>16} {layout:>16} {t_torch * 1e3:9.1f} {t_ours * 1e3:11.1f} {ratio:6.2f} {diff:9.1e}", flush=True)
    print("ratio: twinpipe / torch, median of paired blocks; loss diff: largest |twinpipe - torch| over the first "
          "step's micro-batch losses")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--blocks", type=int, default=7, help=f"timed blocks per variant (each of {BLOCK} steps)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of both models")
    ap.add_argument("--seq", type=int, default=32, help="sequence length")
    ap.add_argument("--rows", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--arch", choices=list(ARCHS), default="qwen3_moe", help="the MoE model (ep)")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer (ep)")
    ap.add_argument("--layers", type=int, default=4, help="Llama decoder layers (vs-torch; at least 4)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"vs-torch: comma-separated, of {', '.join(SCHEDULES)}")
    args = ap.parse_args()
    parts, names = args.parts.split(","), args.schedules.split(",")
    for what, given, allowed in (("--parts", parts, PARTS), ("--schedules", names, SCHEDULES)):
        unknown = [n for n in given if n not in allowed]
        if unknown:
            ap.error(f"{what}: {', '.join(unknown)} not known; allowed: {', '.join(allowed)}")
    if args.hidden % 16 or args.hidden < 16:
        ap.error(f"--hidden={args.hidden}: must be a positive multiple of 16 (4 heads; DeepSeek-V3's rotary part hidden/8, even)")
    if args.layers < 4:
        ap.error(f"--layers={args.layers}: must be at least 4 (4 stages for the V schedules)")
    for flag in ("blocks", "seq", "rows", "experts"):
        if getattr(args, flag) < 1 or (flag == "experts" and args.experts % 2):
            ap.error(f"--{flag}={getattr(args, flag)}: must be a positive" + (" even" if flag == "experts" else "") + " integer")
    print(f"{os.cpu_count()} CPU cores, torch {torch.__version__}, 1 compute thread per process")
    if "ep" in parts:
        run_ep(args.arch, args.blocks, args.hidden, args.seq, args.rows, args.experts)
    if "vs-torch" in parts:
        run_vs_torch(names, args.blocks, args.hidden, args.seq, args.rows, args.layers)


if __name__ == "__main__":
    main()
