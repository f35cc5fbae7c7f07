"""Device meshes shared by every fit of a process, and the release of a group a fit made for itself.

A run that rolls back after a loss spike builds its strategy again in the same process (project.training.run). A
mesh made anew for each fit would keep the last fit's process groups (sockets and native threads) alive, and
destroying them is not safe either: DTensor's caches hold meshes by value, so a later fit's tensors may still reach
the earlier fit's groups. So a strategy asks `shared_mesh` for its mesh: one per shape for as long as the default
process group lives (tests/test_stability.py counts what ten rollbacks hold).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# (device type, sizes, names) -> (the default process group it was made in, the mesh)
_MESHES: dict[tuple, tuple[object, DeviceMesh]] = {}


def shared_mesh(device_type: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The process's mesh of `sizes` named `names` over its ranks: made once per default process group."""
    world = dist.group.WORLD
    key = (device_type, tuple(sizes), tuple(names))
    found = _MESHES.get(key)
    if found is None or found[0] is not world:  # first, or the default group was made again since
        found = _MESHES[key] = (world, init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names)))
    return found[1]


def release_group(group: dist.ProcessGroup | None) -> None:
    """Destroy a group a fit made for itself and nothing else holds (never the default group); on every rank alike."""
    if group is not None and group != dist.group.WORLD and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group(group)
