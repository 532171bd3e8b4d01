"""The two process groups of a (pipeline x expert) device mesh."""

from __future__ import annotations

__all__ = ["pp_ep_groups"]


def pp_ep_groups(mesh, pp: str = "pp", ep: str = "ep") -> tuple:
    """``(pipeline group, expert-parallel group)`` of this rank in a 2-D ``DeviceMesh`` whose
    dimensions are named ``pp`` and ``ep`` (``init_device_mesh(..., mesh_dim_names=("pp", "ep"))``)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if sorted(names) != sorted((pp, ep)):
        raise ValueError(f"mesh has dimensions {names!r}; it needs exactly two, named {pp!r} and {ep!r} "
                         f"(init_device_mesh(device, (pp, ep), mesh_dim_names=({pp!r}, {ep!r})))")
    return mesh[pp].get_group(), mesh[ep].get_group()
