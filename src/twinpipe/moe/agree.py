"""The check before an EP collective whose sizes come from each rank's own state.

Each rank states the facts those sizes (and the meaning of what moves) follow from, in one
fixed-size all-gather that cannot abort on sizes; if a rank rejected its own input or any fact
differs, every rank raises a ValueError naming the ranks and the facts, and nothing else moves.
Without it, gloo pairs buffers of different sizes by aborting the process, or a rank waits for a
message its peer never sends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinpipe.runtime import waits
from twinpipe.runtime.agreement import Claim, disagreements
from twinpipe.runtime.collectives import Gathering, collective, padded_frame

__all__ = ["agree", "ep_timeout", "frame_device", "all_reduce"]


def ep_timeout(timeout) -> float:
    """``timeout`` checked; when None the limit in force (a pipeline's ``timeout`` inside its step,
    ``twinpipe.runtime.waits.limit``), else ``twinpipe.checks.DEFAULT_TIMEOUT``."""
    return waits.timeout_for(timeout)


def agree(group, facts: dict, what: str, timeout: float, device=None, rejected: Exception | None = None) -> None:
    """Compare ``facts`` (name -> value, compared as text, long ones by checksum) over ``group``;
    raise on every rank if they differ. ``rejected``: this rank's own error with its input,
    re-raised here after the peers heard of it (they raise a ValueError naming this rank).
    ``device``: where the frame goes (``frame_device``); CPU by default."""
    rank = dist.get_rank(group)
    waits.note(group, moved=False)  # inside a pipeline's step, a failure of the step breaks this group too
    claim = Claim(rank, {k: str(v) for k, v in facts.items()}, "rejected" if rejected else "ready",
                  str(rejected) if rejected else "")
    frame = padded_frame(claim.encode())
    if device is not None:
        frame = frame.to(device)
    waiting = f"{what}: EP rank {rank} waiting for its peers to compare {', '.join(facts)} (call it on every EP rank)"
    claims = [Claim.decode(f.cpu(), what) for f in Gathering(group, frame, timeout, waiting).result()]
    if rejected is not None:
        raise rejected
    others = [c for c in claims if c.status == "rejected"]
    if others:
        reasons = "; ".join(f"EP rank {c.rank} rejected its input: {c.reason}" for c in others)
        raise ValueError(f"{what}: {reasons}. Nothing was done on any EP rank.")
    # "key (rank 0: a; rank 1: b)" -> "key differs over the EP ranks (rank 0: a; rank 1: b)"
    problems = [f"{key} differs over the EP ranks {said[len(key) + 1:]}"
                for key in facts for said in disagreements(claims, [key])]
    if problems:
        raise ValueError(f"{what}: {'; '.join(problems)}. Every EP rank must hold blocks built and placed alike "
                         "and make the same calls; nothing was done on any EP rank.")


def frame_device(tensor: torch.Tensor) -> torch.device | None:
    """Where a check beside ``tensor``'s collectives sends its frame: CUDA tensors' device (NCCL
    groups move only those), else None (CPU)."""
    return tensor.device if tensor.is_cuda else None


def all_reduce(tensor: torch.Tensor, group, timeout: float, what: str) -> None:
    """Sum ``tensor`` over ``group`` in place, waiting at most ``timeout`` s (PipelineTimeoutError with ``what``)."""
    waits.note(group)
    collective(dist.all_reduce, tensor, group=group, timeout=timeout,
               what=f"{what}: EP rank {dist.get_rank(group)} waiting for its peers in the all-reduce")
