"""How our strategies write a checkpoint, a folder of shards (ModelParallelStrategy's: fsdp, fsdp2, tp, tp_fsdp,
context parallel, pipeline) or one file from rank 0 (one device, DDP, Horovod; `state_dict_type=full`, gathered
there first), to a local path or to object storage (project.checkpoint.locations), in the foreground or in the
background (`ckpt_async=true`, project.checkpoint.background): there, Lightning's `save_checkpoint` hook copies the
state to host memory and returns, and the contract's `checkpoint_written` and `finish_checkpoint_writes`
(project.parallel.contract) follow the write.
"""

from __future__ import annotations

import io
from concurrent.futures import Future
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from project.checkpoint.background import BackgroundWriter, cause_of
from project.checkpoint.files import LIGHTNING_EXTRA, write_checkpoint_file
from project.checkpoint.locations import (
    Location,
    join,
    location,
    remove,
    storage_errors,
    storage_writer,
    write_bytes,
)
from project.parallel.groups import release_group
from project.runtime.errors import ConfigError


class BackgroundSaving:
    """The contract's background saves; a strategy's family says how a save is written (`_write_in_background`)."""

    _in_background = False
    _writer: BackgroundWriter | None = None  # made at the first save, once the device is known

    def save_in_background(self, enabled: bool) -> None:
        self._in_background = enabled

    def checkpoint_written(self) -> Future | None:
        return self._writer.in_flight if self._writer is not None else None

    def finish_checkpoint_writes(self) -> None:
        if self._writer is None or self._writer.in_flight is None:  # alike on every rank: each holds a write
            return
        path, error = self._writer.wait()
        strategy = cast(Any, self)
        if strategy.reduce_boolean_decision(error is not None, all=False):
            if strategy.is_global_zero and path is not None:  # nothing half written left: a best checkpoint's too
                with suppress(*storage_errors()):
                    remove(path)
            cause = cause_of(error) if error is not None else None
            reason = f"{type(cause).__name__}: {cause}" if cause is not None else "on another rank"
            raise ConfigError(
                f"the checkpoint written in the background to {path} failed ({reason}). The checkpoint before it is "
                "kept, and the run resumes from it: free space or fix the permissions there, then resume with "
                "hydra.run.dir=<this run's directory> ckpt_path=last (or ckpt_async=false to write in the foreground)."
            )

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        strategy = cast(Any, self)
        if not self._in_background:
            return self._write_in_foreground(checkpoint, filepath, storage_options)
        self.finish_checkpoint_writes()  # one write at a time: the one before ends first
        if self._writer is None:
            self._writer = BackgroundWriter(pinned=strategy.root_device.type == "cuda")
            if strategy.root_device.type == "cpu":
                rank_zero_warn(
                    "ckpt_async=true on the CPU: the thread that writes each checkpoint takes its time from training "
                    "on the same cores, so a save may cost more than in the foreground (docs/performance.md). It pays "
                    "where training leaves the host's cores idle (a GPU node); here ckpt_async=false may be faster."
                )
        self._write_in_background(self._writer, checkpoint, location(strategy.broadcast(filepath)))

    def _write_in_foreground(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
        """Rank 0 writes the one file (locally or to object storage), torch.save streaming into it."""
        if cast(Any, self).is_global_zero:
            write_checkpoint_file(checkpoint, location(filepath))

    def _write_in_background(self, writer: BackgroundWriter, checkpoint: dict[str, Any], path: Location) -> None:
        """One file, written by rank 0."""
        strategy = cast(Any, self)
        if strategy.is_global_zero:
            writer.write_file(checkpoint, path, write_checkpoint_file)
        else:
            writer.nothing_to_write(path)

    def teardown(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        cast(Any, super()).teardown()


class ShardedBackgroundSaving(BackgroundSaving):
    """ModelParallelStrategy's folder of shards (state_dict, optimizer_0, ... and Lightning's records in meta.pt),
    every rank writing its own through torch's async_save; or, with `one_file` (strategy.state_dict_type=full), the
    whole state gathered into rank 0's host memory and written by it as one file, as one device writes."""

    _host_group: dist.ProcessGroup | None = None
    writer_timeout: timedelta | None = None  # the strategy's collective timeout, for the writers' group too
    one_file = False
    WHOLE_ON_RANK_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)

    # The shards where they are, on the device: torch's writer and the background stager copy them to host memory
    # piece by piece. ModelParallelStrategy's own state dicts (cpu_offload=True) first copy the rank's whole share
    # into new host memory at every save, a second host copy beside the stager's and an allocation of the share.
    SHARDS_IN_PLACE = StateDictOptions(full_state_dict=False, cpu_offload=False)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        options = self.WHOLE_ON_RANK_0 if self.one_file else self.SHARDS_IN_PLACE
        return get_model_state_dict(cast(Any, self).model, options=options)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if not self.one_file:
            return get_optimizer_state_dict(cast(Any, self).model, optimizer, options=self.SHARDS_IN_PLACE)
        return by_position(get_optimizer_state_dict(cast(Any, self).model, optimizer, options=self.WHOLE_ON_RANK_0))

    def _write_in_foreground(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
        """As Lightning's ModelParallelStrategy writes its folder (which takes local paths only), anywhere."""
        if self.one_file:
            return super()._write_in_foreground(checkpoint, filepath, storage_options)
        path = location(cast(Any, self).broadcast(filepath))
        dcp.save(self._folder_state(checkpoint, path), storage_writer=storage_writer(path))

    def _write_in_background(self, writer: BackgroundWriter, checkpoint: dict[str, Any], path: Location) -> None:
        if self.one_file:
            return super()._write_in_background(writer, checkpoint, path)
        state = self._folder_state(checkpoint, path)
        if self._host_group is None:  # the writing thread agrees on the metadata over a group of its own (gloo):
            self._host_group = dist.new_group(backend="gloo", timeout=self.writer_timeout)  # not training's: its
            # calls would mix with training's
        writer.write_folder(state, path, self._host_group)

    def _folder_state(self, checkpoint: dict[str, Any], path: Location) -> dict[str, Any]:
        """The folder's tensors, for torch's distributed checkpoint, as Lightning lays them out; Lightning's records
        written by rank 0 to meta.pt first (a failure here leaves nothing being written)."""
        if isinstance(path, Path):
            if path.is_file():  # every rank looks: one may find it gone already
                path.unlink(missing_ok=True)
            path.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if cast(Any, self).global_rank == 0:
            records = io.BytesIO()
            torch.save(checkpoint, records)
            write_bytes(join(path, LIGHTNING_EXTRA), records.getvalue())
        return state

    def teardown(self) -> None:
        super().teardown()
        release_group(self._host_group)
        self._host_group = None


def by_position(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (torch's get_optimizer_state_dict) keyed by position instead, as
    the optimizer's own state_dict is and a one-file checkpoint keeps it; an empty one (a rank other than 0's) as
    it is."""
    if not state:
        return state
    position = {name: i for i, name in enumerate(n for group in state["param_groups"] for n in group["params"])}
    return {
        "state": {position[name]: values for name, values in state["state"].items()},
        "param_groups": [
            {**group, "params": [position[n] for n in group["params"]]} for group in state["param_groups"]
        ],
    }
