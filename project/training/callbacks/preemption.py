"""Stop signals (SIGTERM from a scheduler or a user, Ctrl-C's SIGINT, SLURM's warning of a preemption or time limit):
checkpoint at the next step at which the ranks decide whether to save, and stop, to be resumed."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from project.parallel.groups import release_group, side_group
from project.training.callbacks.checkpoint import StepCheckpoint
from project.training.callbacks.steps import OptimizerSteps

# project.train's exit status after such a stop: "saved, run me again" (experiments/slurm/train.sbatch).
REQUEUE_EXIT_STATUS = 3


class StopOnSignal(Callback):
    """On SIGTERM (what schedulers, `kill` and `timeout` send), SIGINT (Ctrl-C), or the signal SLURM sends ahead of a
    time limit or a preemption (`#SBATCH --signal=USR1@120`), finish the optimizer step at which the ranks agree on it
    (below), save last.ckpt as the periodic saves do, and stop; project.train then exits with REQUEUE_EXIT_STATUS, on
    which experiments/slurm/train.sbatch requeues the job, and `ckpt_path=last` resumes exactly.

    Lightning's own handlers save nothing on SIGTERM (they end the other ranks at once), and on SLURM's
    signal save from inside the handler, in the middle of a step or an accumulation window, a state that a
    resumed run cannot continue exactly (project.training.run turns SLURM's auto-requeue off). The signal may
    reach one rank only, or the ranks at different steps, so they agree on it, before a step's update, at the steps
    where they decide whether to save (StepCheckpoint.decides_at: every `ckpt_check_every_n_steps`-th step, 10 by
    default, and every logging step): the stop happens at the end of the first such step by which any rank has seen
    it. The bound: a run finishes the step under way when the signal comes and at most `ckpt_check_every_n_steps`
    more, every rank the same. Not every step: agreeing is a collective of every rank on the host, milliseconds of
    every step at hundreds of ranks. They agree over a group of their own on the CPU (gloo), so that the flag they
    read never waits for a device (Horovod: its allreduce). Decided before the step's update, so that the step's own
    metrics are logged: Lightning writes the row of a step at which the run stops.

    A second Ctrl-C stops at once, as Python's own handler would have the first time (Lightning's handling of a
    KeyboardInterrupt then ends the run, saving nothing more). A terminal's Ctrl-C, and `kill -TERM -PGID`, reach every
    process of the group: loader workers are in groups of their own (project.data.loader_workers), so that the loader
    still reads the batches up to the stop.

    The handlers are this fit's: Lightning's teardown after an exception puts back the handlers it found as the fit
    started (these), so project.training.run calls `restore` once `fit` has returned or raised; a signal that comes
    after the fit ended is handed on to the next fit of the process, if a rollback starts one.
    """

    _handed_on: signal.Signals | None = None  # a signal the fit a rollback ended had received, for the next fit

    @classmethod
    def forget_handed_on(cls) -> None:
        """A new run starts: a signal handed on by an earlier run of the process (one that ended without another
        fit) is not this run's."""
        cls._handed_on = None

    def __init__(self, checkpoint: StepCheckpoint, signums: tuple[signal.Signals, ...] = (signal.SIGTERM,)):
        self.checkpoint, self.signums = checkpoint, signums
        self._signalled: signal.Signals | None = None
        self._previous_handlers: dict[signal.Signals, Any] = {}
        self.stopped_for_requeue = False
        self._stopping = False
        self._ended = False  # the fit ended in an exception: a signal now is the next fit's
        self._speaks = False  # rank 0 says at once that a signal came
        self._group: dist.ProcessGroup | None = None
        self._steps = OptimizerSteps()

    def _on_signal(self, signum: int, frame: Any) -> None:
        received = signal.Signals(signum)
        if self._ended:
            StopOnSignal._handed_on = received
            return
        if received == signal.SIGINT and self._signalled == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: at once, without saving
        first = self._signalled is None
        self._signalled = received  # only a flag: the state is saved between steps
        if first and self._speaks:  # os.write, not print: the interrupted code may be writing to sys.stderr's buffer
            again = "; Ctrl-C again stops at once, without saving" if received == signal.SIGINT else ""
            said = f"\n{received.name} received: the run saves and stops within ckpt_check_every_n_steps=" + (
                f"{self.checkpoint.check_every_n_steps} steps{again}\n"
            )
            os.write(2, said.encode())

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Early, so that data-loader workers forked later inherit the handler: SLURM signals every process
        # of the job, and a worker left with the default action would die of it.
        self._speaks = trainer.is_global_zero if trainer is not None else False
        self._install()
        if StopOnSignal._handed_on is not None:  # received by the fit a rollback ended (on_exception)
            self._signalled, StopOnSignal._handed_on = StopOnSignal._handed_on, None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install()  # again: Lightning installs its own handlers as fit starts
        self._steps.start(trainer)
        # Lightning broadcasts rank 0's SIGTERM flag, and reads it on the host, before every batch of a run of
        # several processes (Lightning#21487): on a GPU, a wait for the device every step. The flag is set by
        # Lightning's SIGTERM handler only, which ours has just replaced for the whole of training: the broadcast
        # would carry nothing, so it is left out (tests/test_private_names.py).
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]
        if trainer.world_size > 1 and self._group is None and dist.is_initialized():  # every rank, in the same order
            self._group = side_group()

    def _install(self) -> None:
        for signum in self.signums:
            previous = signal.signal(signum, self._on_signal)
            if previous != self._on_signal and signum not in self._previous_handlers:
                self._previous_handlers[signum] = previous

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._stopping or trainer.global_step + 1 >= trainer.max_steps:  # the last step: nothing to requeue
            return
        if not self.checkpoint.decides_at(trainer, trainer.global_step):
            return
        seen = self._signalled is not None
        if self._group is not None:
            flag = torch.tensor([int(seen)])
            dist.all_reduce(flag, group=self._group)
            seen = bool(flag.item())  # a CPU tensor, reduced over gloo: no device to wait for
        elif trainer.world_size > 1:  # ranks joined by their own launcher (Horovod), not torch.distributed
            seen = trainer.strategy.reduce_boolean_decision(seen, all=False)
        if seen:
            self._stopping = trainer.should_stop = True

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._steps.just_ended(trainer) or not self._stopping or self.stopped_for_requeue:
            return
        name = self._signalled.name if self._signalled is not None else "a stop signal (on another rank)"
        rank_zero_info(f"{name} received: saving step {trainer.global_step} and stopping, to be resumed")
        self.checkpoint.save(trainer)
        self.stopped_for_requeue = True

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt) and self._signalled == signal.SIGINT:
            rank_zero_info(
                f"stopped at once by a second Ctrl-C in step {trainer.global_step + 1}: nothing saved since the last "
                "checkpoint; resume from it with ckpt_path=last (or ckpt_path=auto)"
            )
        # Lightning calls no teardown after an exception; the run may go on (a rollback builds it again), and a
        # signal then must reach the new instance, not this one: one received already is handed on to it.
        if self._signalled is not None and not self.stopped_for_requeue:
            StopOnSignal._handed_on = self._signalled
        self._ended = True
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.restore()
        release_group(self._group)  # its sockets and threads: a rollback's fit makes a group of its own
        self._group = None

    def restore(self) -> None:
        """The signal handlers as they were before this fit; again where Lightning's teardown after an exception put
        this fit's back (project.training.run, once `fit` returned or raised)."""
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
