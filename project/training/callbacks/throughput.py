"""Tokens per second, tokens seen and model FLOPs utilization, logged once per optimizer step."""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from project.model.families import model_config
from project.model.flops import training_flops_per_token
from project.training.callbacks.steps import OptimizerSteps, logs_at

_PRECISION_DTYPE = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux: /proc, to 10 ms), None where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started = int(stat[stat.rindex(")") + 2 :].split()[19]) / os.sysconf("SC_CLK_TCK")  # clock ticks after boot
        return float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


class TokenThroughput(Callback):
    """Logs train/tokens_per_sec, train/tokens_seen and train/mfu.

    Time is counted from the start of an optimizer step's first micro batch to the end of its last,
    so validation and checkpoint writing between steps do not count, and averaged over the last
    `log_every_n_steps` steps, the window each logged row stands for. Logged at logging steps only; on a GPU
    the host waits for the device only then, so a step's time is the host's, and the window's adds up to the
    device's. MFU = model FLOPs per token
    (6N + attention, project.model.flops) x tokens/s over the peak FLOP/s of all devices: the peak
    comes from Lightning's table of GPUs, or from `peak_flops_per_device`; unknown, MFU is not logged.
    After the first optimizer step of a process, time/seconds_to_first_step: from the command's start (the
    process Lightning launches the others from) to the end of that step, imports and setup included.
    """

    def __init__(self, peak_flops_per_device: float | None = None):
        self.peak_flops_per_device = peak_flops_per_device
        self._optimizer_steps = OptimizerSteps()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps: deque[tuple[float, float]] = deque(
            maxlen=max(1, trainer.log_every_n_steps)  # type: ignore[attr-defined]
        )
        self._step_start: float | None = None
        self._timed_a_step = False
        self._optimizer_steps.start(trainer)
        self._peak = self.peak_flops_per_device
        if self._peak is None:
            dtype = _PRECISION_DTYPE.get(str(trainer.precision).split("-")[0], torch.float32)
            self._peak = get_available_flops(pl_module.device, dtype)
        if self._peak is None:
            rank_zero_info(
                "train/mfu is not logged: the peak FLOP/s of this device is unknown (set peak_flops_per_device=...)."
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._optimizer_steps.just_ended(trainer):  # inside a gradient-accumulation window
            return
        seq_len = batch[0].shape[1]
        tokens = trainer.datamodule.hparams.global_batch_size * seq_len  # type: ignore[attr-defined]
        assert self._step_start is not None  # set when the step's first micro batch started
        logs = logs_at(trainer, trainer.global_step - 1)
        if logs and pl_module.device.type == "cuda":
            # The host runs ahead of the device, which it waits for only here: the steps' times then add up to the
            # device's over the window, without a wait on every step.
            torch.cuda.synchronize(pl_module.device)
        self._steps.append((tokens, time.perf_counter() - self._step_start))
        self._step_start = None
        first, self._timed_a_step = not self._timed_a_step, True
        if first and trainer.is_global_zero and (age := process_age_seconds()) is not None:
            # Written at once: a value logged through self.log would wait for the next logging step.
            for logger in trainer.loggers:
                logger.log_metrics(
                    {"time/seconds_to_first_step": age}, step=trainer.global_step - 1
                )  # the step's own row
            rank_zero_info(f"first optimizer step done {age:.1f} s after the command started")
        if not logs:  # a number logged is copied to the device, which on a GPU waits for it
            return
        tokens_per_sec = sum(t for t, _ in self._steps) / sum(s for _, s in self._steps)
        pl_module.log("train/tokens_per_sec", tokens_per_sec)  # on the bar through StepProgressBar
        # float64: a float32 count stops being exact past 16M tokens
        seen = torch.tensor(
            trainer.datamodule.samples_consumed * seq_len,  # type: ignore[attr-defined]
            dtype=torch.float64,
        )
        pl_module.log("train/tokens_seen", seen)
        if self._peak:
            flops_per_token = training_flops_per_token(model_config(pl_module.hparams["model"]), seq_len)
            pl_module.log("train/mfu", flops_per_token * tokens_per_sec / (self._peak * trainer.world_size))
