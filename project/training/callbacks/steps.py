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


def logs_at(trainer: Trainer, step: int) -> bool:
    """Whether Lightning hands the metrics of optimizer step `step` (0-based) to the loggers: every
    `trainer.log_every_n_steps`-th step and the step at which the run is asked to stop (Lightning's own rule; a run
    shorter than log_every_n_steps is given that many, project.training.trainer, so that it logs its last step).

    Values are read off the device only then: logged on other steps they would only be replaced before anyone
    saw them, and logging a Python number copies it to the device, which on a GPU waits for the device."""
    every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Trainer.__init__, untyped
    return every > 0 and ((step + 1) % every == 0 or trainer.should_stop)
