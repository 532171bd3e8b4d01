"""Mirrored copies of model stages: exchanging them between ranks, summing gradients, syncing weights.

With several chains (DualPipe, BitPipe, Chimera) each chain is a whole copy of the model, so a
model stage has one copy per chain, possibly on several ranks. ``Mirrors.sync_grads`` makes every
copy hold the sum of all copies' gradients; ``Mirrors.sync_weights`` gives every copy one copy's
weights. Before any payload moves, each pair of ranks swaps a header and both check it, so copies
that disagree (shapes, dtypes, the operation, the pipeline) raise ``PipelineMismatchError`` on both.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn

from twinpipe.runtime.comm import PointToPoint, wait_work
from twinpipe.runtime.errors import PipelineMismatchError
from twinpipe.runtime.main_grad import grad_of, zeros_if_missing
from twinpipe.schedule.placement import Placement

__all__ = ["HEADER_TAG", "Mirrors", "copies_of"]

# The p2p tag of every pipeline's mirrored-copy headers: above every pipeline's message tags
# (1 to 2**20) and mirrored payload tags (2**20 + 1 to 2**21), and not 0 (the user's default).
HEADER_TAG = (1 << 21) + 1


def copies_of(placement: Placement, rank: int, stages) -> dict[int, list[tuple[int, int]]]:
    """Model stage -> all its copies as (rank, stage), in chain order, for each model stage ``rank``
    holds (among its ``stages``) that has more than one copy.

    With several chains each chain is a whole copy of the model, and a stage runs the model
    stage at its position in its chain (``Placement.model_stage``): DualPipe, BitPipe and
    Chimera keep two copies of each, Chimera with k pairs 2k. Copies may share a rank."""
    copies: dict[int, list[tuple[int, int]]] = {}
    if len(placement.chains) > 1:
        for chain in placement.chains:
            for stage in chain:
                copies.setdefault(placement.model_stage(stage), []).append((placement.rank_of(stage), stage))
    mine = sorted({placement.model_stage(s) for s in stages})
    return {k: copies[k] for k in mine if len(copies.get(k, ())) > 1}


def _flat(module: nn.Module, grads: bool, device: torch.device) -> torch.Tensor:
    """A new flat tensor of the gradients (or weights) of ``module``."""
    parts = [(grad_of(p) if grads else p.detach()).reshape(-1) for p in module.parameters()]
    return torch.cat(parts) if parts else torch.zeros(0, device=device)


def _unflat(module: nn.Module, flat: torch.Tensor, grads: bool) -> None:
    """Copy ``flat`` into the gradients (or weights) of ``module``."""
    offset = 0
    with torch.no_grad():
        for p in module.parameters():
            n = p.numel()
            (grad_of(p) if grads else p).copy_(flat[offset : offset + n].view_as(p))
            offset += n


@dataclass(frozen=True, kw_only=True)
class Mirrors:
    """One pipeline's copies of mirrored model stages on this rank, and how it reaches the others.

    ``copies`` is ``copies_of(...)`` for this rank; ``modules`` maps this rank's stages to their
    modules; ``p2p`` gives the process group and its ranks; ``identity`` names the pipeline in
    headers (two pipelines never pair their copies)."""

    rank: int
    copies: dict[int, list[tuple[int, int]]]
    modules: dict[int, nn.Module]
    device: torch.device
    p2p: PointToPoint
    timeout: float
    identity: str

    @property
    def payload_tag(self) -> int:
        """The p2p tag of the payloads: this pipeline's own, like its messages' tag (1 to 2**20)
        but above every pipeline's, and never 0 (gloo's default, the user's)."""
        return self.p2p.tag + (1 << 20)

    def sync_grads(self) -> None:
        """Sum the gradients of all copies of each model stage into every copy on this rank, in
        chain order (bitwise equal on every rank); a missing ``.grad`` counts as zeros."""
        for items in self.copies.values():
            for p in (p for r, s in items if r == self.rank for p in self.modules[s].parameters()):
                zeros_if_missing(p)  # main_grad (mixed precision) or .grad
        flats = self.exchange("sync_mirrored_grads()", grads=True)
        for items in self.copies.values():
            total = flats[items[0][1]]
            for _, s in items[1:]:
                total = total + flats[s]
            for r, s in items:
                if r == self.rank:
                    _unflat(self.modules[s], total, grads=True)

    def sync_weights(self) -> None:
        """Give every copy on this rank the weights of the copy on the lowest rank (of several
        copies there, the lowest chain's)."""
        flats = self.exchange("sync_mirrored_weights()", grads=False)
        for items in self.copies.values():
            source = min(range(len(items)), key=lambda i: (items[i][0], i))
            for i, (r, s) in enumerate(items):
                if r == self.rank and i != source:
                    _unflat(self.modules[s], flats[items[source][1]], grads=False)

    def exchange(self, what: str, grads: bool) -> dict[int, torch.Tensor]:
        """Stage -> flat gradients (or weights) of every copy of this rank's mirrored model stages:
        its own, and the other ranks' received from them.

        Each rank sends a peer its copies of the model stages they share, by model stage then chain.
        A header goes first, and both sides check it: the operation, the pipeline, the parameters'
        shapes and dtypes, and the element counts each sends and expects. The check is symmetric,
        so both ranks of a pair raise ``PipelineMismatchError`` before any payload moves (a size
        mismatch would abort the process inside gloo; grads paired with weights, or with another
        pipeline's, would be silently wrong).
        In the registered placements the ranks holding copies of one model stage all hold the same
        model stages, so a disagreement reaches every one of them."""
        flats = {s: _flat(self.modules[s], grads, self.device) for items in self.copies.values() for r, s in items if r == self.rank}
        numel = {k: flats[next(s for r, s in items if r == self.rank)].numel() for k, items in self.copies.items()}
        own, signature = self._signatures()
        peers = sorted({r for items in self.copies.values() for r, _ in items} - {self.rank})
        plan = {peer: self._plan(peer, what, flats, numel, signature, own) for peer in peers}
        # Headers go under one tag for every pipeline, so that two ranks syncing different pipelines
        # meet and raise at once; payloads under this pipeline's own (see payload_tag).
        replies = {peer: torch.empty_like(plan[peer].header) for peer in peers}
        self._swap({peer: plan[peer].header for peer in peers}, replies, what, HEADER_TAG)
        for peer in peers:
            plan[peer].check(replies[peer], self.rank, peer, what)
        if own:  # every copy is on this rank (no peer to disagree with)
            raise PipelineMismatchError(f"rank {self.rank}: {what}: the copies disagree{own} in shapes or dtypes")
        outgoing = {peer: plan[peer].outgoing for peer in peers}
        incoming = {peer: torch.empty(plan[peer].expect, dtype=outgoing[peer].dtype, device=outgoing[peer].device) for peer in peers}
        self._swap(outgoing, incoming, what, self.payload_tag)
        for peer in peers:
            offset = 0
            for k, s in plan[peer].theirs:
                flats[s] = incoming[peer][offset : offset + numel[k]]
                offset += numel[k]
        return flats

    def _signatures(self) -> tuple[str, dict[int, list[str]]]:
        """The parameters' shapes and dtypes of each mirrored model stage here, and a note when this
        rank's own copies of one differ: it makes every header differ, so that every peer raises too."""
        signature, differ = {}, []
        for k, items in self.copies.items():
            layouts = {repr([(tuple(p.shape), str(p.dtype)) for p in self.modules[s].parameters()])
                       for r, s in items if r == self.rank}
            signature[k] = sorted(layouts)
            if len(layouts) > 1:
                differ.append(k)
        own = f"; rank {self.rank}'s own copies of model stages {differ} differ" if differ else ""
        return own, signature

    def _plan(self, peer: int, what: str, flats, numel, signature, own: str) -> _Pair:
        """What this rank sends ``peer``, expects back, and says about it in the header."""
        shared = [k for k, items in self.copies.items() if any(r == peer for r, _ in items)]
        theirs = [(k, s) for k in shared for r, s in self.copies[k] if r == peer]
        outgoing = torch.cat([flats[s] for k in shared for r, s in self.copies[k] if r == self.rank])
        label = (f"{what} of {self.identity}'s model stages {shared}, "
                 f"parameters #{zlib.crc32(repr([signature[k] for k in shared]).encode()):08x}{own}")
        return _Pair(theirs, outgoing, sum(numel[k] for k, _ in theirs), label)

    def _swap(self, outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor], what: str, tag: int) -> None:
        """Send ``outgoing[peer]`` to each peer and receive ``incoming[peer]`` under p2p ``tag``: all
        posted, then each awaited."""
        group, works = self.p2p.group, []
        for peer in outgoing:
            g = self.p2p.group_rank_of[peer]
            works += [(peer, group.send([outgoing[peer]], g, tag)), (peer, group.recv([incoming[peer]], g, tag))]
        for peer, work in works:
            wait_work(work, self.timeout, f"rank {self.rank}: {what} waiting for rank {peer}")


