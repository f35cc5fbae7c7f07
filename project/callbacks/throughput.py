"""Tokens per second, tokens seen and model FLOPs utilization, logged once per optimizer step."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from project.model import training_flops_per_token

_PRECISION_DTYPE = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}


class TokenThroughput(Callback):
    """Logs train/tokens_per_sec, train/tokens_seen and train/mfu.

    Time is counted from the start of an optimizer step's first micro batch to the end of its last,
    so validation and checkpoint writing between steps do not count, and averaged over the last
    `log_every_n_steps` steps, the window each logged row stands for. MFU = model FLOPs per token
    (6N + attention, project.model.flops) x tokens/s over the peak FLOP/s of all devices: the peak
    comes from Lightning's table of GPUs, or from `peak_flops_per_device`; unknown, MFU is not logged.
    """

    def __init__(self, peak_flops_per_device: float | None = None):
        self.peak_flops_per_device = peak_flops_per_device

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps: deque[tuple[float, float]] = deque(maxlen=max(1, trainer.log_every_n_steps))
        self._step_start: float | None = None
        self._last_step = trainer.global_step
        self._peak = self.peak_flops_per_device
        if self._peak is None:
            dtype = _PRECISION_DTYPE.get(str(trainer.precision).split("-")[0], torch.float32)
            self._peak = get_available_flops(pl_module.device, dtype)
        if self._peak is None:
            rank_zero_info("train/mfu is not logged: the peak FLOP/s of this device is unknown (set peak_flops_per_device=...).")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # inside a gradient-accumulation window
            return
        self._last_step = trainer.global_step
        seq_len = batch[0].shape[1]
        tokens = trainer.datamodule.hparams.global_batch_size * seq_len
        self._steps.append((tokens, time.perf_counter() - self._step_start))
        self._step_start = None
        tokens_per_sec = sum(t for t, _ in self._steps) / sum(s for _, s in self._steps)
        pl_module.log("train/tokens_per_sec", tokens_per_sec, prog_bar=True)
        # float64: a float32 count stops being exact past 16M tokens
        seen = torch.tensor(trainer.datamodule.samples_consumed * seq_len, dtype=torch.float64)
        pl_module.log("train/tokens_seen", seen)
        if self._peak:
            flops_per_token = training_flops_per_token(pl_module.model.config, seq_len)
            pl_module.log("train/mfu", flops_per_token * tokens_per_sec / (self._peak * trainer.world_size))
