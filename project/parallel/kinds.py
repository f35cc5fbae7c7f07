"""What the settings check must know of a strategy before any process starts (torch-free, so that a typo is
answered in about a second): whether its batches are a pipeline schedule's microbatches, and whether a launcher
of its own (horovodrun) starts its processes. Kinds are registered by the `_target_` that conf/strategy names;
the strategies' classes say the same through project.parallel.contract once built (tests/test_configs.py holds
the two together). A strategy of your own that is neither runs as data parallelism and needs no entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class StrategyKind:
    #: Its stages run a schedule of microbatches: the batch plan and the schedule are checked as a pipeline's.
    pipeline: bool = False
    #: horovodrun starts its processes, not Lightning: their number comes from Horovod, not trainer.devices.
    own_launcher: bool = False
    #: It can split each sequence over strategy.context_parallel_size ranks (project.parallel.context_parallel).
    context_parallel: bool = False
    #: It runs one process on one device, whatever trainer.devices asks.
    single_device: bool = False
    #: Its settings as the FSDP2 strategy's (project.parallel.strategies.model_parallel), where it names them
    #: otherwise: the mesh is read from those.
    as_fsdp2: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None


# strategy=fsdp's settings, Lightning's FSDPStrategy names, and what each is on FSDP2 (strategy=fsdp2's names).
SHARDING_STRATEGIES: dict[str, dict[str, Any]] = {
    "FULL_SHARD": {},  # each block gathered for its forward, again for its backward (ZeRO-3)
    "SHARD_GRAD_OP": {"reshard_after_forward": False},  # kept gathered from forward to backward (ZeRO-2)
    "HYBRID_SHARD": {"data_parallel_shard_size": "node"},  # sharded within a node, replicated across (HSDP)
    "NO_SHARD": {"data_parallel_shard_size": 1},  # a whole copy on every rank, gradients all-reduced (DDP's)
}


def fsdp_names_as_fsdp2(strategy_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """strategy=fsdp's settings as strategy=fsdp2's: its sharding_strategy and hybrid_shard_size (the ranks of a
    HYBRID_SHARD group; null: a node's) become data_parallel_shard_size and reshard_after_forward."""
    settings = {k: v for k, v in strategy_cfg.items() if k not in ("sharding_strategy", "hybrid_shard_size")}
    mapped = dict(SHARDING_STRATEGIES.get(str(strategy_cfg.get("sharding_strategy", "FULL_SHARD")), {}))
    if "data_parallel_shard_size" in mapped and mapped["data_parallel_shard_size"] == "node":
        mapped["data_parallel_shard_size"] = strategy_cfg.get("hybrid_shard_size") or "node"
        mapped["shard_size_setting"] = "hybrid_shard_size"  # what an error about the groups names
    return {**settings, **mapped}


DATA_PARALLEL = StrategyKind()

KINDS: dict[str, StrategyKind] = {
    "project.parallel.strategies.pipeline.LlamaPipelineStrategy": StrategyKind(pipeline=True, context_parallel=True),
    "project.parallel.strategies.horovod.horovod_strategy": StrategyKind(own_launcher=True),
    "project.parallel.strategies.single.single_device_strategy": StrategyKind(single_device=True),
    "project.parallel.strategies.model_parallel.LlamaParallelStrategy": StrategyKind(context_parallel=True),
    "project.parallel.strategies.fsdp.fsdp_strategy": StrategyKind(as_fsdp2=fsdp_names_as_fsdp2),
}


def strategy_kind(strategy_cfg: Mapping[str, Any]) -> StrategyKind:
    """The kind of the strategy that `strategy_cfg` (a conf/strategy node) builds."""
    return KINDS.get(str(strategy_cfg.get("_target_", "")), DATA_PARALLEL)


def mesh_settings(strategy_cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The settings the mesh is read from: a strategy's own, or their FSDP2 names where it names them otherwise."""
    translate = strategy_kind(strategy_cfg).as_fsdp2
    return translate(strategy_cfg) if translate else strategy_cfg
