"""The process groups a strategy makes for one fit, released when the fit ends.

A run that rolls back after a loss spike builds its strategy again in the same process (project.training.run), and
each group holds sockets and native threads until it is destroyed: without this, every rollback would keep the last
fit's groups (tests/test_stability.py counts them over ten rollbacks).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def mesh_groups(mesh: DeviceMesh | None) -> list[dist.ProcessGroup]:
    """The process group of each of `mesh`'s dimensions (none for None)."""
    return [] if mesh is None else [mesh.get_group(dim) for dim in range(mesh.ndim)]


def release_groups(groups: Iterable[dist.ProcessGroup | None]) -> None:
    """Destroy each group once, never the default group that every fit shares; on every rank alike."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    seen: dict[int, dist.ProcessGroup] = {}
    for group in groups:
        if group is not None and group != dist.group.WORLD:
            seen.setdefault(id(group), group)
    for group in seen.values():
        dist.destroy_process_group(group)
