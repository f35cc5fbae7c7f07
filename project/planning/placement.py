"""Which of a layout's process groups stay inside a node and which cross nodes: the dry run and the planner say so,
since a group across nodes runs at the network's bandwidth, a tenth or less of the links inside a node."""

from __future__ import annotations

from typing import NamedTuple

from project.parallel.mesh import MeshShape


class GroupSpan(NamedTuple):
    """A kind of process group: its name, its ranks, and the most nodes any one group of that kind spans."""

    name: str
    ranks: int
    nodes: int

    def said(self) -> str:
        where = "in 1 node" if self.nodes == 1 else f"across {self.nodes} nodes"
        return f"{self.name} {self.ranks} ({where})"


def group_kinds(shape: MeshShape) -> list[tuple[str, tuple[str, ...]]]:
    """The layout's kinds of groups of more than one rank, innermost first, as (name, the mesh dimensions each
    spans): tensor, context, what FSDP or DDP reduce over (data x context, or HSDP's shard and replica groups),
    the experts' two, and a pipeline's stages."""
    dims = shape.dimensions
    kinds = [("tensor", ("tensor",)), ("context", ("context",))]
    if shape.hybrid:
        kinds += [("data_shard", ("data_shard",)), ("data_replicate", ("data_replicate",))]
    else:
        kinds.append(("data x context" if shape.context_parallel > 1 else "data", ("data_parallel",)))
    if shape.expert_parallel > 1:
        kinds += [("expert", ("expert",)), ("expert_data", ("expert_data",))]
    kinds.append(("pipeline", ("pipeline",)))
    return [(name, names) for name, names in kinds if all(dims[n].size > 1 for n in names)]


def group_spans(shape: MeshShape, devices_per_node: int) -> list[GroupSpan]:
    """Each kind of group (group_kinds) with the most nodes one of its groups spans, `devices_per_node` global ranks
    in order to a node."""
    found = []
    for name, names in group_kinds(shape):
        seen: set[int] = set()
        nodes, ranks = 0, 0
        for rank in range(shape.world_size):
            if rank in seen:
                continue
            members = shape.group(rank, names)
            seen.update(members)
            ranks = len(members)
            nodes = max(nodes, len({member // devices_per_node for member in members}))
        found.append(GroupSpan(name, ranks, nodes))
    return found


def placement_line(shape: MeshShape, devices_per_node: int) -> str:
    """`groups: tensor 8 (in 1 node), data_replicate 64 (across 64 nodes)`; "" for one rank."""
    spans = group_spans(shape, devices_per_node)
    return "groups: " + ", ".join(span.said() for span in spans) if spans else ""
