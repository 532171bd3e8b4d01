"""Parameter ownership: which parameters this rank holds, reduces, updates and owns, and its reducer.

* held: every ``(model name, parameter)`` of this rank's stage modules; one tensor may be held under
  two names (tied embeddings whose ends are on one rank) and is updated once;
* reduced: dense parameters are summed over the data-parallel replicas by a ``DataParallelReducer``
  (``ShardedReducer`` with ZeRO-1), in parts: one per stage when the reduction overlaps the pipeline
  step or ZeRO-1 spreads over mirrored copies, else one of all, then each tied tensor in a part of
  its own (its gradient is final only after the tied sum); MoE experts by an ``expert_reducer`` of
  their own over the expert-data-parallel group (the same experts in every EP group; none when the
  EP group is the whole data-parallel group: one holder each);
* updated: what this rank's optimizer updates: everything held, or with ZeRO-1 its shard of the
  dense parameters and its experts;
* owned: one rank per model parameter counts it in the norm and writes it to checkpoints: the first
  copy at data-parallel rank 0, or (ZeRO-1) the copy and rank that updates it; an expert its holder
  in the first EP group (expert-data-parallel rank 0).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.runtime.collectives import collective
from twinpipe.schedule.placement import Placement
from twinpipe.sim.shards import mirror_copies
from twinpipe.train.config import TrainConfig
from twinpipe.train.grads import DataParallelReducer
from twinpipe.train.mesh import ExpertGroups, TrainMesh
from twinpipe.train.stages import is_mirror_copy
from twinpipe.train.zero import Copies, ShardedReducer

__all__ = ["Ownership", "own_parameters", "mirror_groups", "broadcast_start"]


@dataclass(frozen=True, kw_only=True)
class Ownership:
    params: list[torch.Tensor]  # every tensor held, once
    held: list[tuple[str, torch.Tensor, bool]]  # (model name, parameter, owned), mirrored copies included
    dense: list[torch.Tensor]  # the same on every data-parallel replica (no experts)
    owned: list[torch.Tensor]  # counted in the norm by this rank (tied copies left out)
    owned_names: list[str]
    updated: list[torch.Tensor]  # what this rank's optimizer updates
    reducer: DataParallelReducer
    expert_reducer: DataParallelReducer | None  # the experts' sum over their replicas (None: one holder each)
    overlap_dp: bool  # each stage's part starts as soon as its gradients are final (Pipeline's on_grads_ready)
    part_of: dict[int, int]  # pipeline stage -> its part (overlap_dp or spread over mirrored copies)
    tied_parts: list[int]  # the parts of the tied tensors, one each
    sharded: bool  # ZeRO-1


def mirror_groups(placement: Placement, mesh: TrainMesh, timeout: float) -> dict[int, dict[int, Copies]] | None:
    """ZeRO-1 over mirrored copies: model stage -> pipeline rank -> its ``zero.Copies``, with one
    process group per set of ranks holding a stage (every copy on every data-parallel rank), made
    on every rank in the same order; None without copies on distinct ranks (``shards.mirror_copies``)."""
    holders = mirror_copies(placement)
    if holders is None:
        return None
    ranks = mesh.mesh.mesh  # global rank of (dp rank, pp rank)
    made: dict[tuple[int, ...], object] = {}
    out: dict[int, dict[int, Copies]] = {}
    for k in sorted(holders):
        members = tuple(sorted(int(ranks[i, r]) for i in range(mesh.dp) for r in holders[k]))
        if members not in made:
            made[members] = dist.new_group(list(members), timeout=datetime.timedelta(seconds=timeout))
        position = tuple(tuple(members.index(int(ranks[i, r])) for r in holders[k]) for i in range(mesh.dp))
        out[k] = {r: Copies(c, len(holders[k]), made[members], position, k) for c, r in enumerate(holders[k])}
    return out


def own_parameters(modules: Sequence[nn.Module], stages: Sequence[int], *, placement: Placement, mesh: TrainMesh,
                   config: TrainConfig, experts: set[int], tied: Sequence[tuple[str, str]], timeout: float,
                   expert_groups: ExpertGroups) -> Ownership:
    """The ownership of this rank's stage ``modules`` (pipeline stages ``stages``); ``experts``: ``id()``
    of the routed experts among them, spread over ``expert_groups``; ``tied``: ``(main, copy)`` name
    pairs. Collective when ZeRO-1 spreads over mirrored copies (their process groups)."""
    named = [(s, name, p) for s, m in zip(stages, modules) for name, p in m.named_model_parameters()]
    params = list({id(p): p for _, _, p in named}.values())
    shared = len(params) < len(named)
    tied_names = {name for pair in tied for name in pair}
    # Every held tensor of a tied pair (both names, mirrored copies too): summed over the pipeline
    # before the data-parallel reduction, then reduced each in a bucket of its own.
    tied_held = list({id(p): p for _, name, p in named if name in tied_names}.values())
    dense = [p for p in params if id(p) not in experts]
    # A tensor held by two stages (shared tied weight) is final only when both are: not per stage.
    overlap_dp = config.overlap_dp and len(placement.chains) == 1 and not shared
    tied_ids = set(map(id, tied_held))
    untied = [p for p in dense if id(p) not in tied_ids]
    sharded = config.zero == 1 and mesh.dp > 1
    mirrored = mirror_groups(placement, mesh, timeout) if sharded else None
    parts, spreads, part_of = _parts(modules, stages, untied, overlap_dp, mirrored, placement, mesh.pp_rank)
    tied_dense = [p for p in tied_held if id(p) not in experts]
    tied_parts = list(range(len(parts), len(parts) + len(tied_dense)))
    parts += [[p] for p in tied_dense]
    if spreads is not None:
        spreads += [None] * len(tied_dense)  # tied tensors: each copy shards over data parallel alone
    if sharded:
        reducer = ShardedReducer(parts, mesh.dp_group, timeout, mode=config.dp_reduce, copies=spreads)
    else:
        reducer = DataParallelReducer(parts, mesh.dp_group, timeout, mode=config.dp_reduce)
    spread = {id(p) for part, cp in zip(parts, spreads or ()) if cp for p in part}  # owned by one copy of all
    updates = reducer.owns if sharded else (lambda p: True)  # the data-parallel rank updating a dense parameter
    first = mesh.dp_rank == 0 or sharded
    first_experts = expert_groups.edp_rank == 0  # the first EP group's holder owns an expert
    held = [(name, p, (id(p) in spread or not is_mirror_copy(placement, s))
             and ((id(p) in experts and first_experts) or (id(p) not in experts and first and updates(p))))
            for s, name, p in named]
    expert_params = [p for p in params if id(p) in experts]
    expert_reducer = None
    if expert_params and expert_groups.edp_group is not None:  # one part: the experts' gradients are final after the step
        expert_reducer = DataParallelReducer([expert_params], expert_groups.edp_group, timeout, mode=config.dp_reduce)
    copies = {copy for _, copy in tied}
    counted = [(n, p) for n, p, owned in held if owned and n not in copies]
    return Ownership(params=params, held=held, dense=dense, owned=[p for _, p in counted], owned_names=[n for n, _ in counted],
                     updated=[p for p in params if id(p) in experts or updates(p)], reducer=reducer,
                     expert_reducer=expert_reducer, overlap_dp=overlap_dp,
                     part_of=part_of, tied_parts=tied_parts, sharded=sharded)


def _parts(modules, stages, untied, overlap_dp, mirrored, placement, pp_rank):
    """The reducer's parts of the untied dense parameters: one per stage module (overlapped, or spread
    over mirrored copies: with each part's ``zero.Copies``), else one of all; and stage -> part."""
    if not (overlap_dp or mirrored):
        return [untied], None, {}
    dense = set(map(id, untied))
    parts = [list({id(p): p for _, p in m.named_model_parameters() if id(p) in dense}.values()) for m in modules]
    spreads = [mirrored[placement.model_stage(s)][pp_rank] for s in stages] if mirrored else None
    return parts, spreads, {s: i for i, s in enumerate(stages)}


def broadcast_start(dense: Sequence[torch.Tensor], mesh: TrainMesh, timeout: float, what: str) -> None:
    """Every replica starts from data-parallel replica 0's values of the ``dense`` parameters (experts:
    each is on one replica only, built there from the same seed)."""
    if mesh.dp > 1 and dense:
        flat = torch.cat([p.detach().reshape(-1) for p in dense])
        src = dist.get_global_rank(mesh.dp_group, 0)
        collective(dist.broadcast, flat, src=src, group=mesh.dp_group, timeout=timeout, what=what)
        offset = 0
        with torch.no_grad():
            for p in dense:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
