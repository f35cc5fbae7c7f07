"""Initialize a model that was built on the meta device and sharded, without ever holding it whole."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from project.model.llama import Llama


@torch.no_grad()
def materialize(model: Llama, device: torch.device, initialize: bool = True) -> None:
    """Allocate each rank's shards on `device` and fill them with the single-device initial values.

    Every rank draws a parameter's whole initial value (one parameter at a time, on the CPU) and
    keeps its own slice, so a sharded run starts from exactly the weights one device would, with no
    communication and no rank ever holding the whole model. The draws are serial, about 1e8 values
    a second on one CPU core (some 80 s for 8B parameters): `initialize=False` skips them when a
    checkpoint is about to overwrite the values anyway.
    """
    model.to_empty(device=device)
    if not initialize:
        return
    for name, param in model.named_parameters():
        value = laid_out_like(model.initial_value(name), param)
        (param.to_local() if isinstance(param, DTensor) else param).copy_(
            value.to_local() if isinstance(value, DTensor) else value
        )


def laid_out_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor that every rank holds, laid out as `like`: for a DTensor, a DTensor of the same
    mesh and placements whose local part is cut from `value` here, with no communication."""
    if isinstance(like, DTensor):
        return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return value.to(like.device)
