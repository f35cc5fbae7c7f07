"""What each rank holds: parameter, gradient and optimizer-state bytes of its shards, its activations (what autograd
saved for the backward pass), and peak memory."""

from __future__ import annotations

import json
import resource
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.tensor import DTensor

from project.parallel.contract import contract_of
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


class SavedActivations:
    """The bytes autograd holds for the backward pass, counted between a forward pass (entered: torch's saved-tensor
    hooks) and its backward (`bytes`): each live storage once, the parameters' own left out. What FSDP freed again
    after the forward (its gathered parameters, re-gathered in backward) no longer counts then, and cast copies of
    weights do. Deterministic for a given model, batch and layout, unlike a peak read off the allocator or the
    process. Holds only weak references: counting keeps nothing alive."""

    def __init__(self) -> None:
        self._saved: list[weakref.ref] = []
        self._parameters: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved)

    @staticmethod
    def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
        """(address, bytes) of the storage under `tensor`'s local part, where it has one."""
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        try:
            storage = local.untyped_storage()
            return storage.data_ptr(), storage.nbytes()
        except (NotImplementedError, RuntimeError):  # no storage (a compiler's fake tensor), or one already freed
            return None

    def _pack(self, saved: torch.Tensor) -> torch.Tensor:
        self._saved.append(weakref.ref(saved))
        return saved

    def of(self, parameters: Iterable[torch.Tensor]) -> SavedActivations:
        """Counting, from entry, what is saved beside `parameters` (a module's)."""
        self._parameters = {found[0] for found in map(self._storage, parameters) if found is not None}
        return self

    def __enter__(self) -> SavedActivations:
        self._saved.clear()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        """What the tensors saved since entry and still alive hold now (before the backward pass frees them)."""
        live: dict[int, int] = {}
        for ref in self._saved:
            tensor = ref()
            found = self._storage(tensor) if tensor is not None else None
            if found is not None and found[1] and found[0] not in self._parameters:
                live[found[0]] = found[1]
        return sum(live.values())


class MemoryMonitor(Callback):
    """Logs memory/{param,grad,optimizer,activation,peak}_bytes of rank 0 and memory/max_peak_bytes of the rank with
    the highest peak each optimizer step, and writes every rank's figures after training to
    `<output_dir>/memory/rank<N>.json`.

    Under FSDP over N ranks, parameter, gradient and optimizer bytes are each about 1/N of the model's; under context
    parallelism over N ranks, a micro batch's activations are about 1/N of one device's (SavedActivations: those of
    the largest micro batch of a logging step, read before its backward pass; counting them costs a Python call per
    saved tensor, so only then). Not under the pipeline, whose schedule runs every backward inside the step.
    """

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)
        self._steps = OptimizerSteps()
        self._saved = SavedActivations()
        self._counting = False
        self._saved_bytes = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps.start(trainer)
        self._figures = dict[str, Any]()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # The step this micro batch belongs to logs; not under a pipeline, whose schedule runs every backward inside
        # the step, before the count could be read.
        if logs_at(trainer, trainer.global_step) and not contract_of(trainer.strategy).gradients_in_step:
            self._saved.of(pl_module.parameters()).__enter__()
            self._counting = True

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._stop_counting()

    def _stop_counting(self) -> None:
        if self._counting:
            self._saved.__exit__(None, None, None)
            self._counting = False
            self._saved_bytes = max(self._saved_bytes, self._saved.bytes)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stop_counting()  # where no backward followed Lightning's hook (a step that skipped it)
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
            "activation_bytes": self._saved_bytes or self._figures.get("activation_bytes"),
            "peak_bytes": peak_memory_bytes(pl_module.device),
        }
        self._saved_bytes = 0
        if not logs_at(trainer, trainer.global_step - 1):  # a number logged is copied to the device: a wait on GPUs
            return
        for name, value in self._figures.items():
            if value is not None:  # activations: not counted under a pipeline
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
