"""Initialize a model that was built on the meta device and sharded: each rank draws its own shard only."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from project.model.llama import Llama


@torch.no_grad()
def materialize(model: Llama, device: torch.device, initialize: bool = True) -> None:
    """Allocate each rank's shards on `device` and fill them with the single-device initial values.

    Each element's initial value depends on the seed, the parameter's name and its position alone
    (project.model.initial_values), so a rank draws the elements of its own shard and nothing else: the work is
    its share of the model, whatever the layout, and a sharded run starts from exactly the weights one device
    draws, with no communication. `initialize=False` skips the draws when a checkpoint is about to overwrite
    the values anyway.
    """
    model.to_empty(device=device)
    if model.hooks is not None:  # before any load, which then overwrites them: never left unset
        model.hooks.init_buffers()
    if not initialize:
        return
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            param.copy_(model.initial_value(name))
            continue
        local = param.to_local()
        if local.numel() == 0:  # an uneven split can leave a rank nothing of a parameter
            continue
        rows, cols = local_indices(param)
        if local.is_contiguous() and local.device.type == "cpu":  # drawn straight into the shard
            model.initial_value(name, rows, cols, out=local.view(rows.numel(), cols.numel()))
        else:
            local.copy_(model.initial_value(name, rows, cols).view(local.shape))


def local_indices(param: DTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global row and column indices (of the parameter seen as a matrix, its first dimension by the product of
    the others: project.model.initial_values) whose product is this rank's shard, in the order the shard holds them.

    Read off DTensor's own split of one index probe per dimension, with the parameter's mesh and placements: however
    the placements combine (a dim-0 shard of a column split, say), the shard holds what they say. Each probe is as
    long as its dimension along it: O(the dimensions times the mesh's size), never O(the parameter's elements)."""
    shape, mesh = param.shape, param.device_mesh
    # As wide as the mesh is large along a dimension split by any of its dimensions (one entry per rank at least,
    # however the splits combine: FSDP2's strided shard over a tensor-parallel one, say), 1 along the others.
    sharded = {p.dim for p in param.placements if isinstance(p, Shard)}
    shards = [mesh.size() if d in sharded else 1 for d in range(param.ndim)]
    held = []
    for d in range(param.ndim):
        along = [-1 if i == d else 1 for i in range(param.ndim)]
        probe = torch.arange(shape[d], device=mesh.device_type).view(along)
        probe = probe.expand([shape[d] if i == d else shards[i] for i in range(param.ndim)])
        local = distribute_tensor(probe, mesh, param.placements, src_data_rank=None).to_local()
        held.append(local[tuple(slice(None) if i == d else 0 for i in range(param.ndim))].cpu())
    if param.ndim == 1:
        return held[0], torch.zeros(1, dtype=torch.long, device="cpu")
    cols = torch.zeros(1, dtype=torch.long)
    for d in range(1, param.ndim):  # row-major flattening of the dimensions after the first
        cols = (cols[:, None] * shape[d] + held[d][None, :]).reshape(-1)
    return held[0], cols
