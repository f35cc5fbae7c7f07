"""Load a checkpoint of any layout into the model and optimizer as this rank lays them out, each rank reading its
own share.

Every checkpoint the platform writes holds the same names: the LightningModule's parameter names (`model.<name>`)
and AdamW's state keyed by them, under `state_dict` (a single file; ModelParallelStrategy's and the pipeline's
distributed-checkpoint folders) or `model` (FSDP1's folders). So a rank asks torch for its own state dicts
(`torch.distributed.checkpoint.state_dict.get_state_dict`: sharded where its strategy shards, whole where it does
not) and fills them:

- from a folder, with torch's distributed checkpoint `load`, which reads from the shards' files only the pieces
  that overlap this rank's own (resharding between any layouts, FSDP1's and DTensor's alike);
- from a single file, memory-mapped, by cutting each rank's pieces out of its tensors: only those pages are read.

Then `set_state_dict` puts them in place. A strategy that keeps the whole model on each rank (one device, DDP,
Horovod) reads the whole checkpoint instead, in Lightning's own form (`read_whole`): its share is all of it. Nothing
is written to a temporary file, except a single file in object storage, which each process fetches whole before it
memory-maps it (project.checkpoint.locations.local_file); a folder there is read in place, each rank its ranges.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from project.checkpoint.files import LIGHTNING_EXTRA, read_checkpoint_file, verify_sharded_checkpoint
from project.checkpoint.locations import Location, is_file, is_folder, is_remote, join, location, storage_reader
from project.runtime.errors import ConfigError

WEIGHT_KEYS = ("state_dict", "model")  # where a folder keeps the weights: ModelParallelStrategy's, FSDP1's
# Sends a value from global rank 0 to every rank (Lightning's Strategy.broadcast); one process keeps its own.
Share = Callable[[Any], Any]


def _own(value: Any) -> Any:
    return value


class KnownMetadata(StorageReader):
    """A folder's reader whose metadata was read once (on one rank) and handed to every rank: torch's `load` asks each
    rank's reader for it, which on a cluster's shared file system would be every rank reading the same file."""

    def __init__(self, reader: StorageReader, metadata: Metadata):
        self.reader, self.metadata = reader, metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        self.reader.reset(checkpoint_id)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.reader.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        return self.reader.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: Any) -> Any:
        return self.reader.prepare_global_plan(plans)

    def read_data(self, plan: Any, planner: Any) -> Any:
        return self.reader.read_data(plan, planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def read_on_one_rank(share: Share, read: Callable[[], Any]) -> Any:
    """`read()` on global rank 0 (every process where there is no process group), its value on every rank; a
    ConfigError it raises is raised on every rank alike."""
    value, refused = None, None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        try:
            value = read()
        except ConfigError as error:
            refused = str(error)
    value, refused = share((value, refused))
    if refused is not None:
        raise ConfigError(refused)
    return value


def load_resharded(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    path: Location,
    optimizer_order: list[str],
    share: Share = _own,
) -> dict[str, Any]:
    """Fill `module` (as the strategy wrapped it) and `optimizers` from the checkpoint at `path`, a file or a folder
    of any strategy family; the checkpoint's other entries (step, loops, callbacks' and the module's records).
    `optimizer_order`: the whole model's parameter names in the order the optimizer numbers them, for a file that
    keys AdamW's state by position (one device's, DDP's). `share`: sends rank 0's value to every rank, so that a
    folder's metadata is read and verified once (read_on_one_rank)."""
    if len(optimizers) > 1:
        raise NotImplementedError("a checkpoint is loaded into one optimizer")  # the module builds one AdamW
    for optimizer in optimizers:
        make_state(optimizer)
    model_state, optimizer_state = get_state_dict(module, list(optimizers))
    if is_folder(path):
        rest = _from_folder(path, model_state, optimizer_state if optimizers else None, share)
    else:
        rest = _from_file(path, model_state, optimizer_state if optimizers else None, optimizer_order)
    set_state_dict(
        module, list(optimizers), model_state_dict=model_state, optim_state_dict=optimizer_state if optimizers else {}
    )
    return rest


