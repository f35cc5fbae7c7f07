"""Host copies of the training state for a save written in the background, made again into the same buffers at
every save.

torch's DefaultStager keeps a host buffer for each tensor it staged before, but rebuilds every tensor around it at
each save; for a DTensor that is a round of DTensor dispatch (sharding propagation) per tensor, which cost more than
the copy itself (cProfile on 2 CPU ranks of an 8.9M model, 300 tensors: 59 ms of new_empty against 11 ms of copy in
a 136 ms stage) and grows with the tensor count, not the bytes (a 70B model's state is thousands of tensors).
`ReusedHostCopies` lets torch's stager make the first copy (its host tensors, pinned on a GPU, and DTensors around
them), keeps it, and at the next save copies each tensor's local values into the one staged at the same place of the
state; a tensor new to the state, of another size, dtype or placement, or no longer sharing memory with the tensors
it shared it with at the first save, is staged by torch's stager alone.

The copies are overwritten by the next save: the caller must not save again while a write still reads them
(BackgroundWriter writes one checkpoint at a time).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

Path = tuple[Any, ...]  # a place in the state: the keys and indices that lead to it
ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
MAPPINGS = (dict, OrderedDict)  # torch's module state dicts are OrderedDicts
SEQUENCES = (list, tuple)


class ReusedHostCopies(AsyncStager):
    """dcp.async_save's stager (and the single-file writer's): each save's state copied into the host tensors of the
    save before it, place by place; a place new to the state, whose tensor changed its shape, or that no longer
    shares memory as it did, is staged by torch's stager (the first save whole, which keeps tensors that share storage
    sharing it)."""

    def __init__(self, pinned: bool):
        self._pinned = pinned
        self._torch = DefaultStager(
            StagingOptions(
                use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
            )
        )
        self._copies: dict[Path, torch.Tensor] = {}  # the last stage's tensors, by their place in the state
        self._used: set[Path] = set()  # the places the stage under way has copied into
        # The stage under way's copies so far: each host storage -> the storage copied into it, and where in it (the
        # offset of the source's elements from the copy's). Tensors that shared memory at the first save (tied
        # weights, views) share a storage of copies; should one stop sharing it, it is given a copy of its own
        # rather than overwriting the others'.
        self._copied_from: dict[int, tuple[int, int]] = {}

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # staged before `stage` returns: nothing to wait for after

    def stage(self, state_dict: Any) -> Any:
        if not self._copies:
            staged = self._by_torch(state_dict)
            self._copies = dict(tensor_places(staged))
            return staged
        self._used, self._copied_from = set(), {}
        try:
            with torch.no_grad():
                staged = self._again(state_dict, ())
        finally:
            if self._pinned:  # the copies from the device were queued without waiting (pinned host memory)
                torch.accelerator.synchronize()
        if len(self._used) < len(self._copies):  # tensors the state no longer has: their copies go
            self._copies = {path: self._copies[path] for path in self._used}
        return staged

    def synchronize_staging(self) -> None:
        pass  # staged before `stage` returned

    def close(self) -> None:
        self._copies = {}
        self._torch.close()

    def _again(self, value: Any, path: Path) -> Any:
        if isinstance(value, torch.Tensor):
            target = self._copies.get(path)
            if target is not None and _same_shape(value, target):
                host, source = _local(target), _local(value)
                if host.numel() == 0 or self._still_shares(host, source):
                    host.copy_(source, non_blocking=self._pinned)  # again where tied: a view may be only a part
                    self._used.add(path)
                    return target
            target = self._copies[path] = self._by_torch(value)  # new here, another shape, or untied: a new copy
            self._used.add(path)
            return target
        if type(value) in MAPPINGS:
            staged = type(value)((key, self._again(item, (*path, key))) for key, item in value.items())
            if type(value) is OrderedDict and vars(value):  # a module state dict's record of its modules' versions,
                vars(staged).update(copy.deepcopy(vars(value)))  # kept as torch's stager keeps it
            return staged
        if type(value) in SEQUENCES:
            return type(value)(self._again(item, (*path, index)) for index, item in enumerate(value))
        if type(value) in ATOMS:
            return value
        # Any other object (Lightning's records of loops and callbacks, hyperparameters): copied whole by torch's
        # stager, as at the first save, tensors inside it included.
        return self._by_torch(value)

    def _still_shares(self, host: torch.Tensor, source: torch.Tensor) -> bool:
        """Whether `source` shares memory with the sources copied into `host`'s storage before it in this stage, as
        at the first save (trivially, if it is the first)."""
        where = (source.untyped_storage().data_ptr(), int(source.storage_offset() - host.storage_offset()))
        return self._copied_from.setdefault(host.untyped_storage().data_ptr(), where) == where

    def _by_torch(self, value: Any) -> Any:
        staged = self._torch.stage({"value": value})  # staged here, not asynchronously: the copy itself
        assert isinstance(staged, dict)
        return staged["value"]


def tensor_places(value: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """(place, tensor) of every tensor in the dicts, lists and tuples of `value` (the places `_again` looks up)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif type(value) in MAPPINGS:
        for key, item in value.items():
            yield from tensor_places(item, (*path, key))
    elif type(value) in SEQUENCES:
        for index, item in enumerate(value):
            yield from tensor_places(item, (*path, index))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor  # no autograd here: the local tensor itself


def _same_shape(value: torch.Tensor, staged: torch.Tensor) -> bool:
    if isinstance(value, DTensor) != isinstance(staged, DTensor) or value.dtype != staged.dtype:
        return False
    if isinstance(value, DTensor):
        assert isinstance(staged, DTensor)
        if value.device_mesh != staged.device_mesh or value.placements != staged.placements:
            return False
        if value.shape != staged.shape:
            return False
    return _local(value).shape == _local(staged).shape
