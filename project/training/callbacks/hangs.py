"""A rank that stops progressing leaves its stack in its console log (project.runtime.stacks): the watchdog is
re-armed at every step, validation batch and checkpoint; if none comes within nine tenths of `after_minutes` (the
strategy's collective timeout, after which the waiting ranks fail; `startup_minutes` until the first optimizer step
has ended, as project.training.callbacks.timeouts bounds the collectives), every thread's stack is written. A stop
signal writes the main thread's too, before the run's own handler saves and stops."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from project.parallel.strategies.timeout import startup_timeout
from project.runtime import stacks

# The watchdog writes the stacks a little before the collectives' bound ends: at the bound itself the waiting rank's
# main thread unwinds its error while faulthandler reads its frames, a race that crashed ranks (SIGSEGV) in tests.
BEFORE_THE_TIMEOUT = 0.9


class HangWatch(Callback):
    def __init__(self, after_minutes: float | None = None, startup_minutes: float | None = None):
        self.seconds = after_minutes * 60 if after_minutes else None
        startup = startup_timeout(startup_minutes, after_minutes)  # the bound the collectives have until then
        self.startup_seconds = startup.total_seconds() if startup else None
        self._signals_watched = False
        self._first_step = 0

    def _arm(self, trainer: Trainer) -> None:
        seconds = self.startup_seconds if trainer.global_step == self._first_step else self.seconds
        if seconds:
            stacks.arm(seconds * BEFORE_THE_TIMEOUT)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._first_step = trainer.global_step  # 0, or the step a resumed run starts from

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._signals_watched:  # now: after every handler of the run's start is in place, so as to chain them
            stacks.dump_on_signal()
            self._signals_watched = True
        self._arm(trainer)

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._arm(trainer)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._arm(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        stacks.disarm()
        if self._signals_watched:
            stacks.stop_dumping_on_signal()
            self._signals_watched = False
