"""Device meshes shared by every fit of a process, and the release of a group a fit made for itself.

A run that rolls back after a loss spike builds its strategy again in the same process (project.training.run). A
mesh made anew for each fit would keep the last fit's process groups (sockets and native threads) alive, and
destroying them is not safe either: DTensor's caches hold meshes by value, so a later fit's tensors may still reach
the earlier fit's groups. So a strategy asks `shared_mesh` for its mesh: one per shape for as long as the default
process group lives (tests/test_stability.py counts what ten rollbacks hold).

`run_groups` lists every group a run collects over (the default one, the meshes', the side groups made by
`side_group`), for what applies to all of them: the collective timeout (project.training.callbacks.timeouts).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# (device type, sizes, names) -> (the default process group it was made in, the mesh)
_MESHES: dict[tuple, tuple[object, DeviceMesh]] = {}
_SIDE_GROUPS: list[tuple[object, dist.ProcessGroup]] = []  # (the default group it was made in, the group)
_TIMEOUT: list[timedelta | None] = [None]  # what set_timeouts set last: side groups made later take it too


def shared_mesh(device_type: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The process's mesh of `sizes` named `names` over its ranks: made once per default process group."""
    world = dist.group.WORLD
    key = (device_type, tuple(sizes), tuple(names))
    found = _MESHES.get(key)
    if found is None or found[0] is not world:  # first, or the default group was made again since
        found = _MESHES[key] = (world, init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names)))
    return found[1]


def side_group() -> dist.ProcessGroup:
    """A group of every rank on the CPU (gloo), for a fit's own calls from its main thread (a flag the ranks agree
    on without waiting for a device); every rank alike, in the same order. `release_group` destroys it. Where the
    default group is gloo already (a run on CPUs), it is that group: a second one of the same ranks would only add
    each rank's sockets and threads."""
    world = dist.group.WORLD
    if world is not None and dist.get_backend(world) == "gloo":
        return world
    group = dist.new_group(backend="gloo", timeout=_TIMEOUT[0])
    _SIDE_GROUPS.append((dist.group.WORLD, group))
    return group


def release_group(group: dist.ProcessGroup | None) -> None:
    """Destroy a group a fit made for itself and nothing else holds (never the default group); on every rank alike."""
    if group is not None and group != dist.group.WORLD and dist.is_available() and dist.is_initialized():
        _SIDE_GROUPS[:] = [(world, g) for world, g in _SIDE_GROUPS if g is not group]
        dist.destroy_process_group(group)


def run_groups() -> list[dist.ProcessGroup]:
    """Every process group of this process's run: the default group, each shared mesh's (of the current default
    group), and the side groups; none where no default group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    world = dist.group.WORLD
    found = [world]
    for made_in, mesh in _MESHES.values():
        if made_in is world:
            found += mesh.get_all_groups()
    found += [group for made_in, group in _SIDE_GROUPS if made_in is world]
    return list({id(g): g for g in found if g is not None}.values())


def set_timeouts(timeout: timedelta) -> list[str]:
    """Every group of the run waits at most `timeout` in a collective from now on, and so do side groups made later.
    The backends that cannot change it (NCCL and gloo can) are returned by name, their groups left as they were."""
    _TIMEOUT[0] = timeout
    refused: list[str] = []
    for group in run_groups():
        try:
            group.set_timeout(timeout)
        except RuntimeError:  # torch's Backend::setTimeout refuses unless the backend overrides it (mpi, ucc)
            refused.append(dist.get_backend(group))
    return refused
