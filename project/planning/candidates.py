"""The layouts a model can take on a cluster, as the strategies in conf/strategy can build them.

A candidate is a strategy with its degrees (data x context x tensor x pipeline = the cluster's devices), a micro
batch, the pipeline schedule and its stage chunks, sequence parallelism and activation recompute. Each one
is checked by the same functions that check a training run's settings (project.parallel.mesh, .batch,
.pipeline_layout), so a candidate the planner lists is one `project.train` accepts.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

from project.config.layout import check_expert_parallel, check_family_layout
from project.model.config import LlamaConfig
from project.parallel.batch import plan_batches, plan_pipeline_batches
from project.parallel.mesh import MeshShape, check_expert_degree, check_tensor_parallel_degree
from project.parallel.pipeline_layout import SINGLE_STAGE, check_pipeline
from project.runtime.errors import ConfigError

# What each strategy shards across data-parallel ranks, in ZeRO's terms (Rajbhandari et al. 2020):
# 0 replicates everything, 2 shards gradients and optimizer state, 3 parameters too.
ZERO_LEVEL = {"ddp": 0, "fsdp": 2, "fsdp2": 3, "tp": 3, "tp_fsdp": 3, "pipeline": 3}
STRATEGIES = tuple(ZERO_LEVEL)
# The schedules whose memory and bubble the planner models (project.parallel.pipeline_layout has more).
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")
RECOMPUTE = ("none", "selective", "full")
# Strategies whose config has these settings (conf/strategy/*.yaml), and which the planner sets.
HAS_SEQUENCE_PARALLEL = {"tp", "tp_fsdp", "pipeline"}
HAS_CHECKPOINTING = {"fsdp", "fsdp2", "tp", "tp_fsdp", "pipeline"}
# Every strategy takes strategy.compile; the planner compiles these model-parallel ones (which gather in bfloat16).
HAS_COMPILE = {"fsdp", "fsdp2", "tp", "tp_fsdp", "pipeline"}
# Strategies that split sequences over strategy.context_parallel_size ranks (project.parallel.context_parallel).
HAS_CONTEXT_PARALLEL = {"fsdp2", "tp", "tp_fsdp", "pipeline"}
# Strategies that split a mixture's experts over strategy.expert_parallel_size ranks (project.parallel.expert_parallel).
HAS_EXPERT_PARALLEL = {"fsdp2", "tp_fsdp", "pipeline"}
# Strategies whose layouts the planner also tries under HSDP (strategy.data_parallel_shard_size): those whose FSDP2
# gathers and reduce-scatters every micro batch. A pipeline stage takes the setting too, but gathers once a step and
# reduce-scatters once (torch's PipelineStage), so HSDP saves it little, and would double the layouts to evaluate.
HAS_HSDP = {"fsdp2", "tp_fsdp"}


@dataclass(frozen=True)
class Candidate:
    strategy: str
    data_parallel: int
    tensor_parallel: int
    pipeline_parallel: int
    micro_batch_size: int
    microbatches: int  # per replica per optimizer step: accumulation steps, or the pipeline's microbatches
    recompute: str = "selective"
    sequence_parallel: bool = False
    schedule: str | None = None  # pipeline only
    virtual_stages: int = 1
    context_parallel: int = 1  # ranks that split each sequence
    regather_kv: bool = False  # context parallel: each block keeps its own keys and values only, gathered again
    float8: str | None = None  # strategy.float8: the blocks' linear layers in float8 (project.parallel.float8)
    expert_parallel: int = 1  # a mixture's experts split over groups of this many data x context ranks
    data_shard: int | None = None  # HSDP: the data x context ranks FSDP2 shards over (None: all of them)
    gradient_sync: str = "every_micro_batch"  # strategy.gradient_sync: when FSDP2 reduces accumulated gradients
    context_parallel_kv: str = "gather"  # strategy.context_parallel_kv: keys and values gathered, or passed in a ring
    reshard_after_forward: bool = True  # strategy.reshard_after_forward (fsdp2, tp_fsdp): False keeps them gathered

    @property
    def shape(self) -> MeshShape:
        pp, dp, tp, cp, ep = (
            self.pipeline_parallel,
            self.data_parallel,
            self.tensor_parallel,
            self.context_parallel,
            self.expert_parallel,
        )
        return MeshShape(pp, dp, tp, cp, ep, self.data_shard)

    @property
    def data_context_ranks(self) -> int:
        """The ranks of one stage's tensor-parallel rank that gradients are averaged over: data x context."""
        return self.data_parallel * self.context_parallel

    @property
    def shard_ranks(self) -> int:
        """The ranks FSDP shards the model states over: data x context (FSDP2 shards over both), or HSDP's groups."""
        return self.data_shard or self.data_context_ranks

    @property
    def expert_shard_ranks(self) -> int:
        """The ranks FSDP2 shards a mixture's experts over: those holding the same experts (project.parallel.fsdp2),
        HSDP or not."""
        return self.data_context_ranks // self.expert_parallel

    @property
    def zero_level(self) -> int:
        return ZERO_LEVEL[self.strategy]

    @property
    def name(self) -> str:
        """`fsdp2_dp8-tp1-pp1_mb2_selective`, `pipeline_dp4-tp8-pp2_mb1_1f1b-v1_sp_full`, `tp_dp1-tp8-pp1-cp2_..`."""
        degrees = f"dp{self.data_parallel}-tp{self.tensor_parallel}-pp{self.pipeline_parallel}"
        if self.context_parallel > 1:
            degrees += f"-cp{self.context_parallel}"
        if self.expert_parallel > 1:
            degrees += f"-ep{self.expert_parallel}"
        if self.data_shard:
            degrees += f"-shard{self.data_shard}"
        parts = [self.strategy, degrees, f"mb{self.micro_batch_size}"]
        if self.gradient_sync != "every_micro_batch":
            parts.append(f"sync-{self.gradient_sync}")
        if not self.reshard_after_forward and self.strategy in ("fsdp2", "tp_fsdp"):
            parts.append("kept-gathered")
        if self.schedule:
            parts.append(f"{self.schedule}-v{self.virtual_stages}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.regather_kv:
            parts.append("regather")
        if self.context_parallel_kv == "ring":
            parts.append("ring")
        if self.float8:
            parts.append(f"fp8{self.float8[:3]}")  # fp8ten, fp8row
        parts.append(self.recompute)
        return "_".join(parts)


@dataclass(frozen=True)
class SearchSpace:
    """What conf/plan.yaml's `search` lets the planner vary."""

    strategies: Sequence[str] = STRATEGIES
    recompute: Sequence[str] = ("selective", "full")
    sequence_parallel: Sequence[bool] = (True,)
    schedules: Sequence[str] = ("1f1b", "interleaved_1f1b")
    virtual_stages: Sequence[int] = (2, 4)
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8)
    max_tensor_parallel: int | None = None  # None: the devices of one node
    context_parallel: Sequence[int] = (1,)  # degrees tried for the strategies that have it
    expert_parallel: Sequence[int] | None = None  # a mixture's: None, every degree its experts and ranks take
    hsdp: Sequence[bool] = (False, True)  # True: FSDP2 shards within a node, where data x context spans several
    context_parallel_kv: Sequence[str] = ("gather", "ring")  # how keys and values reach a context group's ranks

    def check(self) -> None:
        for name, values, known in (
            ("strategies", self.strategies, STRATEGIES),
            ("recompute", self.recompute, RECOMPUTE),
            ("schedules", self.schedules, SCHEDULES),
        ):
            unknown = [v for v in values if v not in known]
            if unknown or not values:
                raise ConfigError(f"search.{name}={list(values)}: choose one or more of {list(known)}.")
        if (
            not self.micro_batch_sizes
            or min(self.micro_batch_sizes) < 1
            or not self.virtual_stages
            or min(self.virtual_stages) < 1
            or not self.context_parallel
            or min(self.context_parallel) < 1
            or self.expert_parallel is not None
            and (not self.expert_parallel or min(self.expert_parallel) < 1)
        ):
            raise ConfigError(
                "search.micro_batch_sizes, search.virtual_stages, search.context_parallel and search.expert_parallel "
                "must list positive integers (search.expert_parallel may be null: every degree)."
            )
        if not self.context_parallel_kv or any(v not in ("gather", "ring") for v in self.context_parallel_kv):
            raise ConfigError(
                f"search.context_parallel_kv={list(self.context_parallel_kv)}: list gather, ring or both (how a "
                "context group's ranks get each other's keys and values)."
            )
        if not self.hsdp or any(not isinstance(v, bool) for v in self.hsdp):
            raise ConfigError(
                f"search.hsdp={list(self.hsdp)}: list false (FSDP2 over all data x context ranks), true (sharded "
                "within a node, replicated across nodes: HSDP) or both."
            )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    config: LlamaConfig, devices: int, gpus_per_node: int, global_batch_size: int, seq_len: int, space: SearchSpace
) -> Iterator[Candidate]:
    """Every layout of `space` that the strategies can build for this model, batch and device count."""
    max_tp = space.max_tensor_parallel or gpus_per_node
    degrees = itertools.product(
        space.strategies, _divisors(devices), _divisors(devices), sorted(set(space.context_parallel))
    )
    for strategy, pp, tp, cp in degrees:
        if devices % (pp * tp * cp) or cp > 1 and (strategy not in HAS_CONTEXT_PARALLEL or seq_len % (2 * cp)):
            continue
        dp = devices // (pp * tp * cp)
        if strategy in ("ddp", "fsdp", "fsdp2") and (tp, pp) != (1, 1):
            continue
        if strategy == "tp" and (dp, pp) != (1, 1) or strategy == "tp_fsdp" and (tp == 1 or dp == 1 or pp != 1):
            continue  # tp_fsdp with one of them at 1 is the tp or fsdp2 layout, listed under that name
        if strategy == "pipeline" and pp == 1 or strategy == "tp" and tp == 1 or tp > max_tp:
            continue
        recomputes = space.recompute if strategy in HAS_CHECKPOINTING else [r for r in space.recompute if r != "full"]
        parallel_sequences = space.sequence_parallel if strategy in HAS_SEQUENCE_PARALLEL and tp > 1 else (False,)
        schedules = (
            [(s, v) for s in space.schedules for v in ((1,) if s in SINGLE_STAGE else space.virtual_stages)]
            if strategy == "pipeline"
            else [(None, 1)]
        )
        for micro, recompute, sp, (schedule, v) in itertools.product(
            sorted(set(space.micro_batch_sizes)), recomputes, sorted(set(parallel_sequences)), schedules
        ):
            candidate = _checked(
                config, strategy, dp, tp, pp, micro, recompute, sp, schedule, v, global_batch_size, seq_len, cp
            )
            if candidate is None:
                continue
            for ep in expert_parallel_degrees(config, candidate, space.expert_parallel):
                for sharding in shardings(candidate, gpus_per_node, space.hsdp):
                    # HSDP's replicas all-reduce once per step: as few bytes across nodes, no more memory.
                    sync = "replicas_at_last" if sharding and microbatches_accumulated(candidate) else None
                    with_experts = dataclasses.replace(
                        candidate, expert_parallel=ep, data_shard=sharding, gradient_sync=sync or "every_micro_batch"
                    )
                    if cp == 1 or "gather" in space.context_parallel_kv:
                        yield with_experts
                    if cp > 1 and recompute != "full" and "gather" in space.context_parallel_kv:
                        yield dataclasses.replace(with_experts, regather_kv=True)  # gathered again, not kept
                    if cp > 1 and "ring" in space.context_parallel_kv and not attends_in_chunks(config, seq_len):
                        yield dataclasses.replace(with_experts, context_parallel_kv="ring")


