"""A callback that counts the conversions of tensors to Python values (`item`, `tolist`, `bool`, `float`,
`int`) each optimizer step makes in this process, from its first micro batch's start to the next step's: on a GPU
each of them makes the host wait for the device. Written per rank to `<output_dir>/conversions/rank<R>.json` as
{step: count}, with the metrics' logging steps beside them.

    python -m project.train ... +callbacks.conversions._target_=project.tooling.conversions.CountConversions \\
        +callbacks.conversions.output_dir=DIR

Measurement only (tests/test_host_sync.py, project.tooling.bench_host_sync): it replaces methods of torch.Tensor
while training runs.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import torch
from lightning.pytorch import Callback

from project.training.callbacks.steps import logs_at

METHODS = ("item", "tolist", "__bool__", "__float__", "__int__")


# Reads that never wait for a device: StopOnSignal's flag, a CPU tensor reduced over its own gloo group each step.
HOST_FLAGS = ("training/callbacks/preemption.py",)


def _a_host_flag() -> bool:
    caller = traceback.extract_stack(limit=3)[0]  # the frame that called the tensor's method
    return caller.filename.endswith(HOST_FLAGS)


class CountConversions(Callback):
    def __init__(self, output_dir: str):
        self.output_dir = Path(output_dir)
        self.counts: dict[int, int] = {}
        self.where: dict[int, list[str]] = {}  # the first few callers per step, to say what converted
        self._step: int | None = None
        self._originals: dict[str, object] = {}

    def _patch(self) -> None:
        for name in METHODS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def counted(tensor, *args, _original=original, **kwargs):
                if self._step is not None and not _a_host_flag():
                    self.counts[self._step] = self.counts.get(self._step, 0) + 1
                    callers = self.where.setdefault(self._step, [])
                    if len(callers) < 5:
                        frame = [
                            f
                            for f in traceback.extract_stack()[:-1]
                            if "site-packages" not in f.filename
                            or "pytorch/" in f.filename
                            and "apply_func" not in f.filename
                            and "logger_connector/result" not in f.filename
                        ][-1]
                        callers.append(f"{frame.filename}:{frame.lineno} {frame.line}")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)

    def on_train_start(self, trainer, pl_module) -> None:
        self._patch()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step  # the step this micro batch belongs to: the previous one's count ends here
        self._step = step
        self.counts.setdefault(step, 0)

    def on_train_end(self, trainer, pl_module) -> None:
        self._step = None
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        folder = self.output_dir / "conversions"
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "counts": self.counts,
            "where": self.where,
            "logging_steps": [s for s in self.counts if logs_at(trainer, s)],
        }
        (folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1) + "\n")
