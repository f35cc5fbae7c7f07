"""`strategy.compile=true` for the strategies that keep the whole model on every device (single, ddp).

The model-parallel strategies compile each block inside their `parallelize`; these get the same hook
from `CompiledBlocks`, so that one setting means the same thing under every strategy. Blocks are
compiled in place (`nn.Module.compile`): parameter names, and so checkpoints, stay the plain model's.
"""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from project.model import Llama
from project.parallel.init import materialize


def compile_blocks(model: Llama) -> None:
    for block in model.layers.values():
        block.compile()


class CompiledBlocks:
    """Mixin: a `parallelize` that compiles each transformer block before the strategy wraps the model."""

    def parallelize(self, model: Llama, initialize: bool = True) -> None:
        if any(p.is_meta for p in model.parameters()):  # a strategy with this hook gets its model built on meta
            materialize(model, self.root_device, initialize)
        compile_blocks(model)


class TrainerDeviceStrategy(SingleDeviceStrategy):
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
