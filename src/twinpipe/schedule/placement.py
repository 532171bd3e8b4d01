"""Stage placement: which rank holds which stage, and which stages a micro-batch walks through.

Stages are numbered globally. A *chain* is the ordered list of stages one micro-batch passes
through; most schedules have one chain, DualPipe has two (one per direction). Each rank runs
its stages as local modules in ascending stage order: ``modules[i]`` is ``stages_of(rank)[i]``.

- ``linear(p)``: stage r on rank r.
- ``looped(p, v)``: v*p stages, stage s on rank s % p (interleaved 1F1B).
- ``vshape(p)``: 2p stages, rank r holds r and 2p-1-r (ZB-V, DualPipeV: "cut in half").
- ``dual(p)``: DualPipe, Chimera; the V layout cut into two chains, stages 0..p-1 (forward
  direction, rank r holds model stage r) and p..2p-1 (reverse direction, rank r holds model
  stage p-1-r).
- ``dual_v(p)``: BitPipe; two V's in opposite directions, stages 0..2p-1 (the ``vshape`` chain:
  rank r holds model stages r and 2p-1-r) and 2p..4p-1 (its mirror: rank r holds model stages
  p-1-r and p+r). Four stages per rank.
- ``dual_pairs(p, k)``: Chimera with k pipeline pairs; 2k chains of p stages, chain 2i going down
  the ranks from rank i*p/k, chain 2i+1 going up from rank i*p/k - 1 (mod p). 2k stages per rank;
  ``dual_pairs(p, 1)`` is ``dual(p)``.

With several chains, each chain is one whole copy of the model: the stage at position k of any
chain is model stage k (the runtime's mirrored-gradient sync pairs copies by that position).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from twinpipe import checks

__all__ = ["Placement", "linear", "looped", "vshape", "dual", "dual_v", "dual_pairs"]


@dataclass(frozen=True)
class Placement:
    """Which rank holds each stage (``stage_ranks``) and the chains micro-batches follow."""

    kind: str
    num_ranks: int
    stage_ranks: tuple[int, ...]
    chains: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        stages = sorted(s for chain in self.chains for s in chain)
        if stages != list(range(len(self.stage_ranks))):
            raise ValueError(f"placement {self.kind}: chains must cover stages 0..{len(self.stage_ranks) - 1} once each")
        if any(not 0 <= r < self.num_ranks for r in self.stage_ranks):
            raise ValueError(f"placement {self.kind}: stage ranks must lie in 0..{self.num_ranks - 1}")

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @cached_property
    def _stages_by_rank(self) -> tuple[tuple[int, ...], ...]:
        by_rank: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for stage, rank in enumerate(self.stage_ranks):
            by_rank[rank].append(stage)
        return tuple(tuple(s) for s in by_rank)

    @cached_property
    def _neighbours(self) -> dict[int, tuple[int | None, int | None, int]]:
        result = {}
        for index, chain in enumerate(self.chains):
            for i, stage in enumerate(chain):
                prev = chain[i - 1] if i > 0 else None
                nxt = chain[i + 1] if i + 1 < len(chain) else None
                result[stage] = (prev, nxt, index)
        return result

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Global stages held by ``rank``, in local module order."""
        return self._stages_by_rank[rank]

    def rank_of(self, stage: int) -> int:
        return self.stage_ranks[stage]

    def prev_stage(self, stage: int) -> int | None:
        """The stage that feeds ``stage`` its inputs (None for a chain's first stage)."""
        return self._neighbours[stage][0]

    def next_stage(self, stage: int) -> int | None:
        """The stage that takes ``stage``'s outputs (None for a chain's last stage)."""
        return self._neighbours[stage][1]

    def chain_of_stage(self, stage: int) -> int:
        return self._neighbours[stage][2]

    def is_first(self, stage: int) -> bool:
        return self.prev_stage(stage) is None

    def is_last(self, stage: int) -> bool:
        return self.next_stage(stage) is None

    def microbatches_of_chain(self, chain: int, num_microbatches: int) -> range:
        """Micro-batches are split evenly and contiguously across chains."""
        per_chain = num_microbatches // len(self.chains)
        return range(chain * per_chain, (chain + 1) * per_chain)

    @property
    def num_model_stages(self) -> int:
        """Stages the model is cut into: with several chains (DualPipe, Chimera, BitPipe) each chain
        runs a whole copy of the model."""
        return len(self.chains[0])

    def model_stage(self, stage: int) -> int:
        """The model stage ``stage`` runs: its position in its chain. Copies of one model stage
        hold the same weights; their gradients are summed (``Pipeline.sync_mirrored_grads``)."""
        return self.stage_chain_position(stage)

    def stage_chain_position(self, stage: int) -> int:
        """How many stages precede ``stage`` in its chain (0 for a first stage)."""
        return self.chains[self.chain_of_stage(stage)].index(stage)


def _check_ranks(num_ranks: int) -> None:
    checks.check_int(num_ranks, "num_ranks", low=1)


def linear(num_ranks: int) -> Placement:
    _check_ranks(num_ranks)
    return Placement("linear", num_ranks, tuple(range(num_ranks)), (tuple(range(num_ranks)),))


def looped(num_ranks: int, stages_per_rank: int) -> Placement:
    _check_ranks(num_ranks)
    checks.check_int(stages_per_rank, "stages_per_rank", low=1)
    n = num_ranks * stages_per_rank
    return Placement("looped", num_ranks, tuple(s % num_ranks for s in range(n)), (tuple(range(n)),))


def _v_ranks(num_ranks: int) -> tuple[int, ...]:
    return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks))


def vshape(num_ranks: int) -> Placement:
    _check_ranks(num_ranks)
    return Placement("v", num_ranks, _v_ranks(num_ranks), (tuple(range(2 * num_ranks)),))


def dual(num_ranks: int) -> Placement:
    _check_ranks(num_ranks)
    p = num_ranks
    return Placement("dual", p, _v_ranks(p), (tuple(range(p)), tuple(range(p, 2 * p))))


def dual_v(num_ranks: int) -> Placement:
    _check_ranks(num_ranks)
    p = num_ranks
    down = _v_ranks(p)
    up = tuple(p - 1 - r for r in down)  # the mirror: rank r <-> p-1-r
    return Placement("dual-v", p, down + up, (tuple(range(2 * p)), tuple(range(2 * p, 4 * p))))


def dual_pairs(num_ranks: int, pairs: int) -> Placement:
    """k = ``pairs`` down/up chain pairs over p ranks, 2k divides p (Chimera, "more than two pipelines").

    Chain 2i (down pipeline i) puts model stage s on rank (s + i*p/k) mod p, chain 2i+1 (up
    pipeline i) on rank (p-1-s + i*p/k) mod p: pair i is pair 0 rotated by i*p/k ranks. Chain c
    holds stages c*p .. c*p+p-1, so with k = 1 this is ``dual(p)``.
    """
    _check_ranks(num_ranks)
    checks.check_int(pairs, "pairs", low=1, why=f"2*pairs dividing num_ranks={num_ranks}")
    if num_ranks % (2 * pairs):
        raise checks.bad("pairs", pairs, f"must make 2*pairs divide num_ranks={num_ranks}")
    p, shift = num_ranks, num_ranks // pairs
    ranks: list[int] = []
    for i in range(pairs):
        ranks += [(s + i * shift) % p for s in range(p)]  # down pipeline i
        ranks += [(p - 1 - s + i * shift) % p for s in range(p)]  # up pipeline i
    chains = tuple(tuple(range(c * p, (c + 1) * p)) for c in range(2 * pairs))
    return Placement("dual", p, tuple(ranks), chains)