@torch.no_grad()
def make_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state (AdamW's moments, zero), for a checkpoint to be loaded into, one parameter at
    a time: a step at learning rate 0 on that parameter's zero gradient, which changes no weight. (torch's state-dict
    API does it for every parameter at once, holding a zero gradient of each: a third more than the rank's share of
    weights and moments, for the length of the load.)"""
    if optimizer.state:
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad:
                    param.grad = torch.zeros_like(param)
                    optimizer.step()
                    param.grad = None
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate


def _from_folder(
    path: Location, model_state: dict, optimizer_state: dict | None, share: Share = _own
) -> dict[str, Any]:
    def read() -> tuple[Metadata, dict[str, Any]]:
        verify_sharded_checkpoint(path)  # nothing in it runs code as torch reads it
        return storage_reader(path).read_metadata(), _lightning_extra(path)

    metadata, extra = read_on_one_rank(share, read)
    stored = metadata.state_dict_metadata
    key = next((k for k in WEIGHT_KEYS if any(name.startswith(f"{k}.") for name in stored)), None)
    if key is None:
        raise ConfigError(f"{path} holds no model weights: pass a checkpoint this platform wrote.")
    wanted: dict[str, Any] = {key: model_state}
    own_groups: list[list[str]] = []
    if optimizer_state is not None:
        if not any(name.startswith("optimizer_0.") for name in stored):
            raise ConfigError(f"{path} holds no optimizer state: resume from a training checkpoint, not weights only.")
        own_groups = [list(group["params"]) for group in optimizer_state["param_groups"]]
        wanted["optimizer_0"] = optimizer_state
    dcp.load(wanted, storage_reader=KnownMetadata(storage_reader(path), metadata))
    # The groups' settings are the checkpoint's; the parameters each names are this rank's own (a pipeline
    # stage's checkpoint names every stage's, a rank here holds some of them).
    for group, own in zip(optimizer_state["param_groups"] if optimizer_state else [], own_groups):
        group["params"] = own
    return extra


def _lightning_extra(folder: Location) -> dict[str, Any]:
    extra = join(folder, LIGHTNING_EXTRA)
    return read_checkpoint_file(extra) if is_file(extra) else {}


def _from_file(path: Location, model_state: dict, optimizer_state: dict | None, order: list[str]) -> dict[str, Any]:
    checkpoint = read_checkpoint_file(path, mmap=True)  # tensors stay on disk until a piece of them is read
    whole = checkpoint.pop("state_dict")
    missing = sorted(set(model_state) - set(whole))
    if missing:
        raise ConfigError(
            f"{path} lacks {len(missing)} of this model's weights (first: {missing[0]}): resume with the model "
            "config the checkpoint was trained with."
        )
    for name, target in model_state.items():
        model_state[name] = cut_like(whole[name], target)
    stored_optimizers = checkpoint.pop("optimizer_states", [])
    if optimizer_state is not None:
        if not stored_optimizers:
            raise ConfigError(f"{path} holds no optimizer state: resume from a training checkpoint, not weights only.")
        stored = by_name(stored_optimizers[0], order)
        for name, values in optimizer_state["state"].items():
            for k, target in values.items():
                values[k] = cut_like(stored["state"][name][k], target)
        for group, saved in zip(optimizer_state["param_groups"], stored["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
    return checkpoint


def read_whole(path: Location, optimizer_order: list[str] | None = None) -> dict[str, Any]:
    """The checkpoint at `path` (a file, or a folder of any sharded family) in Lightning's own form, whole, in this
    process's memory: the weights under `state_dict`, AdamW's state under `optimizer_states`, keyed by position in
    `optimizer_order` (the whole model's parameter names) where given, as torch.optim loads it; else as stored."""
    path = location(path)
    if is_folder(path):
        checkpoint = _whole_folder(path)
    else:  # one in object storage memory-mapped from its local copy, not read into memory beside its tensors
        checkpoint = read_checkpoint_file(path, mmap=is_remote(path))
    if optimizer_order is not None:
        names = optimizer_order
        checkpoint["optimizer_states"] = [
            by_position(by_name(state, names), names) for state in checkpoint.get("optimizer_states", [])
        ]
    return checkpoint


def _whole_folder(path: Location) -> dict[str, Any]:
    """A distributed-checkpoint folder read whole with torch's `load` into tensors the size its metadata says."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    verify_sharded_checkpoint(path)
    stored = storage_reader(path).read_metadata().state_dict_metadata
    flat: dict[str, Any] = {
        name: torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
        for name, m in stored.items()
    }
    dcp.load(flat, storage_reader=storage_reader(path), no_dist=not (dist.is_available() and dist.is_initialized()))
    checkpoint = _lightning_extra(path)
    key = next((k for k in WEIGHT_KEYS if any(name.startswith(f"{k}.") for name in flat)), None)
    if key is None:
        raise ConfigError(f"{path} holds no model weights: pass a checkpoint this platform wrote.")
    checkpoint["state_dict"] = {n.removeprefix(f"{key}."): v for n, v in flat.items() if n.startswith(f"{key}.")}
    optimizers: dict[int, dict[str, Any]] = {}
    for name, value in flat.items():
        found = re.fullmatch(r"optimizer_(\d+)\.(state|param_groups)\.(.+)\.([^.]+)", name)
        if found is None:
            continue
        index, part, where, field = int(found[1]), found[2], found[3], found[4]
        state = optimizers.setdefault(index, {"state": {}, "param_groups": {}})
        if part == "state":  # where: the parameter's name; field: exp_avg, exp_avg_sq, step
            state["state"].setdefault(where, {})[field] = value
        else:  # where: the group's number
            state["param_groups"].setdefault(int(where), {})[field] = value
    checkpoint["optimizer_states"] = [
        {"state": s["state"], "param_groups": [s["param_groups"][i] for i in sorted(s["param_groups"])]}
        for _, s in sorted(optimizers.items())
    ]
    return checkpoint


def by_position(optimizer_state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """AdamW's state keyed by name -> torch.optim's positions, numbered group after group in the order of `names`."""
    position = {name: i for i, name in enumerate(names)}
    unknown = [p for g in optimizer_state["param_groups"] for p in g["params"] if p not in position]
    if unknown:
        raise ConfigError(
            f"the checkpoint's optimizer holds state for {unknown[0]}, which this model lacks: resume with the model "
            "config the checkpoint was trained with."
        )
    return {
        "state": {position[n]: value for n, value in optimizer_state["state"].items()},
        "param_groups": [{**g, "params": [position[n] for n in g["params"]]} for g in optimizer_state["param_groups"]],
    }


def cut_like(whole: Any, like: Any) -> Any:
    """`like` (a tensor of this rank's state dict) filled in place with its piece of `whole` (every rank holds it,
    memory-mapped), with no communication: a DTensor's local part, an FSDP1 ShardedTensor's local shards, or all of
    it. Only that piece of `whole` is read, and no more than one tensor's piece is held besides."""
    if not isinstance(whole, torch.Tensor) or not isinstance(like, torch.Tensor):
        return whole
    if isinstance(like, DTensor):  # its one local chunk, as torch's distributed checkpoint describes it
        (chunk,) = like.__create_chunk_list__()
        where = tuple(slice(offset, offset + size) for offset, size in zip(chunk.offsets, chunk.sizes))
        like.to_local().copy_(whole[where])  # only the piece crosses to the device
        return like
    shards = getattr(like, "local_shards", None)  # torch.distributed's ShardedTensor, which FSDP1's state dicts hold
    if shards is not None:
        for shard in shards():
            where = tuple(
                slice(offset, offset + size)
                for offset, size in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
            )
            shard.tensor.copy_(whole[where])
        return like
    like.copy_(whole)
    return like


def by_name(optimizer_state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """AdamW's state keyed by parameter name: as stored by sharded strategies, or from numbers: torch.optim's
    positions (one device's, DDP's: group after group, in the order of `names`) or the model's order of its
    parameters (FSDP1's whole-state files, rekeyed by torch without the optimizer). Either way the j-th smallest
    number of a group is the group's j-th parameter, which is how both are read."""
    params = [p for group in optimizer_state.get("param_groups", []) for p in group["params"]]
    if not params or isinstance(params[0], str):
        return optimizer_state
    if len(params) != len(names):
        raise ConfigError(
            f"the checkpoint's optimizer holds {len(params)} parameters, this model {len(names)}: "
            "resume with the model config the checkpoint was trained with."
        )
    key: dict[int, str] = {}
    for group in optimizer_state["param_groups"]:  # `names` holds each group's names in turn, in the model's order
        numbers = sorted(group["params"])
        key.update(zip(numbers, names[len(key) : len(key) + len(numbers)]))
    return {
        "state": {key[i]: value for i, value in optimizer_state["state"].items()},
        "param_groups": [{**g, "params": [key[i] for i in g["params"]]} for g in optimizer_state["param_groups"]],
    }
