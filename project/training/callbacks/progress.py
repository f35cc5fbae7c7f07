"""A progress bar whose total is the run's length (the training stream itself is endless), and whose figures are
read off the device only at logging steps."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar

from project.training.callbacks.steps import OptimizerSteps, logs_at

TRAINING_FIGURES = ("train/loss", "train/tokens_per_sec")


class StepProgressBar(TQDMProgressBar):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._steps = OptimizerSteps()
        self._fresh = True  # whether get_metrics may read the metrics now
        self._shown: dict | None = None

    @property
    def total_train_batches(self) -> int | float:
        # Micro batches until max_steps; the loader never ends, so Lightning would show no total.
        return self.trainer.max_steps * self.trainer.accumulate_grad_batches

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._steps.start(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Reading the metrics (loss, tokens/s) makes the host wait for the device: the bar moves every batch, its
        # figures change when the loggers get them.
        self._fresh = self._steps.just_ended(trainer) and logs_at(trainer, trainer.global_step - 1)
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            self._fresh = True

    def get_metrics(self, trainer, pl_module):
        if not self._fresh and self._shown is not None:
            return self._shown
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        # The training figures are logged without prog_bar, which Lightning reads off the device after every batch.
        logged = trainer.callback_metrics
        metrics |= {name: float(logged[name]) for name in TRAINING_FIGURES if name in logged}
        self._shown = metrics
        return metrics
