"""Batch arithmetic: users fix the global batch; micro batch and accumulation follow from it."""

from __future__ import annotations

from dataclasses import dataclass

from project.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int  # sequences per optimizer step, all data-parallel ranks together
    micro_batch_size: int  # sequences per rank per forward/backward
    data_parallel_size: int

    @property
    def accumulate_grad_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


def plan_batches(global_batch_size: int, data_parallel_size: int, micro_batch_size: int | None = None) -> BatchPlan:
    """Split the global batch over data-parallel ranks and accumulation steps.

    The same global batch on 1 or N replicas then optimizes identically: only where the
    sequences are computed changes, not which ones make up a step.
    """
    if global_batch_size < 1 or data_parallel_size < 1:
        raise ConfigError(f"global_batch_size={global_batch_size} and the data-parallel size must be positive.")
    if global_batch_size % data_parallel_size:
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not divide over {data_parallel_size} data-parallel ranks: "
            f"set global_batch_size to a multiple of {data_parallel_size}, or change trainer.devices/num_nodes."
        )
    per_replica = global_batch_size // data_parallel_size
    micro = per_replica if micro_batch_size is None else micro_batch_size
    if micro < 1 or per_replica % micro:
        raise ConfigError(
            f"micro_batch_size={micro_batch_size} does not divide the {per_replica} sequences each of the "
            f"{data_parallel_size} data-parallel ranks gets per step (global_batch_size={global_batch_size}): "
            f"pick a divisor of {per_replica}, or micro_batch_size=null for no gradient accumulation."
        )
    return BatchPlan(global_batch_size, micro, data_parallel_size)
