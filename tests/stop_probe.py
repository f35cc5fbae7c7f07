"""A callback for tests/test_stop_and_timed_saves.py, added to a run as
`+callbacks.probe._target_=tests.stop_probe.StopProbe`: it sends SIGTERM to its own process as optimizer step
`signal_step` starts on rank `signal_rank` only (a signal that reached one rank), makes the clock of every rank but 0
never due for a save by time (rank 0's clock decides for all), and writes per rank, to
`<output_dir>/probe/rank<R>.json`, the steps at which a checkpoint was saved and the step at which the fit ended."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from project.training.callbacks.checkpoint import StepCheckpoint
from project.training.callbacks.preemption import StopOnSignal


class StopProbe(Callback):
    def __init__(self, output_dir: str, signal_step: int, signal_rank: int):
        self.output_dir, self.signal_step, self.signal_rank = Path(output_dir), signal_step, signal_rank
        self.saves: list[int] = []
        self._sent = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank != 0:
            for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning, undeclared
                if isinstance(callback, StepCheckpoint):
                    callback.every_minutes = 1e9

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.signal_step and trainer.global_rank == self.signal_rank and not self._sent:
            self._sent = True
            os.kill(os.getpid(), signal.SIGTERM)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.saves.append(trainer.global_step)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        stops = [c for c in trainer.callbacks if isinstance(c, StopOnSignal)]  # type: ignore[attr-defined]
        record = {
            "saves": self.saves,
            "ended_at": trainer.global_step,
            "stopped_for_requeue": any(stop.stopped_for_requeue for stop in stops),
        }
        folder = self.output_dir / "probe"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record) + "\n")
        # tests/in_process.py takes any exit for a failure, the requeue's status 3 too (tests/test_faults.py proves it
        # end to end): the run ends here as one stopped early does, and the next case can run.
        for stop in stops:
            stop.stopped_for_requeue = False
