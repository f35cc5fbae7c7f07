"""Mesh arithmetic from the strategy config, before any process starts."""

from __future__ import annotations

from typing import Any, Mapping

from project.errors import ConfigError


def mesh_shape(strategy_cfg: Mapping[str, Any], world_size: int, devices_per_node: int) -> tuple[int, int]:
    """(data_parallel_size, tensor_parallel_size): model replicas, and the ranks that hold one together.

    `tensor_parallel_size: auto` takes what `data_parallel_size` leaves, or a whole node.
    """
    tp = strategy_cfg.get("tensor_parallel_size", 1)
    dp = strategy_cfg.get("data_parallel_size", "auto")
    if tp == "auto":
        tp = world_size // dp if dp != "auto" else devices_per_node
    if world_size % int(tp):
        raise ConfigError(
            f"strategy.tensor_parallel_size={tp} does not divide the {world_size} devices: "
            "choose a divisor of trainer.devices x trainer.num_nodes."
        )
    replicas = world_size // int(tp)
    if dp != "auto" and int(dp) != replicas:
        raise ConfigError(
            f"strategy.data_parallel_size={dp} x tensor_parallel_size={tp} must equal the {world_size} devices "
            "(trainer.devices x trainer.num_nodes); set data_parallel_size=auto to fill the mesh."
        )
    return replicas, int(tp)

