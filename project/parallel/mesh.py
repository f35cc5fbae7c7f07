"""Where a rank sits among the data-parallel replicas."""

from __future__ import annotations

from typing import Any, Mapping


def model_parallel_size(strategy_cfg: Mapping[str, Any]) -> int:
    """Ranks that together hold one model replica (tensor x pipeline); 1 for pure data parallelism."""
    return int(strategy_cfg.get("tensor_parallel_size", 1) or 1) * int(strategy_cfg.get("pipeline_parallel_size", 1) or 1)


def data_parallel_coords(trainer: Any) -> tuple[int, int]:
    """(rank, size) along the data-parallel dimension.

    Strategies with a device mesh (ModelParallelStrategy) name a `data_parallel` dimension; ranks
    that share a coordinate on it hold one replica and must read the same batch. Without a mesh
    every rank is its own replica.
    """
    mesh = getattr(trainer.strategy, "device_mesh", None)
    if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
        dp = mesh["data_parallel"]
        return dp.get_local_rank(), dp.size()
    return trainer.global_rank, trainer.world_size
