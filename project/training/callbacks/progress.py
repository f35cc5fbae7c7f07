"""A progress bar whose total is the run's length: the training stream itself is endless."""

from __future__ import annotations

from lightning.pytorch.callbacks import TQDMProgressBar


class StepProgressBar(TQDMProgressBar):
    @property
    def total_train_batches(self) -> int | float:
        # Micro batches until max_steps; the loader never ends, so Lightning would show no total.
        return self.trainer.max_steps * self.trainer.accumulate_grad_batches

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
