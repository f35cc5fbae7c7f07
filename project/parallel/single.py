"""One device, no distribution."""

from __future__ import annotations

from lightning.pytorch.strategies import Strategy


def single_device_strategy(compile: bool = False) -> str | Strategy:
    # Lightning resolves "single_device" to SingleDeviceStrategy on the trainer's accelerator; the
    # entry point refuses trainer.devices > 1 with it instead of letting Lightning drop devices.
    if not compile:
        return "single_device"
    from project.parallel.compiled import CompiledSingleDeviceStrategy

    return CompiledSingleDeviceStrategy()