def attends_in_chunks(config: LlamaConfig, seq_len: int) -> bool:
    """Whether some block attends within chunks shorter than the sequence (Llama 4): a mask FlexAttention takes as a
    block mask on GPUs, which ring attention does not split (project.parallel.ring_attention)."""
    return any(config.attention_span(i, seq_len) < seq_len for i in range(config.n_layers))


def microbatches_accumulated(candidate: Candidate) -> bool:
    """Whether Lightning accumulates several micro batches per step (a pipeline runs its own in the step)."""
    return candidate.schedule is None and candidate.microbatches > 1


def shardings(candidate: Candidate, gpus_per_node: int, tried: Sequence[bool]) -> list[int | None]:
    """The HSDP shard sizes tried for a candidate: None (FSDP2 over all data x context ranks) where `tried` has False;
    where it has True, the data x context ranks of one node (a stage's ranks are data x context x tensor, tensor
    innermost), if they are fewer than all of them and FSDP2 shards there."""
    found: list[int | None] = [None] if False in tried else []
    per_node = gpus_per_node // candidate.tensor_parallel
    ranks = candidate.data_context_ranks
    if True in tried and candidate.strategy in HAS_HSDP and 1 < per_node < ranks and ranks % per_node == 0:
        found.append(per_node)
    return found or [None]


