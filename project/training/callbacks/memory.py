"""What each rank holds: parameter, gradient and optimizer-state bytes of its shards, and peak memory."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.tensor import DTensor

from project.training.callbacks.steps import OptimizerSteps, logs_at


def local_bytes(tensors) -> int:
    """Bytes of the parts of `tensors` stored on this rank (a DTensor's local shard, not its global size)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )  # the process's resident high-water mark (Linux: KiB)


class MemoryMonitor(Callback):
    """Logs memory/{param,grad,optimizer,peak}_bytes of rank 0 and memory/max_peak_bytes of the rank
    with the highest peak each optimizer step, and writes every
    rank's figures after training to `<output_dir>/memory/rank<N>.json`.

    Under FSDP over N ranks, parameter, gradient and optimizer bytes are each about 1/N of the model's.
    """

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)
        self._steps = OptimizerSteps()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps.start(trainer)
        self._figures = dict[str, Any]()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._steps.just_ended(trainer):  # inside a gradient-accumulation window
            return
        params = list(pl_module.parameters())
        optimizer_state = [
            v for state in trainer.optimizers[0].state.values() for v in state.values() if torch.is_tensor(v)
        ]
        self._figures = {
            "param_bytes": local_bytes(params),
            "grad_bytes": local_bytes(p.grad for p in params),
            "optimizer_bytes": local_bytes(optimizer_state),
            "peak_bytes": peak_memory_bytes(pl_module.device),
        }
        if not logs_at(trainer, trainer.global_step - 1):  # a number logged is copied to the device: a wait on GPUs
            return
        for name, value in self._figures.items():
            pl_module.log(f"memory/{name}", float(value))
        # The rank that needs the most memory decides whether a layout fits.
        pl_module.log("memory/max_peak_bytes", float(self._figures["peak_bytes"]), sync_dist=True, reduce_fx="max")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        folder = self.output_dir / "memory"
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "step": trainer.global_step,
            **self._figures,
        }
        (folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1) + "\n")
