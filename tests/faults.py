"""Training with faults injected, for the reliability tests:

    FAULT=nan@3 python -m tests.faults <project.train overrides>

runs `python -m project.train` with the faults (comma-separated); Lightning's launcher and torchrun start
the other ranks with the same command and environment, so every rank has them. Steps count optimizer
steps from 0; `:rank=R` limits a fault to global rank R (default: every rank).

- `nan@STEP`: the loss of step STEP is NaN, and so are its gradients.
- `spike@STEP`: the loss of step STEP is 1000 times what it is (its gradients too), once in the process: a run
  rolled back past it does not meet it again (a spike's batches are left out).
- `spikes@STEP`: the same, every time a run reaches step STEP (also after a rollback): a spike that recurs.
- `slow@STEP`: from step STEP on, each transformer block's forward computes 20 ms longer (a slow device).
- `kill@STEP`: SIGKILL every process of the run (its process group) as step STEP starts; with `:rank=R`
  that rank alone dies.
- `raise@STEP`: raise a RuntimeError as step STEP starts.
- `hang@STEP`: stop answering (sleep) as step STEP starts, as a rank stuck in a driver or a file system does.
- `drift@STEP`: as step STEP starts, the last part of a parameter that other ranks hold a copy of (the strategy's
  `replicas`) moves by one unit in the last place in its first element, as a kernel that adds in another order would
  move it (give `:rank=R`: a drift on every rank alike is no drift).
- `kill-in-save@N:OP`: SIGKILL every process of the run just before the OP-th change to the file system
  (counted from 1) that this process makes while it saves last.ckpt for the N-th time. Changes are
  renames, removals, directories made, and each 64 KiB written, so that OP can fall inside a file's
  writing (what was written before it is then on disk, as after a real kill).
- `count-save-ops`: print `faults: save N of rank R made K changes` after each save of last.ckpt.
"""

from __future__ import annotations

import builtins
import functools
import io
import os
import runpy
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

import project.training.run
from project.parallel.contract import contract_of
from project.training.callbacks.checkpoint import StepCheckpoint