class _Pair:
    """One peer's side of an exchange: its copies this rank receives (model stage, its stage), what
    this rank sends it, how many elements it expects back, and the label both headers check."""

    def __init__(self, theirs: list[tuple[int, int]], outgoing: torch.Tensor, expect: int, label: str):
        self.theirs, self.outgoing, self.expect, self.label = theirs, outgoing, expect, label
        self.header = torch.tensor([zlib.crc32(label.encode()), outgoing.numel(), expect], dtype=torch.int64)

    def check(self, reply: torch.Tensor, rank: int, peer: int, what: str) -> None:
        """Raise unless ``peer``'s header says what this one does (so both ranks raise alike)."""
        crc, sent, expected = reply.tolist()
        if [crc, sent, expected] != [zlib.crc32(self.label.encode()), self.expect, self.outgoing.numel()]:
            raise PipelineMismatchError(
                f"rank {rank}: {what} with rank {peer}: the copies disagree ({self.label}; {self.outgoing.numel()} "
                f"elements to send here and {self.expect} expected; rank {peer} sends {sent}, expects {expected}, and its "
                f"header is #{crc:08x}: another operation or pipeline, or other shapes or dtypes). Every copy of a "
                "stage must be the same module, and every rank must call the same sync_mirrored_* method "
                "of the same pipeline."
            )
