"""How our strategies read a checkpoint of any layout (project.checkpoint.reshard): Lightning's `load_checkpoint`
hook, the one place a strategy reads one.

A strategy that shards the model fills its own shards (and AdamW's) during `load_checkpoint`, after setup, each
rank reading only its share; one that keeps the whole model on every rank reads the whole checkpoint in Lightning's
form and lets Lightning load it as it loads its own.
"""

from __future__ import annotations

from typing import Any, cast

from project.checkpoint.locations import location
from project.checkpoint.reshard import load_resharded, read_whole
from project.parallel.contract import TrainingModule


def _optimizer_order(strategy: Any) -> list[str]:
    return cast(TrainingModule, strategy.lightning_module).optimizer_order()


class ShardedLoading:
    """For strategies that restore after setup and load the optimizer themselves (Lightning's
    ModelParallelStrategy's): the model and its optimizer are built and sharded when `load_checkpoint` runs."""

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        strategy = cast(Any, self)
        path = location(strategy.broadcast(checkpoint_path))
        # A folder's metadata read and verified on one rank, handed to the others (Lightning's broadcast).
        return load_resharded(strategy.model, strategy.optimizers, path, _optimizer_order(strategy), strategy.broadcast)


class WholeModelLoading:
    """For strategies that hold the whole model on each rank (one device, DDP, Horovod): any checkpoint, read whole
    into Lightning's form (optimizer state by position), which Lightning then loads as its own."""

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        strategy = cast(Any, self)
        order = _optimizer_order(strategy) if strategy.lightning_module is not None else None
        return read_whole(location(checkpoint_path), order)
