"""One device, no distribution."""

from __future__ import annotations


def single_device_strategy() -> str:
    # Lightning's "auto" resolves to SingleDeviceStrategy when trainer.devices is 1.
    return "auto"
