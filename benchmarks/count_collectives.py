"""The collectives a process runs, counted by kind and process group: calls and bytes, per optimizer step.

    python -m project.train ... +callbacks.comms._target_=benchmarks.count_collectives.CountCollectives \\
        +callbacks.comms.output_dir=DIR

writes per rank `<output_dir>/comms/rank<R>.json`: for each optimizer step (from its first micro batch's start to
the next step's, as benchmarks.count_conversions counts), the calls and bytes of each kind of collective on each
process group (named by its global ranks), with the groups' backends and the metrics' logging steps beside them.
In a test or a script, `with CollectiveCounter() as counter:` counts what runs inside it (`counter.rows()`).

How: a dispatch mode (torch's `__torch_dispatch__` extension point, on which torch's CommDebugMode and
FlopCounterMode are built) sees every operator the process dispatches, among them torch.distributed's c10d
operators (what `dist.all_reduce`, FSDP's gathers and reduce-scatters, the pipeline's sends and receives and DDP's
reducer, from C++, all call) and the functional collectives DTensor redistributes with. CommDebugMode itself does
not serve: it counts calls, not bytes, leaves sends and receives out, and keeps a record of every operator run.
TorchDispatchMode, its base and ours, has no public name in torch 2.13 (torch.utils._python_dispatch): a rename
fails tests/test_comms.py.

Bytes are those of the whole buffer each call works on, the convention of project.planning.communication: an
all-reduce's or a broadcast's tensor, an all-gather's output (every rank's part), a reduce-scatter's input, an
all-to-all's input, a send's or a receive's tensor. What crosses a link follows from them and the group's size.

Measurement only: every operator of the step passes through Python while it counts (several times slower on a
CPU), and torch.compile does not compile under a dispatch mode.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from project.training.callbacks.steps import logs_at

# Operator names (c10d's, and the functional collectives') by the kind of collective they run.
OPERATORS = {
    "all_reduce": ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
                   "all_reduce_coalesced_"),
    "all_gather": ("_allgather_base_", "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
                   "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"),
    "reduce_scatter": ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_",
                       "reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"),
    "all_to_all": ("alltoall_", "alltoall_base_", "all_to_all_single"),
    "broadcast": ("broadcast_", "broadcast"),
    "send": ("send", "isend"),
    "recv": ("recv_", "recv_any_source_", "irecv"),
    "reduce": ("reduce_",),
    "gather": ("gather_",),
    "scatter": ("scatter_",),
    "barrier": ("barrier", "monitored_barrier_"),
}  # fmt: skip
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_KIND_OF = {name: kind for kind, names in OPERATORS.items() for name in names}
# Functional all-gathers are given each rank's part and the group's size, not the output.
# Where an all-to-all's input is among its arguments: c10d's take (output, input, ...), the functional one (input, ...).
_ALL_TO_ALL_INPUT = {"alltoall_": 1, "alltoall_base_": 1, "all_to_all_single": 0}
_GIVEN_THE_PART = {"all_gather_into_tensor", "all_gather_into_tensor_coalesced"}

Counts = dict[tuple[str, str], list[int]]  # (kind, group) -> [calls, bytes]


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives run while it is entered, in `counts`: (kind, group name) -> [calls, bytes]. `rows()`
    gives them with each group named by its global ranks ("0,2"), `backends` each such group's backend.

    c10d's operators carry their process group; the functional collectives DTensor runs name theirs, whose ranks are
    learnt from the device meshes of the DTensors that pass through (and of `meshes`, given). A name never learnt
    stays `name:<group name>`."""

    def __init__(self, meshes: Iterable[Any] = ()):
        super().__init__()
        self.counts: Counts = {}
        self.backends: dict[str, str] = {}
        self._ranks: dict[str, str] = {}  # group name -> its global ranks, comma-separated
        self._meshes: set[int] = set()
        if dist.is_initialized() and dist.group.WORLD is not None:
            self._learn(dist.group.WORLD)
        for mesh in meshes:
            self._learn_mesh(mesh)

    def _learn(self, group: dist.ProcessGroup) -> str:
        name = group.group_name
        if name not in self._ranks:
            ranks = ",".join(map(str, dist.get_process_group_ranks(group)))
            self._ranks[name] = ranks
            self.backends[ranks] = str(dist.get_backend(group))
        return name

    def _learn_mesh(self, mesh: Any) -> None:
        if id(mesh) not in self._meshes:
            self._meshes.add(id(mesh))
            for dim in range(mesh.ndim):
                self._learn(mesh.get_group(dim))

    def _group(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        for value in [*args, *kwargs.values()]:
            if isinstance(value, torch.ScriptObject):
                try:
                    return self._learn(dist.ProcessGroup.unbox(value))
                except (RuntimeError, TypeError, ValueError):  # another script class (a reduce op)
                    continue
            if isinstance(value, dist.ProcessGroup):
                return self._learn(value)
            if isinstance(value, str) and value in self._ranks:
                return value
        return str(kwargs.get("group_name", args[-1] if args else "?"))

    def add(self, kind: str, group: str, calls: int, bytes_: int) -> None:
        entry = self.counts.setdefault((kind, group), [0, 0])
        entry[0] += calls
        entry[1] += bytes_

    def rows(self, counts: Counts | None = None) -> list[list]:
        """[[kind, group's ranks, calls, bytes], ...] of `counts` (by default this counter's), sorted."""
        merged: dict[tuple[str, str], list[int]] = {}
        for (kind, name), (calls, size) in (self.counts if counts is None else counts).items():
            entry = merged.setdefault((kind, self._ranks.get(name, f"name:{name}")), [0, 0])
            entry[0] += calls
            entry[1] += size
        return [[kind, group, calls, size] for (kind, group), (calls, size) in sorted(merged.items())]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # DTensor first turns the operator into plain ones and collectives, which come back here. Other subclasses
        # (the fake tensors DTensor's sharding propagation runs operators on) run as they are: they communicate nothing.
        if any(issubclass(t, DTensor) for t in types):
            for value in [*args, *kwargs.values()]:
                for tensor in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(tensor, DTensor):
                        self._learn_mesh(tensor.device_mesh)
            return NotImplemented
        out = func(*args, **kwargs)
        namespace = getattr(func, "namespace", "")
        if namespace in NAMESPACES:
            name = func._schema.name.split("::")[-1]
            if name == "batch_p2p_ops":  # (ops, peers, tags, tensors, group): each op a send or a receive
                group = self._group(args, kwargs)
                for op, tensor in zip(args[0], args[3]):
                    self.add("send" if op == "isend" else "recv", group, 1, _tensor_bytes(tensor))
            elif name in _KIND_OF:
                if name in _ALL_TO_ALL_INPUT:  # its input and output differ in size where the ranks send unevenly
                    size = _tensor_bytes(args[_ALL_TO_ALL_INPUT[name]])
                else:
                    size = max([_tensor_bytes(v) for v in [*args, *kwargs.values()]], default=0)
                if namespace != "c10d" and name in _GIVEN_THE_PART:
                    size *= args[1]  # the group's size
                self.add(_KIND_OF[name], self._group(args, kwargs), 1, size)
        return out


class CountCollectives(Callback):
    """Counts the collectives of every optimizer step in this process, while training runs (module docstring)."""

    def __init__(self, output_dir: str):
        self.output_dir = Path(output_dir)
        self.steps: dict[int, Counts] = {}
        self._counter: CollectiveCounter | None = None
        self._step: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = trainer.strategy
        self._counter = CollectiveCounter([strategy.device_mesh] if isinstance(strategy, ModelParallelStrategy) else [])
        self._counter.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step  # the step this micro batch belongs to: the previous step's window ends here
        if self._counter is not None and step != self._step:
            self._counter.counts = self.steps.setdefault(step, {})
            self._step = step

    def _stop(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop()
        self._counter = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop()
        counter, self._counter = self._counter, None
        folder = self.output_dir / "comms"
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "world_size": trainer.world_size,
            "rank": trainer.global_rank,
            "backends": counter.backends if counter is not None else {},
            "logging_steps": [s for s in self.steps if logs_at(trainer, s)],
            "steps": {step: counter.rows(counts) for step, counts in self.steps.items()} if counter else {},
        }
        (folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1) + "\n")


def read_record(run_dir: Path, rank: int) -> dict:
    """A rank's record of a run with CountCollectives (output_dir=run_dir), its steps' keys made integers."""
    record = json.loads((Path(run_dir) / "comms" / f"rank{rank}.json").read_text())
    record["steps"] = {int(step): rows for step, rows in record["steps"].items()}
    return record
