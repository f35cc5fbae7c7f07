"""What the settings check must know of a strategy before any process starts (torch-free, so that a typo is
answered in about a second): whether its batches are a pipeline schedule's microbatches, and whether a launcher
of its own (horovodrun) starts its processes. Kinds are registered by the `_target_` that conf/strategy names;
the strategies' classes say the same through project.parallel.contract once built (tests/test_configs.py holds
the two together). A strategy of your own that is neither runs as data parallelism and needs no entry.
"""

from __future__ import annotations

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
    #: It writes checkpoints to local folders only, not to object storage (ckpt_dir=s3://...).
    local_checkpoints: bool = False


DATA_PARALLEL = StrategyKind()

KINDS: dict[str, StrategyKind] = {
    "project.parallel.strategies.pipeline.LlamaPipelineStrategy": StrategyKind(pipeline=True, context_parallel=True),
    "project.parallel.strategies.horovod.horovod_strategy": StrategyKind(own_launcher=True),
    "project.parallel.strategies.single.single_device_strategy": StrategyKind(single_device=True),
    "project.parallel.strategies.model_parallel.LlamaParallelStrategy": StrategyKind(context_parallel=True),
    "project.parallel.strategies.fsdp.fsdp_strategy": StrategyKind(local_checkpoints=True),
}


def strategy_kind(strategy_cfg: Mapping[str, Any]) -> StrategyKind:
    """The kind of the strategy that `strategy_cfg` (a conf/strategy node) builds."""
    return KINDS.get(str(strategy_cfg.get("_target_", "")), DATA_PARALLEL)
