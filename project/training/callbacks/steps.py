"""Lightning calls `on_train_batch_end` after every micro batch; the callbacks that act once per optimizer step ask
`OptimizerSteps` whether one has just ended, rather than each keeping its own count."""

from __future__ import annotations

from lightning.pytorch import Trainer


class OptimizerSteps:
    def __init__(self) -> None:
        self._seen = -1

    def start(self, trainer: Trainer) -> None:
        """At on_train_start: the step training starts from (0, or that of the checkpoint it resumes)."""
        self._seen = trainer.global_step

    def just_ended(self, trainer: Trainer) -> bool:
        """At on_train_batch_end: an optimizer step ended with this batch (not inside an accumulation window)."""
        if trainer.global_step == self._seen:
            return False
        self._seen = trainer.global_step
        return True
