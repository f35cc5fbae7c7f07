"""last.ckpt every N optimizer steps and after the final one, in a state that resumes exactly; the best
checkpoint by val/loss; both with a write the file system refuses (a full disk) reported as one clear error."""

from __future__ import annotations

import time
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException

from project.checkpoint.background import finished
from project.checkpoint.files import checkpoint_step, swap_in
from project.checkpoint.latest import latest, publish, save_name
from project.checkpoint.locations import (
    Location,
    is_remote,
    join,
    location,
    name_of,
    parent_of,
    remove,
    size,
    storage_errors,
)
from project.parallel.contract import contract_of
from project.runtime.errors import ConfigError
from project.training.callbacks.steps import OptimizerSteps


class StepCheckpoint(Checkpoint):  # a Checkpoint: Lightning runs it after the other callbacks of a step
    """last.ckpt every `every_n_train_steps` optimizer steps, after the step that reaches max_steps, and, with
    `every_minutes`, after the first step that ends that long after the last save of those at which the ranks decide
    whether to save (`decides_at`), so at most `check_every_n_steps` - 1 steps after the first that does; rank 0's
    clock decides for every rank. A Callback around `trainer.save_checkpoint`, called from the batch hook.

    `trainer.save_checkpoint` after `fit` would record a finished epoch, and a run resumed from it
    (to train longer) would start a new epoch with shifted step counters. Saving from the batch
    hook keeps the mid-stream state that resumes exactly.

    Each save is written beside last.ckpt and then swapped in, so a run killed while saving
    (preemption, out of memory) keeps its previous last.ckpt; one of another layout's format (a
    sharded folder, now a single file, or the reverse) is kept under another name. In object storage, where nothing
    is renamed, each save is written as step-<N>.ckpt and `latest` then names it (project.checkpoint.latest). Written
    in the background (ckpt_async), it is swapped in once written: by rank 0 as soon as it sees the write ended (at
    the start of a batch), else before the next save and at the end of training, where every rank waits for it.
    """

    def __init__(
        self,
        dirpath: str | Path,
        every_n_train_steps: int = 0,
        every_minutes: float | None = None,
        check_every_n_steps: int = 10,
        keep_last: int = 1,
        save_weights_only: bool = False,
    ):
        where = str(dirpath)
        self.dirpath = where if is_remote(where) else str(Path(where).expanduser().resolve())
        self.every_n_train_steps = every_n_train_steps
        self.every_minutes = every_minutes
        self.check_every_n_steps = check_every_n_steps
        self.keep_last = keep_last
        self.save_weights_only = save_weights_only
        self._saved_at = time.monotonic()
        self._steps = OptimizerSteps()
        self._saved_step: int | None = None  # the optimizer step of this run's latest save
        self._saved_path: str | None = None  # where it went
        self._in_flight: InFlight | None = None  # a save being written in the background, to swap in once written
        self._unlogged: list[InFlight] = []  # saves in place whose checkpoint/* metrics are still to be logged

    @property
    def last_path(self) -> str:
        return f"{self.dirpath.rstrip('/')}/last.ckpt"

    def decides_at(self, trainer: Trainer, step: int) -> bool:
        """Whether the ranks agree, at optimizer step `step` (0-based), on whether to save now: on `every_minutes`
        (rank 0's clock) and on a stop signal (StopOnSignal). Agreeing is a collective of every rank on the host,
        milliseconds at hundreds of ranks, so not every step: every `check_every_n_steps`-th step and every logging
        step, at which the host waits for the device and the ranks reduce the metrics anyway. A function of the step
        alone, so the same steps on every rank."""
        every_log = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Trainer.__init__, untyped
        return (step + 1) % self.check_every_n_steps == 0 or (every_log > 0 and (step + 1) % every_log == 0)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._saved_at = time.monotonic()
        self._steps.start(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        written = self._in_flight
        if written is not None and trainer.is_global_zero and written.future.done() and not written.swapped:
            if written.future.exception() is None:  # a failed write is reported where every rank agrees
                try:
                    self._put_in_place(written.staged, written.target)
                    self._swapped(written)
                except storage_errors() as error:  # rank 0 alone here: left to `finish`, where every rank learns of it
                    rank_zero_warn(f"{written.target} not yet put in place ({error}); tried again at the next save")
        self._log(trainer)
        self._remove_replaced(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.finish(trainer)
        self._log(trainer)
        self._remove_replaced(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # A rollback builds the run again in this process: the write must not go on into the next fit's saves.
        if self._in_flight is not None:
            with suppress(Exception):
                self._in_flight.future.result()
            self._in_flight = None

    def finish(self, trainer: Trainer) -> None:
        """Wait for a save written in the background (every rank), and put it in place."""
        written, self._in_flight = self._in_flight, None
        if written is None:
            return
        try:
            contract_of(trainer.strategy).finish_checkpoint_writes()  # a failed write ends the run here, named
        except ConfigError:
            # Rank 0's record decides: its own write done (the failed one was another, a best checkpoint's), it goes
            # in place; failed, nothing half written is left beside the last one.
            whole = written.future.done() and written.future.exception() is None
            settle = self._nothing if written.swapped else self._put_in_place if whole else self._remove_staged
            self._on_rank_zero(trainer, settle, written.staged, written.target)
            raise
        settle = self._nothing if written.swapped else self._put_in_place
        self._on_rank_zero(trainer, settle, written.staged, written.target)
        if trainer.is_global_zero and not written.swapped:
            self._swapped(written)

    @staticmethod
    def _nothing(staged: Location, target: Location) -> None:
        pass

    @staticmethod
    def _is_latest(staged: Location, target: Location) -> bool:
        return latest(parent_of(staged)) == staged

    @staticmethod
    def _remove_staged(staged: Location, target: Location) -> None:
        remove(staged)

    def _put_in_place(self, staged: Location, target: Location) -> None:
        """Rank 0: the written checkpoint at `staged` becomes `target`; the one it replaces is kept or removed
        first (ckpt_keep_last), so that a replaced one awaiting that is never lost to the next swap. In object
        storage: `latest` names it, then the saves beyond keep_last go."""
        if is_remote(target):
            publish(staged, self.keep_last)
            return
        assert isinstance(staged, Path) and isinstance(target, Path)
        self._keep_replaced(target)
        self._swap_in(staged, target)

    def _swapped(self, written: "InFlight") -> None:
        written.swapped = True
        written.measured = written.metrics()  # now: a later save replaces the target
        self._unlogged.append(written)

    def _log(self, trainer: Trainer) -> None:
        """The checkpoint/* metrics of the saves put in place since, each in the row of the step whose end it saved
        (0-based, as train/loss: a run resumed from it keeps the row); rank 0, whose loggers write. Not inside the
        save: Lightning writes the step's own row after the save returns, and a run killed before that row lost it."""
        saves, self._unlogged = self._unlogged, []
        if trainer.is_global_zero:
            for written in saves:
                for logger in trainer.loggers:
                    logger.log_metrics(written.measured or written.metrics(), step=written.step - 1)

    @staticmethod
    def _swap_in(staged: Path, target: Path) -> None:
        kept = swap_in(staged, target, False)
        if kept is not None:
            rank_zero_info(f"the previous {target.name}, of another layout's format, is now {kept}")

    def _remove_replaced(self, trainer: Trainer) -> None:
        if trainer.is_global_zero and self._saved_path and not is_remote(self._saved_path):
            try:
                self._keep_replaced(Path(self._saved_path))
            except storage_errors() as error:  # rank 0 alone here: said, and tried again at the next save
                rank_zero_warn(f"the checkpoint {self._saved_path} replaced was not yet removed ({error})")

    def _keep_replaced(self, target: Path) -> None:
        """The checkpoint a newer `target` replaced (`<target>.old`, the newer whole in place): removed, or with
        `keep_last` > 1 kept as step-<N>.ckpt (one of that step already there replaced), the oldest steps removed
        beyond keep_last - 1."""
        replaced = target.with_name(f"{target.name}.old")
        if self.keep_last <= 1 or not replaced.exists():
            remove(replaced)
            return
        kept = replaced.with_name(f"step-{checkpoint_step(replaced):06d}.ckpt")
        remove(kept)  # a run resumed from an earlier one saves that step again
        replaced.rename(kept)
        steps = sorted(replaced.parent.glob("step-*.ckpt"), key=lambda p: int(p.stem.removeprefix("step-")))
        for old in steps[: max(0, len(steps) - (self.keep_last - 1))]:
            remove(old)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._steps.just_ended(trainer):
            return
        step, every = trainer.global_step, self.every_n_train_steps
        if step == trainer.max_steps or (every > 0 and step % every == 0):
            self.save(trainer)
        elif self.every_minutes:
            due = time.monotonic() - self._saved_at >= 60 * self.every_minutes
            if self.decides_at(trainer, step - 1) and trainer.strategy.broadcast(due):
                self.save(trainer)

    def save(self, trainer: Trainer) -> None:
        """Save last.ckpt now, between optimizer steps (unless this step is saved already, or this is no fit)."""
        fast_dev_run = trainer.fast_dev_run  # type: ignore[attr-defined]  # set by Trainer.__init__, untyped
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and not fast_dev_run
        if fitting and self._saved_step != trainer.global_step:
            self.write(trainer, self.last_path)

    def write(self, trainer: Trainer, filepath: str) -> None:
        """Write the checkpoint of this step to `filepath` through a staged path: in place when written, or once its
        background write ends."""
        self.finish(trainer)  # one in flight at most: the one before is in place first
        started = time.perf_counter()
        target = location(filepath)
        staged = (
            join(parent_of(target), save_name(trainer.global_step))
            if is_remote(target)
            else Path(f"{filepath}.partial")
        )
        if is_remote(target) and self._on_rank_zero(trainer, self._is_latest, staged, target):
            # The save this run resumed from, saved again (its step reached anew): it is there, and removing it to
            # write it again would leave nothing to resume from until the write ends.
            self._saved_step = trainer.global_step
            return
        # Only rank 0 touches the files; the others learn whether it worked (or they would wait for
        # it at the next collective until the process group times out).
        self._on_rank_zero(trainer, remove, staged)  # left by a save that was killed: never mix old shards with new
        with refused_by_storage(trainer, staged, target):
            trainer.save_checkpoint(str(staged), self.save_weights_only)  # ends with a barrier: every rank has written
        # The replaced checkpoint is removed at the next step, not here: Lightning logs this step's metrics
        # after the save returns, and a run killed between the swap and that row would lose the row for good.
        future = contract_of(trainer.strategy).checkpoint_written()
        stall = time.perf_counter() - started
        written = InFlight(
            staged, target, future if future is not None else finished(), trainer.global_step, started, stall
        )
        if future is None:  # written already
            self._on_rank_zero(trainer, self._put_in_place, staged, target)
            if trainer.is_global_zero:
                self._swapped(written)
        else:
            self._in_flight = written
        self._saved_step = trainer.global_step
        self._saved_path = filepath
        self._saved_at = time.monotonic()

    @staticmethod
    def _on_rank_zero(trainer: Trainer, fn: Callable[..., Any], *args: Any) -> Any:
        outcome: tuple[bool, Any] = (True, None)
        if trainer.is_global_zero:
            try:
                outcome = (True, fn(*args))
            except storage_errors() as error:  # a full disk, permissions; a bucket refusing
                outcome = (
                    False,
                    f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}",
                )
        ok, value = trainer.strategy.broadcast(outcome)
        if not ok:
            raise ConfigError(
                f"rank 0 could not put the checkpoint in place ({fn.__name__} {', '.join(map(str, args))}: {value}). "
                f"Free space or fix the permissions in {parent_of(args[0])}, then resume with "
                "hydra.run.dir=<this run's directory> ckpt_path=last."
            )
        return value


@dataclass
class InFlight:
    """A save of last.ckpt: written (or being written) to `staged`, to be swapped in at `target` (in object storage,
    named by `latest` where it is)."""

    staged: Location
    target: Location
    future: Future  # the write, going on in the background or done
    step: int
    started: float  # time.perf_counter() as the save began
    stall: float  # seconds training waited for it: the whole save, or the copy to host memory
    written_at: float | None = None  # when its write ended
    swapped: bool = False  # rank 0's record: in place
    measured: dict[str, float] | None = None  # its checkpoint/* metrics, as it went in place

    def __post_init__(self) -> None:
        self.future.add_done_callback(lambda _: setattr(self, "written_at", time.perf_counter()))

    def metrics(self) -> dict[str, float]:
        """checkpoint/*: its size, the seconds from the save's start to the end of its write, and the write's
        throughput; the seconds training waited for it. Once it is in place (rank 0)."""
        try:
            written = size(self.staged if is_remote(self.target) else self.target)
        except storage_errors():  # rank 0 alone here: the metric is lost, not the run
            written = 0
        seconds = (self.written_at or time.perf_counter()) - self.started
        return {
            "checkpoint/gigabytes": written / 1e9,
            "checkpoint/seconds": seconds,
            "checkpoint/gigabytes_per_second": written / 1e9 / seconds if seconds > 0 else 0.0,
            "checkpoint/stall_seconds": self.stall,
        }


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, with a full disk or a refused write reported as one clear error."""

    @property
    def state_key(self) -> str:
        # Lightning's key, named after ModelCheckpoint, so that checkpoints from before this class resume its state.
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        with refused_by_storage(trainer, location(filepath), location(filepath)):
            super()._save_checkpoint(trainer, filepath)

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        # Lightning removes the best it replaced right after the new one's save returns: written in the background
        # (ckpt_async), the new one is complete only once its write ends.
        contract_of(trainer.strategy).finish_checkpoint_writes()
        if not is_remote(filepath):
            super()._remove_checkpoint(trainer, filepath)
        elif trainer.is_global_zero and self._ours_to_remove(trainer, filepath):
            remove(filepath)  # a folder of shards is a prefix: removed object by object

    def _ours_to_remove(self, trainer: Trainer, filepath: str) -> bool:
        """What Lightning keeps of a local best it replaced, for object storage too (it removes any URL): the
        checkpoint the run resumed from, and one outside this callback's folder."""
        folder = f"{str(self.dirpath).rstrip('/')}/"
        return filepath != str(trainer.ckpt_path) and filepath.startswith(folder)


@contextmanager
def refused_by_storage(trainer: Trainer, written: Location, target: Location) -> Iterator[None]:
    """A save that the storage refused (full disk, quota, permissions; a missing bucket or credentials) becomes a
    ConfigError that says
    so, with what was half written removed; the checkpoints saved before are untouched.

    No collective here: the other ranks may not have failed, and they are ended with this one.
    """
    try:
        yield
    except BaseException as error:  # torch's CheckpointException is a BaseException
        refused = storage_errors()
        if not isinstance(error, (*refused, CheckpointException)):
            raise
        failures = [f for f, _ in error.failures.values()] if isinstance(error, CheckpointException) else [error]
        cause = next((f for f in failures if isinstance(f, refused)), None)
        if cause is None:
            raise
        if trainer.is_global_zero:
            with suppress(*refused):
                remove(written)
        raise ConfigError(
            f"{name_of(target)} of step {trainer.global_step} could not be written to {parent_of(target)} "
            f"({type(cause).__name__}: {cause}). The checkpoints saved before are untouched: free space (or raise the "
            "quota, or fix the permissions or credentials) there, then resume with hydra.run.dir=<this run's "
            "directory> ckpt_path=last."
        ) from None
