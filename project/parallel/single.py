"""One device, no distribution."""

from __future__ import annotations

from lightning.pytorch.strategies import SingleDeviceStrategy


def single_device_strategy(compile: bool = False) -> SingleDeviceStrategy:
    # On the trainer's device; the entry point refuses trainer.devices > 1 with it instead of letting
    # Lightning drop devices.
    from project.parallel.compiled import CompiledSingleDeviceStrategy, TrainerDeviceStrategy

    return CompiledSingleDeviceStrategy() if compile else TrainerDeviceStrategy()
