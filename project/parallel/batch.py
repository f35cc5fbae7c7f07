"""Batch arithmetic: users fix the global batch; micro batch and accumulation follow from it."""

from __future__ import annotations

from dataclasses import dataclass

from project.runtime.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int  # sequences per optimizer step, all data-parallel replicas together
    micro_batch_size: int  # sequences per forward/backward
    data_parallel_size: int
    # A pipeline runs several micro batches in one training step (its schedule's microbatches)
    # instead of accumulating gradients over steps.
    pipeline_microbatches: int = 1

    @property
    def loader_batch_size(self) -> int:
        """Sequences per training step of one replica, as the data loader yields them."""
        return self.micro_batch_size * self.pipeline_microbatches

    @property
    def accumulate_grad_batches(self) -> int:
        return self.global_batch_size // (self.loader_batch_size * self.data_parallel_size)


def _per_replica(global_batch_size: int, data_parallel_size: int) -> int:
    if global_batch_size < 1 or data_parallel_size < 1:
        raise ConfigError(f"global_batch_size={global_batch_size} and the data-parallel size must be positive.")
    if global_batch_size % data_parallel_size:
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not divide over {data_parallel_size} data-parallel ranks: "
            f"set global_batch_size to a multiple of {data_parallel_size}, or change trainer.devices/num_nodes."
        )
    return global_batch_size // data_parallel_size


def plan_batches(global_batch_size: int, data_parallel_size: int, micro_batch_size: int | None = None) -> BatchPlan:
    """Split the global batch over data-parallel ranks and accumulation steps.

    The same global batch on 1 or N replicas then optimizes identically: only where the
    sequences are computed changes, not which ones make up a step.
    """
    per_replica = _per_replica(global_batch_size, data_parallel_size)
    micro = per_replica if micro_batch_size is None else micro_batch_size
    if micro < 1 or per_replica % micro:
        raise ConfigError(
            f"micro_batch_size={micro_batch_size} does not divide the {per_replica} sequences each of the "
            f"{data_parallel_size} data-parallel ranks gets per step (global_batch_size={global_batch_size}): "
            f"pick a divisor of {per_replica}, or micro_batch_size=null for no gradient accumulation."
        )
    return BatchPlan(global_batch_size, micro, data_parallel_size)


def plan_pipeline_batches(
    global_batch_size: int,
    data_parallel_size: int,
    micro_batch_size: int | None = None,
    n_microbatches: int | None = None,
) -> BatchPlan:
    """Each replica's share of the global batch is one training step, cut into `n_microbatches`
    microbatches of `micro_batch_size` sequences: give either (the other follows), or neither for
    microbatches of one sequence (torchtitan's default), the most the schedule can overlap."""
    per_replica = _per_replica(global_batch_size, data_parallel_size)
    if micro_batch_size is None:
        micro_batch_size = per_replica // n_microbatches if n_microbatches else 1
    if n_microbatches is None:
        n_microbatches = per_replica // micro_batch_size if micro_batch_size >= 1 else 0
    if micro_batch_size < 1 or n_microbatches < 1 or micro_batch_size * n_microbatches != per_replica:
        raise ConfigError(
            f"each of the {data_parallel_size} data-parallel replicas gets {per_replica} sequences per step "
            f"(global_batch_size={global_batch_size}), which the pipeline cuts into strategy.n_microbatches="
            f"{n_microbatches} microbatches of micro_batch_size={micro_batch_size}: choose values whose product is "
            f"{per_replica} (set just one of the two, to a divisor of {per_replica})."
        )
    return BatchPlan(global_batch_size, micro_batch_size, data_parallel_size, pipeline_microbatches=n_microbatches)
