"""SLURM preemption and time limits: checkpoint at the next optimizer step and stop, to be requeued."""

from __future__ import annotations

import signal
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from project.callbacks.checkpoint import StepCheckpoint

# project.train's exit status after such a stop: "saved, run me again" (experiments/slurm/train.sbatch).
REQUEUE_EXIT_STATUS = 3


class RequeueOnSignal(Callback):
    """On the signal SLURM sends ahead of a time limit or a preemption (`#SBATCH --signal=USR1@120`),
    finish the optimizer step under way, save last.ckpt as the periodic saves do, and stop; project.train
    then exits with REQUEUE_EXIT_STATUS, on which experiments/slurm/train.sbatch requeues the job, which
    resumes from that checkpoint. Requeueing from the batch script, once every rank has exited, spares
    the ranks from being killed while they shut down.

    Lightning's own handler (SLURMEnvironment's auto_requeue, which project.training turns off) saves
    from inside the signal handler, in the middle of a step or an accumulation window, a state that a
    resumed run cannot continue exactly. The signal may reach the ranks at slightly different steps,
    so they agree on it at each step boundary: the stop happens when any rank has seen it.
    """

    def __init__(self, checkpoint: StepCheckpoint, signum: signal.Signals = signal.SIGUSR1):
        self.checkpoint, self.signum = checkpoint, signum
        self._signalled, self._previous_handler = False, None
        self.stopped_for_requeue = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._previous_handler = signal.signal(self.signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signalled = True  # only a flag: the state is saved between steps

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # inside a gradient-accumulation window
            return
        self._last_step = trainer.global_step
        if trainer.global_step >= trainer.max_steps:  # finished: nothing to requeue
            return
        if not trainer.strategy.reduce_boolean_decision(self._signalled, all=False):
            return
        rank_zero_info(f"signal {self.signum.name} received: saving step {trainer.global_step} and stopping, to be requeued")
        self.checkpoint.save(trainer)
        trainer.should_stop = True
        self.stopped_for_requeue = True

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._previous_handler is not None:
            signal.signal(self.signum, self._previous_handler)
