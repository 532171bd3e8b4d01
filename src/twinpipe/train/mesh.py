"""The device mesh training runs on: data-parallel x pipeline ranks (``("dp", "pp")``), and the
expert-parallel groups inside it.

Pipeline ranks are the inner dimension (global rank = dp_rank * pp + pp_rank), so a pipeline's
neighbours are neighbouring processes. Expert parallelism of size ``ep`` (dividing ``dp``) splits
each stage's data-parallel ranks into ``dp/ep`` EP groups of consecutive data-parallel ranks (the
experts spread over each), and the ranks at the same place of every EP group form an
expert-data-parallel group (the replicas of the same experts, whose gradients it sums), as
Megatron's expert-data-parallel: the view ``("edp", "ep", "pp")`` of the same ranks,
``dp_rank = edp_rank * ep + ep_rank``. ``ep = dp``: the EP group is the data-parallel group (no
expert replicas); ``ep = 1``: every rank holds every expert, replicated over data parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from twinpipe.checks import bad, check_int

__all__ = ["TrainMesh", "ExpertGroups", "build_mesh", "rank_name"]

DIMS = ("dp", "pp")
EXPERT_DIMS = ("edp", "ep", "pp")


@dataclass(frozen=True)
class ExpertGroups:
    """One rank's expert-parallel groups (``TrainMesh.expert_groups``): ``ep_group`` the experts spread
    over (None when ``ep`` is 1), ``edp_group`` their replicas (None when ``ep`` is ``dp``);
    ``ep_mesh``: the 1-D ``DeviceMesh`` of ``ep_group`` (checkpoints shard expert rows over it)."""

    ep: int
    ep_rank: int
    edp_rank: int
    ep_group: object
    edp_group: object
    ep_mesh: object


@dataclass
class TrainMesh:
    mesh: DeviceMesh
    dp: int
    pp: int
    _expert_groups: dict = field(default_factory=dict, repr=False, compare=False)  # ep -> ExpertGroups, made once

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp")

    @property
    def dp_group(self):
        return self.mesh.get_group("dp")

    @property
    def pp_group(self):
        return self.mesh.get_group("pp")

    @property
    def is_first(self) -> bool:
        """The rank that prints and writes files (dp 0, pp 0)."""
        return self.dp_rank == 0 and self.pp_rank == 0

    def expert_groups(self, ep: int) -> ExpertGroups:
        """This rank's EP and expert-data-parallel groups for expert-parallel size ``ep`` (dividing
        ``dp``; the one rule above). Collective the first time for an ``ep`` strictly between 1 and
        ``dp`` (every rank calls it, with the same ``ep``); made once per ``ep``, then reused."""
        check_int(ep, "ep", low=1)
        if self.dp % ep:
            divisors = ", ".join(str(d) for d in range(1, self.dp + 1) if self.dp % d == 0)
            raise bad("ep", ep, f"must divide dp={self.dp} (allowed are {divisors}): each stage's data-parallel "
                      "ranks split into dp/ep expert-parallel groups")
        if ep not in self._expert_groups:
            self._expert_groups[ep] = self._make_expert_groups(ep)
        return self._expert_groups[ep]

    def _make_expert_groups(self, ep: int) -> ExpertGroups:
        dp_mesh = self.mesh["dp"]
        if ep == self.dp:  # the data-parallel group itself
            return ExpertGroups(ep, self.dp_rank, 0, self.dp_group if ep > 1 else None, None, dp_mesh)
        if ep == 1:
            return ExpertGroups(1, 0, self.dp_rank, None, self.dp_group, None)
        ranks = self.mesh.mesh.view(self.dp // ep, ep, self.pp)  # dp_rank = edp_rank * ep + ep_rank
        view = DeviceMesh(self.mesh.device_type, ranks, mesh_dim_names=EXPERT_DIMS)
        return ExpertGroups(ep, view.get_local_rank("ep"), view.get_local_rank("edp"), view.get_group("ep"),
                            view.get_group("edp"), view["ep"])


def build_mesh(dp: int, pp: int, device_type: str = "cpu") -> TrainMesh:
    """A (dp, pp) mesh over every rank of the world (collective: every rank calls it)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group() first (or use torchrun)")
    for name, value in (("dp", dp), ("pp", pp)):
        check_int(value, name, low=1)
    world = dist.get_world_size()
    if dp * pp != world:
        raise ValueError(f"dp={dp} x pp={pp} = {dp * pp} ranks, but the world has {world}: the mesh sizes must multiply to the world size")
    ranks = torch.arange(world).view(dp, pp)
    return TrainMesh(DeviceMesh(device_type, ranks, mesh_dim_names=DIMS), dp, pp)


def rank_name(rank: int, pp: int) -> str:
    """Global ``rank`` by its mesh coordinates, as messages name it: ``"dp=1 pp=0"``."""
    return f"dp={rank // pp} pp={rank % pp}"
