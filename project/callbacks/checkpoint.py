"""last.ckpt every N optimizer steps and after the final one, in a state that resumes exactly."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint


class StepCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that also writes last.ckpt after the step that reaches max_steps.

    `trainer.save_checkpoint` after `fit` would record a finished epoch, and a run resumed from it
    (to train longer) would start a new epoch with shifted step counters. Saving from the batch
    hook, as the periodic checkpoints do, keeps the mid-stream state that resumes exactly.
    """

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        final = trainer.global_step == trainer.max_steps
        if final and self._last_global_step_saved != trainer.global_step and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
