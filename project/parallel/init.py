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
        value = model.initial_value(name)
        if isinstance(param, DTensor):
            local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(value)