def expert_parallel_degrees(config: LlamaConfig, candidate: Candidate, tried: Sequence[int] | None = None) -> list[int]:
    """The expert-parallel degrees a candidate can take: 1, and for a mixture of experts under a strategy that splits
    experts, every degree (of `tried`, where given) the run's settings check accepts (dividing the data x context
    ranks and the experts)."""
    if candidate.strategy not in HAS_EXPERT_PARALLEL or all(config.mixture(i) is None for i in range(config.n_layers)):
        return [1]
    degrees = []
    for ep in _divisors(candidate.data_context_ranks) if tried is None else sorted(set(tried)):
        try:
            check_expert_degree(ep, candidate.data_context_ranks, candidate.pipeline_parallel)
            check_expert_parallel(config, ep)
        except ConfigError:
            continue
        degrees.append(ep)
    return degrees


def _checked(
    config, strategy, dp, tp, pp, micro, recompute, sp, schedule, v, global_batch_size, seq_len, cp=1
) -> Candidate | None:
    """The candidate if the training run's own checks accept it, else None."""
    try:
        check_family_layout(config, MeshShape(pp, dp, tp, cp), strategy == "pipeline")
        if tp > 1:
            check_tensor_parallel_degree(config, tp, seq_len // cp if sp else None)
        if schedule is None:
            plan = plan_batches(global_batch_size, dp, micro)
            microbatches = plan.accumulate_grad_batches
        else:
            plan = plan_pipeline_batches(global_batch_size, dp, micro)
            microbatches = plan.pipeline_microbatches
            check_pipeline(config, schedule, MeshShape(pp, dp, tp, cp), v, microbatches)
    except ConfigError:
        return None
    # The planner's fsdp is strategy=fsdp's SHARD_GRAD_OP (ZeRO-2): FSDP2 keeping each block's parameters gathered.
    kept = strategy == "fsdp"
    return Candidate(
        strategy, dp, tp, pp, micro, microbatches, recompute, sp, schedule, v, cp, reshard_after_forward=not kept
    )