def busy(seconds: float) -> None:
    """Compute (not sleep) for `seconds`: what a slow device or an overloaded host costs."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def kill_the_run() -> None:
    sys.stdout.flush(), sys.stderr.flush()
    os.killpg(os.getpgrp(), signal.SIGKILL)


@dataclass
class Fault:
    kind: str
    at: int
    rank: int | None = None
    op: int | None = None
    fired: bool = False

    @classmethod
    def parse(cls, text: str) -> "Fault":
        kind, _, rest = text.partition("@")
        fields = rest.split(":")
        fault = cls(kind, int(fields[0]) if fields[0] else 0)
        for extra in fields[1:]:
            if extra.startswith("rank="):
                fault.rank = int(extra.removeprefix("rank="))
            else:
                fault.op = int(extra)
        kinds = ("nan", "spike", "spikes", "slow", "kill", "raise", "hang", "drift", "kill-in-save", "count-save-ops")
        if kind not in kinds or (kind == "kill-in-save") != (fault.op is not None):
            raise ValueError(
                f"FAULT={text}: expected one of nan@STEP, spike@STEP, spikes@STEP, slow@STEP, kill@STEP, raise@STEP, "
                "hang@STEP, drift@STEP, kill-in-save@N:OP, count-save-ops"
            )
        return fault

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


SCALES = {"nan": float("nan"), "spike": 1000.0, "spikes": 1000.0}  # what the loss is multiplied by


class AtStep(Callback):
    """nan, spike, kill, raise and hang: as optimizer step `fault.at` starts (its first micro batch). The loss is
    scaled where the model computes it, its `head_loss` (also on a pipeline's last stage)."""

    def __init__(self, fault: Fault):
        self.fault = fault

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step != self.fault.at or not self.fault.applies_to(trainer.global_rank):
            return
        if self.fault.kind == "spike" and self.fault.fired:
            return
        if self.fault.kind == "kill":
            if self.fault.rank is None:
                kill_the_run()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault.kind == "raise":
            raise RuntimeError(f"fault injected at step {self.fault.at}")
        if self.fault.kind == "hang":
            while True:
                time.sleep(60)
        if self.fault.kind == "drift":
            if not self.fault.fired:
                first = contract_of(trainer.strategy).replicas(pl_module)[-1].local.view(-1)[:1]
                with torch.no_grad():
                    first.copy_(torch.nextafter(first, torch.full_like(first, float("inf"))))
                self.fault.fired = True
            return
        if self.fault.kind == "slow":
            if not self.fault.fired:  # once: the step's first micro batch
                for block in pl_module.model.layers.values():
                    block.register_forward_pre_hook(lambda *_: busy(0.02))
                self.fault.fired = True
            return
        model = pl_module.model
        if "head_loss" not in vars(model):  # this instance only, until restored
            model.head_loss = functools.partial(self.scaled, model.head_loss, SCALES[self.fault.kind])

    @staticmethod
    def scaled(original: Callable[..., Any], scale: float, *args: Any) -> Any:
        return original(*args) * scale

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step > self.fault.at:
            vars(pl_module.model).pop("head_loss", None)
            self.fault.fired = True

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        vars(pl_module.model).pop("head_loss", None)  # a rolled-back run's module is built anew; this one ends here
        self.fault.fired = self.fault.fired or trainer.global_step >= self.fault.at


@dataclass
class SaveWatch:
    """Counts (and with `kill_before` stops at) the file-system changes one process makes while saving."""

    save: int = 0
    active: bool = False
    changes: int = 0
    in_save: bool = False
    kill_before: int | None = None
    originals: dict[str, Callable[..., Any]] = field(default_factory=dict)

    def change(self) -> None:
        if not self.active:
            return
        self.changes += 1
        if self.changes == self.kill_before:
            kill_the_run()

    def wrap(self, module: Any, name: str) -> None:
        original = getattr(module, name)
        self.originals[f"{module.__name__}.{name}"] = original

        @functools.wraps(original)
        def changing(*args, **kwargs):
            if not (args and is_run_record(args[0])):
                self.change()
            return original(*args, **kwargs)

        setattr(module, name, changing)

    def install(self) -> None:
        for name in ("rename", "replace", "unlink", "remove", "rmdir", "mkdir"):
            self.wrap(os, name)
        # Object storage (ckpt_dir=s3://...): each piece of an upload, each small object put, each removal, and
        # torch's rename of a folder's metadata (a copy there). Where a module imported a function by name, there.
        from project.checkpoint import latest, locations
        from project.parallel.strategies import saving
        from project.training.callbacks import checkpoint

        for module, name in [
            (locations._Writing, "_send"),
            (locations.ObjectFiles, "rename"),
            (locations.ObjectFiles, "rm_file"),
            (latest, "write_bytes"),
            (latest, "remove"),
            (saving, "write_bytes"),
            (checkpoint, "remove"),
        ]:
            self.wrap(module, name)
        original_open = io.open

        @functools.wraps(original_open)
        def watched_open(file, mode="r", *args, **kwargs):
            opened = original_open(file, mode, *args, **kwargs)
            writes = self.active and any(c in mode for c in "wax+") and not is_run_record(file)
            return WatchedFile(opened, self) if writes else opened

        io.open = builtins.open = watched_open  # pathlib's Path.open calls io.open


RUN_RECORDS = {"metrics.csv", "hparams.yaml", "config.yaml", "layouts.jsonl", "stability.jsonl"}


def is_run_record(path: Any) -> bool:
    """The run's logs and metrics: while a save is written in the background (ckpt_async) the run goes on writing
    them, and their writes are not the save's changes."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    path = Path(path)
    return path.name in RUN_RECORDS or path.suffix == ".log" or "memory" in path.parts or "wandb" in path.parts


class WatchedFile:
    """A file opened for writing during a watched save: every 64 KiB written is a change."""

    PIECE = 64 * 1024

    def __init__(self, file: Any, watch: SaveWatch):
        self._file, self._watch = file, watch

    def write(self, data) -> int:
        view = data if isinstance(data, str) else memoryview(data).cast("B")
        for start in range(0, len(view), self.PIECE):
            self._watch.change()
            self._file.write(view[start : start + self.PIECE])
            self._file.flush()  # what a killed process had handed to the kernel is on disk
        return len(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> "WatchedFile":
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def __iter__(self):
        return iter(self._file)


def watch_saves(faults: list[Fault]) -> None:
    """Wrap StepCheckpoint's save so that the watched one counts its changes (and dies where asked)."""
    kill = next((f for f in faults if f.kind == "kill-in-save"), None)
    count = any(f.kind == "count-save-ops" for f in faults)
    if kill is None and not count:
        return
    watch = SaveWatch(kill_before=None)
    watch.install()
    save, put_in_place = StepCheckpoint.write, StepCheckpoint._put_in_place

    def done(rank: int) -> None:
        watch.active = False
        if count:
            print(f"faults: save {watch.save} of rank {rank} made {watch.changes} changes", file=sys.stderr, flush=True)

    def watched_save(checkpoint: StepCheckpoint, trainer: Trainer, filepath: str) -> None:
        checkpoint.finish(trainer)  # the save before, written in the background (ckpt_async), ends in its own count
        watch.save += 1
        watch.active, watch.changes = True, 0
        watch.kill_before = kill.op if kill is not None and watch.save == kill.at else None
        watch.in_save = True
        try:
            save(checkpoint, trainer, filepath)
        finally:
            watch.in_save = False
            # Written in the background, the save goes on until rank 0 puts it in place (watched_put_in_place) or
            # the run ends.
            if checkpoint._in_flight is None or not trainer.is_global_zero:
                done(trainer.global_rank)

    def watched_put_in_place(checkpoint: StepCheckpoint, staged: Path, target: Path) -> None:
        put_in_place(checkpoint, staged, target)
        if watch.active and not watch.in_save:
            done(0)  # only rank 0 puts a save in place

    StepCheckpoint.write = watched_save
    StepCheckpoint._put_in_place = watched_put_in_place


def with_faults(build_trainer, faults: list[Fault]):
    @functools.wraps(build_trainer)
    def build(*args, **kwargs):
        trainer = build_trainer(*args, **kwargs)
        at_step = ("nan", "spike", "spikes", "slow", "kill", "raise", "hang", "drift")
        trainer.callbacks.extend(AtStep(f) for f in faults if f.kind in at_step)
        return trainer

    return build


if __name__ == "__main__":
    faults = [Fault.parse(text) for text in os.environ["FAULT"].split(",") if text]
    project.training.run.build_trainer = with_faults(project.training.run.build_trainer, faults)
    watch_saves(faults)
    # As `python -m project.train`: Hydra finds the config relative to the file it runs as __main__.
    runpy.run_module("project.train", run_name="__main__")
