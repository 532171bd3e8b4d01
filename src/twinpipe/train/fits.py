"""Will a ``twinpipe train`` run fit? What it needs per rank, against what this machine has.

Checked before any rank starts (``twinpipe train``'s checks), so a run too big for the machine
stops with one line instead of dying in an allocator inside a rank. The need is the fullest
pipeline rank's: for the dense GPT, the prediction its run's report will make
(``twinpipe.sim.gpt``); for a MoE model an estimate: its stages' parameters, gradients, master weights and AdamW state
(``twinpipe.sim.memory.state_prediction``, from the parameter counts of the model built on the
meta device: no memory; a MoE block's experts counted as MLPs of the dense block's size), its peak activations (each stage's M_B estimated from the GPT's shapes,
the peak per rank from the simulator, ``twinpipe.sim``) and the batch every rank samples. What
the machine has: free GPU memory per device (``torch.cuda.mem_get_info``), or the host's
``MemAvailable`` (``/proc/meminfo``; else ``os.sysconf``) shared by the ranks started on it.
"""

from __future__ import annotations

import dataclasses
import os

from twinpipe.sim.memory import format_bytes, state_prediction

__all__ = ["stage_activation_bytes", "need_per_rank", "available_per_rank", "check_fits"]

_ELSIZE = {"float32": 4, "float64": 8, "bfloat16": 2}


def stage_activation_bytes(names: list[str], cfg, microbatch_size: int, elsize: int) -> int:
    """M_B of a stage of the GPT (its layers' ``names``), in bytes: per block the tensors autograd
    and W keep (16 b t d values: the norms' and linears' inputs, q/k/v, the 4x MLP twice) and the
    attention weights (b h t t); the head keeps 2 b t d and its FP32 log-softmax (b t vocab)."""
    b, t, d = microbatch_size, cfg.seq_len, cfg.dim
    total = 0
    for name in names:
        if name.startswith("blocks"):
            total += (16 * b * t * d + b * cfg.heads * t * t) * elsize
        elif name == "head":
            total += 2 * b * t * d * elsize + b * t * cfg.vocab * 4
    return total


def need_per_rank(args, cfg) -> tuple[int, dict]:
    """The fullest pipeline rank of the run ``args`` describes: (rank, bytes by part). The dense GPT
    (no experts, no multi-token prediction): what its train-log.json will list as ``"predicted"``
    (``twinpipe.sim.gpt.GPTRun``, as ``twinpipe simulate --gpt``); else the estimate below."""
    data = 2 * args.batch_size * cfg.seq_len * 8 + args.corpus_bytes  # the batch (int64 ids and targets), the corpus
    if not cfg.experts and not cfg.mtp_depth:
        from twinpipe.sim.gpt import GPTRun

        run = GPTRun.of(cfg, args.microbatch_size, dtype=args.dtype, precision=getattr(args, "precision", "pure"),
                        zero=getattr(args, "zero", 0), overlap_dp=getattr(args, "overlap_dp", True))
        ranks = run.predict(args.schedule, args.pp, args.batch_size // (args.dp * args.microbatch_size), args.dp)
        fullest = max(ranks, key=lambda r: r.parts.total)
        parts = fullest.parts.to_dict()
        parts.pop("total")
        return fullest.pp_rank, {**parts, "data": data}
    import torch

    from twinpipe.schedule import resolve
    from twinpipe.sim import CostModel, summarize
    from twinpipe.train.model import GPT
    from twinpipe.train.stages import split

    with torch.device("meta"):  # MoE routing tables cannot be built there: the dense model, experts added below
        model = GPT(dataclasses.replace(cfg, experts=0, balance_alpha=0.0, score="softmax"))
    spec = resolve(args.schedule, args.pp)
    placement = spec.placement
    stages = split(model, placement.num_model_stages, "params")  # "time" needs a run: the params cut stands in
    numels = [[p.numel() for p in stage.parameters()] for stage in stages]
    if cfg.experts:  # each data-parallel rank holds experts/dp MLPs per block (and a router) instead of one MLP
        mlp = 8 * cfg.dim * cfg.dim + 5 * cfg.dim
        extra = (cfg.experts // args.dp - 1) * mlp + cfg.dim * cfg.experts
        for k, stage in enumerate(stages):
            numels[k] += [extra] * sum(name.startswith("blocks") for name in stage.names)
    mixed = getattr(args, "precision", "pure") == "bf16-mixed"
    elsize = 2 if mixed else _ELSIZE.get(args.dtype, 4)
    m_b = [stage_activation_bytes(stages[placement.model_stage(s)].names, cfg, args.microbatch_size, elsize)
           for s in range(placement.num_stages)]
    m = args.batch_size // (args.dp * args.microbatch_size)
    peaks = summarize(spec.build(m), CostModel(m_b=m_b, mw=1.0), check=False).peak
    shard = args.dp if getattr(args, "zero", 0) == 1 else 1
    best = (-1, -1, {})
    for rank in range(args.pp):
        held = [n for s in placement.stages_of(rank) for n in numels[placement.model_stage(s)]]
        parts = state_prediction(held, elsize, mixed=mixed, updated=[n // shard for n in held]).to_dict()
        parts.pop("total")
        parts["activations_peak"] = int(peaks[rank])
        parts["data"] = data
        total = sum(parts.values())
        if total > best[0]:
            best = (total, rank, parts)
    return best[1], best[2]


def available_per_rank(args) -> tuple[int, str]:
    """Bytes one rank can use here, and where the number comes from."""
    here = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if "RANK" in os.environ else args.pp * args.dp
    if args.device == "cuda":
        import torch

        free = min(torch.cuda.mem_get_info(i)[0] for i in range(min(here, torch.cuda.device_count())))
        return free, f"{format_bytes(free)} free on each GPU"
    total = _mem_available()
    return total // here, f"{format_bytes(total)} available on this host (MemAvailable) for {here} process(es)"


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(args, cfg) -> None:
    """ValueError (one line) when the fullest rank needs more than a rank has here."""
    rank, parts = need_per_rank(args, cfg)
    need = sum(parts.values())
    have, source = available_per_rank(args)
    if need <= have:
        return
    names = {"params": "weights", "grads": "gradients", "master": "master weights", "optimizer": "optimizer state",
             "activations_peak": "activations", "data": "data"}
    shown = ", ".join(f"{names[k]} {format_bytes(v)}" for k, v in parts.items() if v)
    raise ValueError(f"the run needs about {format_bytes(need)} per rank (pipeline rank {rank}: {shown}) and this machine "
                     f"has {format_bytes(have)} per rank ({source}): use a smaller --batch-size, --microbatch-size, --dim, "
                     "--layers or --seq-len, or more ranks")
