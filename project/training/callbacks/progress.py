"""Progress bars that count optimizer steps to trainer.max_steps (the training stream itself is endless, and
Lightning's bars count the micro batches of the current epoch), and whose figures are read off the device only at
logging steps: StepProgressBar (tqdm, the default) and StepRichProgressBar (rich, `callbacks=rich_progress`)."""

from __future__ import annotations

import importlib.util
from typing import Any

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

from project.runtime.errors import ConfigError
from project.training.callbacks.steps import OptimizerSteps, logs_at

TRAINING_FIGURES = ("train/loss", "train/tokens_per_sec")


class OptimizerStepCount(ProgressBar):
    """What both bars share: the count and total in optimizer steps, and the figures shown.

    Lightning's bars draw `batch_idx + 1` of `total_train_batches`: with accumulation that counts micro batches
    (120/120 for 30 steps), and after a resume the batches since it, of no total (27/?): Lightning calls no
    on_train_epoch_start when it resumes mid-epoch, which is where the total is set. Here the bar is handed the
    optimizer step as its batch index, and its total is max_steps."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._steps = OptimizerSteps()
        self._fresh = True  # whether get_metrics may read the metrics now
        self._shown: dict | None = None

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._steps.start(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Reading the metrics (loss, tokens/s) makes the host wait for the device: the bar moves every step, its
        # figures change when the loggers get them.
        self._fresh = self._steps.just_ended(trainer) and logs_at(trainer, trainer.global_step - 1)
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, trainer.global_step - 1)
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


class StepProgressBar(OptimizerStepCount, TQDMProgressBar):
    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._from_step(trainer)  # a resumed run gets no on_train_epoch_start

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._from_step(trainer)

    def _from_step(self, trainer) -> None:
        """The bar at the step training starts from, its speed counted from there, named as a fresh run's."""
        bar = self.train_progress_bar
        bar.total = trainer.max_steps
        bar.n = bar.initial = trainer.global_step
        bar.set_description(f"Epoch {trainer.current_epoch}")


class StepRichProgressBar(OptimizerStepCount, RichProgressBar):
    def __init__(self, *args: Any, **kwargs: Any):
        if importlib.util.find_spec("rich") is None:  # Lightning's own error would end in a traceback
            raise ConfigError(
                "callbacks=rich_progress draws its bar with the rich package, which is not installed: install it "
                "(pip install rich), or leave rich_progress out of callbacks for the default tqdm bar."
            )
        super().__init__(*args, **kwargs)
        self._described: Any = None  # the training task whose description is set

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._one_line()

    def on_validation_start(self, trainer, pl_module) -> None:
        super().on_validation_start(trainer, pl_module)  # where Lightning makes the display again after a stop
        self._one_line()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._described = None
        self._describe(trainer)

    def _one_line(self) -> None:
        """In a terminal, the figures beside the bar on its line, cut short where the line ends: rich redraws a
        display of several lines (figures wrapped under the bar) by moving the cursor up, and the run's copy of the
        console (project.runtime.console) would keep every drawing, where it keeps the last of a bar redrawn on its
        line. Elsewhere (a file, a batch job's log) rich draws the display once, at the end, whole."""
        from rich.progress import BarColumn, ProgressColumn

        from project.training.callbacks.one_line import CutShort, Whole

        progress = self.progress
        if progress is None or not progress.console.is_terminal:
            return
        *columns, figures = progress.columns  # Lightning's metrics column last, after configure_columns'
        if isinstance(figures, CutShort) or not isinstance(figures, ProgressColumn):
            return
        # The bar and the figures give way (a bar is drawn to its column's width); the texts stay whole (rich keeps
        # a column given as a string whole).
        kept = (Whole(c) if isinstance(c, ProgressColumn) and not isinstance(c, BarColumn) else c for c in columns)
        progress.columns = (*kept, CutShort(figures))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._describe(trainer)  # a resumed run's task is made here, with no on_train_epoch_start before

    def _describe(self, trainer) -> None:
        """`Epoch 0`, as tqdm's bar: Lightning's rich bar adds `/{max_epochs - 1}`, `/-2` for a run of max_steps."""
        task = self.train_progress_bar_id
        if self.progress is None or task is None or task == self._described:
            return
        text, style = f"Epoch {trainer.current_epoch}", self.theme.description
        self.progress.update(task, description=f"[{style}]{text}" if style else text)
        self._described = task
