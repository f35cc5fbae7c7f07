"""Tokens per second, tokens seen and model FLOPs utilization, logged once per optimizer step."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from project.model import training_flops_per_token

_PRECISION_DTYPE = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}


class TokenThroughput(Callback):
    """Logs train/tokens_per_sec, train/tokens_seen and train/mfu.

    MFU = model FLOPs per token (6N + attention, see project.model.flops) x tokens/s over the peak
    FLOP/s of all devices. The peak comes from Lightning's table for known GPUs; on a CPU or an
    unlisted device pass `peak_flops_per_device`, else MFU is not logged.
    """

    def __init__(self, peak_flops_per_device: float | None = None):
        self.peak_flops_per_device = peak_flops_per_device

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step, self._last_time = trainer.global_step, time.perf_counter()
        self._peak = self.peak_flops_per_device
        if self._peak is None:
            dtype = _PRECISION_DTYPE.get(str(trainer.precision).split("-")[0], torch.float32)
            self._peak = get_available_flops(pl_module.device, dtype)
        if self._peak is None:
            rank_zero_info("train/mfu is not logged: peak FLOP/s of this device unknown (set callbacks.throughput.peak_flops_per_device).")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # inside a gradient-accumulation window
            return
        now = time.perf_counter()
        micro_batch, seq_len = batch[0].shape
        global_batch = trainer.datamodule.hparams.global_batch_size
        tokens_per_step = global_batch * seq_len
        tokens_per_sec = (trainer.global_step - self._last_step) * tokens_per_step / (now - self._last_time)
        self._last_step, self._last_time = trainer.global_step, now
        pl_module.log("train/tokens_per_sec", tokens_per_sec, prog_bar=True)
        pl_module.log("train/tokens_seen", float(trainer.global_step * tokens_per_step))
        if self._peak:
            flops_per_token = training_flops_per_token(pl_module.model.config, seq_len)
            pl_module.log("train/mfu", flops_per_token * tokens_per_sec / (self._peak * trainer.world_size))
