"""One device, no distribution: Lightning's single-device strategy on the trainer's device, with float8 layers and
compiled blocks if asked."""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from project.parallel.contract import LlamaStrategy
from project.parallel.strategies.loading import WholeModelLoading
from project.parallel.strategies.saving import BackgroundSaving
from project.parallel.whole_model import WholeModelTransforms


def single_device_strategy(compile: bool = False, float8: str | None = None) -> SingleDeviceStrategy:
    # On the trainer's device; the entry point refuses trainer.devices > 1 with it instead of letting
    # Lightning drop devices.
    if compile or float8:
        return TransformedSingleDeviceStrategy(compile=compile, float8=float8)
    return TrainerDeviceStrategy()


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


class TransformedSingleDeviceStrategy(WholeModelTransforms, TrainerDeviceStrategy):
    """One device, the blocks in float8 (strategy.float8) or compiled (strategy.compile=true)."""
