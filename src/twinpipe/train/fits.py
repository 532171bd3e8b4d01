"""Will a ``twinpipe train`` run fit? What it needs per rank, against what this machine has.

Checked before any rank starts (``twinpipe train``'s checks), so a run too big for the machine
stops with one line instead of dying in an allocator inside a rank. The need is the fullest
pipeline rank's: the prediction its run's report will make from the model's sizes
(``twinpipe.sim.gpt``; MoE blocks and multi-token prediction included, a MoE run's activations an
upper bound) and the batch every rank samples. What
the machine has: free GPU memory per device (``torch.cuda.mem_get_info``), or the host's
``MemAvailable`` (``/proc/meminfo``; else ``os.sysconf``) shared by the ranks started on it.
"""

from __future__ import annotations

import os

from twinpipe.precisions import PURE
from twinpipe.sim.memory import format_bytes

__all__ = ["stage_activation_bytes", "need_per_rank", "available_per_rank", "check_fits"]

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
    """The fullest pipeline rank of the run ``args`` describes: (rank, bytes by part): what its
    train-log.json will list as ``"predicted"`` (``twinpipe.sim.gpt.GPTRun``, as ``twinpipe simulate
    --gpt``; with MoE blocks the activations' upper bound), and the batch and corpus every rank samples."""
    from twinpipe.sim.gpt import GPTRun

    data = 2 * args.batch_size * cfg.seq_len * 8 + args.corpus_bytes  # the batch (int64 ids and targets), the corpus
    run = GPTRun.of(cfg, args.microbatch_size, dtype=args.dtype, precision=getattr(args, "precision", PURE),
                    zero=getattr(args, "zero", 0), overlap_dp=getattr(args, "overlap_dp", True))
    ranks = run.predict(args.schedule, args.pp, args.batch_size // (args.dp * args.microbatch_size), args.dp,
                        ep=getattr(args, "ep", None))
    fullest = max(ranks, key=lambda r: r.parts.total)
    parts = fullest.parts.to_dict()
    parts.pop("total")
    return fullest.pp_rank, {**parts, "data": data}


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
