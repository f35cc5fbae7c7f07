"""Read a training checkpoint in one process, whether a single file or a distributed-checkpoint folder."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _load_distributed_checkpoint


def load_full_checkpoint(path: str | Path) -> dict[str, Any]:
    """The Lightning checkpoint dict, with the whole (unsharded) state_dict, on the CPU.

    Sharded strategies (fsdp with state_dict_type=sharded, fsdp2, tp, tp_fsdp) save `last.ckpt` as a
    folder of torch.distributed.checkpoint shards, which Lightning reads here without a process
    group. FSDP1 stores the weights under "model", ModelParallelStrategy under "state_dict"; both
    keep optimizers as "optimizer_0", ... (keyed by parameter name). The whole model must fit in
    CPU memory.
    """
    path = Path(path)
    if not path.is_dir():
        return torch.load(path, map_location="cpu", weights_only=False)
    checkpoint = _load_distributed_checkpoint(path)
    if "model" in checkpoint:
        checkpoint["state_dict"] = checkpoint.pop("model")
    optimizers = sorted((k for k in checkpoint if re.fullmatch(r"optimizer_\d+", k)), key=lambda k: int(k.split("_")[1]))
    if optimizers:
        checkpoint["optimizer_states"] = [checkpoint.pop(k) for k in optimizers]
    return checkpoint
