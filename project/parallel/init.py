"""Initialize a model that was built on the meta device and sharded: each rank draws its own shard only."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from project.model.initial_values import matrix_shape
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
    """The global row and column indices (of the parameter seen as a matrix, project.model.initial_values) whose
    product is this rank's shard, in the order the shard holds them.

    Read off DTensor's own split of index probes (one index per row, or per column) with the parameter's mesh
    and placements: however the placements combine (a dim-0 shard of a column split, say), the shard holds what
    they say."""
    if param.ndim > 2:
        raise ValueError(f"a parameter of {param.ndim} dimensions; Llama's have 1 or 2 ({tuple(param.shape)})")
    n_rows, n_cols = matrix_shape(param.shape)
    mesh_device = param.device_mesh.device_type
    if param.ndim == 1:
        shard = distribute_tensor(
            torch.arange(n_rows, device=mesh_device), param.device_mesh, param.placements, src_data_rank=None
        )
        return shard.to_local().cpu(), torch.zeros(1, dtype=torch.long, device="cpu")
    # Each probe's other dimension is as long as the mesh is large: split by any of the mesh's dimensions, every
    # rank keeps at least one of its entries, and the probes cost O(rows + columns), not O(rows x columns).
    width = param.device_mesh.size()
    probes = (
        torch.arange(n_rows, device=mesh_device)[:, None].expand(n_rows, width),
        torch.arange(n_cols, device=mesh_device)[None, :].expand(width, n_cols),
    )
    rows, cols = (
        distribute_tensor(probe, param.device_mesh, param.placements, src_data_rank=None).to_local() for probe in probes
    )
    return rows[:, 0].cpu(), cols[0, :].cpu()


def laid_out_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor that every rank holds, laid out as `like`: for a DTensor, a DTensor of the same
    mesh and placements whose local part is cut from `value` here, with no communication."""
    if isinstance(like, DTensor):
        return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return value.to(like.device)
