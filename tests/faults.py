"""Training with a fault injected, for the reliability tests:

    FAULT=nan@3 python -m tests.faults <project.train overrides>

runs `python -m project.train` with the fault; Lightning's launcher starts the other ranks with the same
command, so every rank has it. Faults: `nan@STEP`, the loss of optimizer step STEP (counted from 0) is
NaN on every rank, and so are its gradients.
"""

from __future__ import annotations

import os
import runpy

from lightning.pytorch import Callback, LightningModule, Trainer

import project.training


class InjectNaN(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and "loss" not in vars(pl_module):
            original = pl_module.loss
            pl_module.loss = lambda *args: original(*args) * float("nan")  # this instance only, until restored

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if "loss" in vars(pl_module) and trainer.global_step > self.step:
            del pl_module.loss


def with_fault(build_trainer):
    kind, _, step = os.environ["FAULT"].partition("@")
    if kind != "nan":
        raise ValueError(f"FAULT={os.environ['FAULT']}: expected nan@STEP")

    def build(*args, **kwargs):
        trainer = build_trainer(*args, **kwargs)
        trainer.callbacks.append(InjectNaN(int(step)))
        return trainer

    return build


if __name__ == "__main__":
    project.training.build_trainer = with_fault(project.training.build_trainer)
    # As `python -m project.train`: Hydra finds the config relative to the file it runs as __main__.
    runpy.run_module("project.train", run_name="__main__")
