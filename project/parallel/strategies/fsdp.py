"""strategy=fsdp: Lightning's FSDPStrategy settings, run on FSDP2.

A user of Lightning's `strategy=fsdp` keeps the names they know (`sharding_strategy`, `hybrid_shard_size`,
`cpu_offload`, `state_dict_type`); each is what FSDP2 does for it (project.parallel.kinds.SHARDING_STRATEGIES), so
the run is strategy=fsdp2's with those settings: one sharding code, one checkpoint format, float8, experts and the
planner's counts alike. Checkpoints FSDP1 wrote (a folder keyed `model`) are still read (project.checkpoint.reshard).
"""

from __future__ import annotations

from typing import Literal

from project.parallel.kinds import SHARDING_STRATEGIES, fsdp_names_as_fsdp2
from project.parallel.strategies.model_parallel import LlamaParallelStrategy
from project.runtime.errors import ConfigError


def fsdp_strategy(
    sharding_strategy: str = "FULL_SHARD",
    hybrid_shard_size: int | None = None,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    state_dict_type: Literal["full", "sharded"] = "sharded",
    process_group_backend: str | None = None,
    collective_timeout_minutes: float = 10,
    startup_timeout_minutes: float = 30,
    compile: bool = False,
) -> LlamaParallelStrategy:
    """FULL_SHARD shards every block over all ranks (FSDP2's default); SHARD_GRAD_OP keeps each block's gathered
    parameters from its forward to its backward; HYBRID_SHARD shards within groups of `hybrid_shard_size` ranks
    (null: a node's) and replicates across them (HSDP); NO_SHARD keeps a whole copy on every rank."""
    if sharding_strategy not in SHARDING_STRATEGIES:
        raise ConfigError(
            f"strategy.sharding_strategy={sharding_strategy!r}: choose one of {list(SHARDING_STRATEGIES)}."
        )
    settings = fsdp_names_as_fsdp2({"sharding_strategy": sharding_strategy, "hybrid_shard_size": hybrid_shard_size})
    settings.pop("shard_size_setting", None)  # for the settings check's errors (project.config.layout)
    return LlamaParallelStrategy(
        data_parallel_size="auto",
        tensor_parallel_size=1,
        activation_checkpointing=activation_checkpointing,
        compile=compile,
        cpu_offload=cpu_offload,
        state_dict_type=state_dict_type,
        process_group_backend=process_group_backend,
        collective_timeout_minutes=collective_timeout_minutes,
        startup_timeout_minutes=startup_timeout_minutes,
        **settings,
    )
