"""Slow ranks named: each rank's mean time per transformer block forward pass (a pipeline's stages may hold unequal
numbers of blocks), gathered from every rank at logging steps; `train/step_time_max_over_min` is the slowest rank's
over the fastest's, and a rank slower than `stability.straggler_factor` times the median of the others (and by 1 ms
or more) in two logging windows in a row is named in a warning (its rank, host and time).

Why the blocks' forward: with collectives every rank's step takes the slowest rank's time (the others wait for it
inside them), so a step's wall time names no one. A block's forward runs no collective under data parallelism and
FSDP2 (whose gathers run in its hooks before the block's own), so its time is the rank's own; under tensor and
context parallelism blocks hold collectives, which make every rank wait for the slowest: there nothing is
judged (the strategy's `blocks_run_alone`). On a GPU the time is taken with CUDA events, read
only at logging steps; on a CPU it is the process's CPU time, so that ranks sharing too few cores (waiting for one
is not computing) are not taken for slow. The first logging window after a start, which holds the first step's
one-time work, is not judged. One slow window is not enough: a busy host's jitter (a page fault, a core shared
with another process) can triple a tiny model's block time once, where a slow device is slow in every window.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from project.parallel.contract import contract_of
from project.training.callbacks.steps import OptimizerSteps, logs_at

# Below this, a rank's excess over the median per block forward is jitter (a tiny model, a busy host), not a slow
# device.
MIN_EXCESS_SECONDS = 0.001
# Logging windows in a row in which a rank must be slow before it is named.
SLOW_WINDOWS = 2


class SlowRanks:
    """Which ranks to name, window after window: slower than `factor` times the median of the others, by
    MIN_EXCESS_SECONDS or more, in SLOW_WINDOWS logging windows in a row."""

    def __init__(self, factor: float):
        self.factor = factor
        self._in_a_row: dict[int, int] = {}

    def named(self, times: list[float]) -> list[tuple[int, float]]:
        """(rank, the median of the others' times) of each rank to name after this window's `times` (seconds)."""
        names = []
        for rank, seconds in enumerate(times):
            median = statistics.median(times[:rank] + times[rank + 1 :])  # the others': two ranks have one each
            slow = median > 0 and seconds > self.factor * median and seconds - median > MIN_EXCESS_SECONDS
            self._in_a_row[rank] = self._in_a_row.get(rank, 0) + 1 if slow else 0
            if self._in_a_row[rank] >= SLOW_WINDOWS:
                names.append((rank, median))
        return names


class StragglerWatch(Callback):
    def __init__(self, factor: float = 2.0):
        self.factor = factor
        self._steps = OptimizerSteps()
        self._hooks: list[Any] = []
        self._started: list[Any] = []  # a block's start: a perf_counter time, or a CUDA event
        self._spans: list[tuple[Any, Any]] = []  # (start, end) of each block forward since the last logging step
        self._seconds = 0.0  # their sum on the CPU, where it is read as it goes
        self._forwards = 0  # block forwards timed since the last logging step
        self._hosts: list[str] = []
        self._first_window = True
        self._judge = SlowRanks(factor)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps.start(trainer)
        self._first_window = True
        self._judge = SlowRanks(self.factor)
        if trainer.world_size <= 1 or not contract_of(trainer.strategy).blocks_run_alone():
            return
        cuda = pl_module.device.type == "cuda"
        for block in cast(Any, pl_module).model.layers.values():  # the rank's blocks (LlamaLitModule.model)
            self._hooks.append(block.register_forward_pre_hook(lambda *_: self._start(cuda)))
            self._hooks.append(block.register_forward_hook(lambda *_: self._end(cuda)))
        self._hosts = ["?"] * trainer.world_size  # another launcher's ranks (Horovod's): only this one's is known
        self._hosts[trainer.global_rank] = socket.gethostname()
        if dist.is_available() and dist.is_initialized():
            dist.all_gather_object(self._hosts, socket.gethostname())

    # Hooks of a compiled block (strategy.compile) run inside torch.compile's trace, which cannot trace a clock or an
    # event and says so in a warning each time: run eagerly, at the compiled block's edges.
    @torch.compiler.disable
    def _start(self, cuda: bool) -> None:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._started.append(event)
        else:
            self._started.append(time.process_time())

    @torch.compiler.disable
    def _end(self, cuda: bool) -> None:
        start = self._started.pop()
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._spans.append((start, event))
        else:
            self._seconds += time.process_time() - start
        self._forwards += 1

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._hooks or not self._steps.just_ended(trainer):
            return
        if not logs_at(trainer, trainer.global_step - 1):
            return
        if self._spans:  # the events of the window: the device is waited for at logging steps anyway
            torch.cuda.synchronize(pl_module.device)
            self._seconds += sum(start.elapsed_time(end) for start, end in self._spans) / 1e3
        # Every rank's time, in rank order: each adds its own in its place (a sum: any strategy's reduce does it).
        mine = torch.zeros(trainer.world_size, dtype=torch.float64, device=pl_module.device)
        mine[trainer.global_rank] = self._seconds / max(1, self._forwards)
        self._spans, self._seconds, self._forwards = [], 0.0, 0
        if self._first_window:
            self._first_window = False
            return
        times = contract_of(trainer.strategy).sum_over_ranks(mine).tolist()
        slowest, fastest = max(times), min(times)
        pl_module.log("train/step_time_max_over_min", slowest / fastest if fastest > 0 else 1.0)
        for rank, median in self._judge.named(times):
            rank_zero_warn(
                f"step {trainer.global_step - 1}: rank {rank} on {self._hosts[rank]} takes {times[rank] * 1e3:.2f} ms "
                f"per block forward, {times[rank] / median:.1f}x the median of the other "
                f"{len(times) - 1} rank(s) ({median * 1e3:.1f} ms; stability.straggler_factor={self.factor}): a "
                "straggler."
            )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
