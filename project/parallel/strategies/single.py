"""One device, no distribution: Lightning's single-device strategy on the trainer's device, blocks compiled if asked."""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from project.parallel.compiled import CompiledBlocks
from project.parallel.contract import LlamaStrategy
from project.parallel.strategies.loading import WholeModelLoading
from project.parallel.strategies.saving import BackgroundSaving


def single_device_strategy(compile: bool = False) -> SingleDeviceStrategy:
    # On the trainer's device; the entry point refuses trainer.devices > 1 with it instead of letting
    # Lightning drop devices.
    return CompiledSingleDeviceStrategy() if compile else TrainerDeviceStrategy()


class TrainerDeviceStrategy(BackgroundSaving, WholeModelLoading, LlamaStrategy, SingleDeviceStrategy):
    """Lightning's single-device strategy on the device the trainer names (trainer.accelerator, trainer.devices).

    Given by name ("single_device"), Lightning builds SingleDeviceStrategy() on the CPU whatever the
    accelerator; its connector fills `parallel_devices` of a strategy that has the attribute, as here.
    Only the first is kept: the trainer then counts one device, and the entry point refuses trainer.devices=2.
    """

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self._devices: list[torch.device] = []

    @property
    def parallel_devices(self) -> list[torch.device]:
        return self._devices[:1]

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._devices = list(devices or [])

    @property
    def root_device(self) -> torch.device:
        return self._devices[0] if self._devices else super().root_device


class CompiledSingleDeviceStrategy(CompiledBlocks, TrainerDeviceStrategy):
    """One device, each block compiled (strategy.compile=true)."""
