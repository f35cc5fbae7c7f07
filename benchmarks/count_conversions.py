"""A callback that counts, per optimizer step in this process (from its first micro batch's start to the next
step's), what makes the host wait:

- the conversions of tensors to Python values (`item`, `tolist`, `bool`, `float`, `int`): on a GPU each of them
  makes the host wait for the device;
- the collectives called from the host through torch.distributed's public functions (`all_reduce`, `broadcast`,
  `barrier`, the object collectives, ...): each makes every rank wait for every other, milliseconds at hundreds of
  ranks. The training's own traffic is left out: the collectives that torch's parallel modules (DDP, FSDP, DTensor,
  the pipeline schedules, distributed checkpoints) and the strategies (project.parallel: their gradient norm, the
  loss averaged over ranks) call on the step's tensors, which on a GPU the device runs in order with the step's
  kernels, without the host; what reads their result on the host is a conversion, counted above. Counted are those
  that callbacks, the LightningModule's host code and Lightning's loops and logging call.

Written per rank to `<output_dir>/conversions/rank<R>.json` as {step: count} for each, with the metrics' logging
steps beside them.

    python -m project.train ... +callbacks.conversions._target_=benchmarks.count_conversions.CountConversions \\
        +callbacks.conversions.output_dir=DIR

Measurement only (tests/test_host_sync.py, benchmarks.host_sync): it replaces methods of torch.Tensor and
functions of torch.distributed while training runs.
"""

from __future__ import annotations

import inspect
import json
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

import project.parallel
from project.training.callbacks.steps import logs_at

METHODS = ("item", "tolist", "__bool__", "__float__", "__int__")
# torch.distributed's public collectives, point-to-point operations and barriers; not isend and irecv themselves,
# which torch's P2POp takes only as they are (a pipeline schedule's batches of them are counted, batch_isend_irecv).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "send",
    "recv",
    "batch_isend_irecv",
)

# Reads that never wait for a device: StopOnSignal's flag, a CPU tensor reduced over its own gloo group.
HOST_FLAGS = ("training/callbacks/preemption.py",)
# Callers whose collectives are the training's own traffic (the module docstring).
TRAINING_TRAFFIC = (str(Path(torch.__file__).parent), str(Path(project.parallel.__file__).parent))


def _a_host_flag() -> bool:
    caller = traceback.extract_stack(limit=3)[0]  # the frame that called the tensor's method
    return caller.filename.endswith(HOST_FLAGS)


def _training_traffic() -> bool:
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None  # that of the collective
    return caller is not None and caller.f_code.co_filename.startswith(TRAINING_TRAFFIC)


def _caller() -> str:
    """The innermost frame of our code or Lightning's (not torch's, not the counter's own)."""
    frames = [
        f
        for f in traceback.extract_stack()
        if f.filename != __file__
        and (
            "site-packages" not in f.filename
            or "pytorch/" in f.filename
            and "apply_func" not in f.filename
            and "logger_connector/result" not in f.filename
        )
    ]
    return f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"


class CountConversions(Callback):
    def __init__(self, output_dir: str):
        self.output_dir = Path(output_dir)
        self.counts: dict[int, int] = {}  # conversions per step
        self.collectives: dict[int, int] = {}  # host collectives per step
        self.where: dict[int, list[str]] = {}  # the first few callers per step, to say what converted
        self.collectives_where: dict[int, list[str]] = {}  # and what called a collective
        self._step: int | None = None
        self._originals: list[tuple[Any, str, Callable[..., Any]]] = []

    def _count(self, counts: dict[int, int], where: dict[int, list[str]], what: str) -> None:
        if self._step is None:
            return
        counts[self._step] = counts.get(self._step, 0) + 1
        callers = where.setdefault(self._step, [])
        if len(callers) < 5:
            callers.append(f"{_caller()}{what}")

    def _patch(self) -> None:
        for name in METHODS:
            original = getattr(torch.Tensor, name)

            def converted(tensor, *args, _original=original, **kwargs):
                if not _a_host_flag():
                    self._count(self.counts, self.where, "")
                return _original(tensor, *args, **kwargs)

            self._replace(torch.Tensor, name, converted)
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue

            def collective(*args, _original=original, _name=name, **kwargs):
                if not _training_traffic():
                    self._count(self.collectives, self.collectives_where, f" ({_name})")
                return _original(*args, **kwargs)

            self._replace(dist, name, collective)

    def _replace(self, owner: Any, name: str, counted: Callable[..., Any]) -> None:
        self._originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, counted)

    def _restore(self) -> None:
        self._step = None
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals = []

    def on_train_start(self, trainer, pl_module) -> None:
        self._patch()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step  # the step this micro batch belongs to: the previous one's count ends here
        self._step = step
        self.counts.setdefault(step, 0)
        self.collectives.setdefault(step, 0)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()  # a rollback builds the run again, with a new counter

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()
        folder = self.output_dir / "conversions"
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "counts": self.counts,
            "collectives": self.collectives,
            "where": self.where,
            "collectives_where": self.collectives_where,
            "logging_steps": [s for s in self.counts if logs_at(trainer, s)],
        }
        (folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1) + "\n")
