"""The device mesh training runs on: data-parallel x pipeline ranks (``("dp", "pp")``).

Pipeline ranks are the inner dimension (global rank = dp_rank * pp + pp_rank), so a pipeline's
neighbours are neighbouring processes. MoE models need no third dimension: a stage's expert-parallel
group is its data-parallel group (``experts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from twinpipe.checks import check_int

__all__ = ["TrainMesh", "build_mesh", "rank_name"]

DIMS = ("dp", "pp")


@dataclass
class TrainMesh:
    mesh: DeviceMesh
    dp: int
    pp: int

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
