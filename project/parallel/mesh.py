"""Mesh arithmetic from the strategy config, and the degrees a model can take, before any process starts."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

from project.model.config import LlamaConfig
from project.runtime.errors import ConfigError

# When FSDP2 reduces the gradients of a step's micro batches (strategy.gradient_sync): after each (sharded gradients);
# within HSDP's shard groups after each and across them after the last only (as sharded, fewer bytes across nodes);
# or after the last only (each rank keeps its unsharded gradients through the step: memory for bytes).
GRADIENT_SYNCS = ("every_micro_batch", "replicas_at_last", "at_last")

# The dense model's dimensions, outermost first: tensor parallelism innermost (neighbouring ranks, inside a node),
# context parallelism next (inside a node where it fits, as Megatron-LM places it), then data, and pipeline stages
# outermost (across nodes first).
DENSE = ("pipeline", "data", "context", "tensor")
# The dimensions that regroup data x context (the ranks of one stage's tensor-parallel rank): FSDP2 shards a dense
# weight over all of them ("data_parallel"); expert parallelism splits them into groups of `expert` neighbours that
# split a mixture's experts, and `expert_data`, the ranks holding the same experts; HSDP splits them into groups of
# `data_shard` neighbours that shard the model between them, and `data_replicate`, the groups holding the same shards.
REGROUPED = ("data_parallel", "expert_data", "expert", "data_replicate", "data_shard")


class Dimension(NamedTuple):
    """A named dimension of the ranks: its degree, and how far apart (in global ranks) its neighbours are."""

    size: int
    stride: int


@dataclass(frozen=True)
class MeshShape:
    """The run's ranks as one mesh of named dimensions (`dimensions`): the four of the dense model (DENSE) and those
    that regroup data x context (REGROUPED). Global rank r sits at coordinate r // stride % size on each. Every
    process mesh of a run (a strategy's, its context and expert groups', the dry run's) is a view of this one
    (`sizes`), and the planner and the dry run read coordinates and groups from it: the same ranks everywhere.

    The degrees keep their historical order (pipeline, data, tensor, context) so that layouts written with three
    or four degrees still read."""

    pipeline_parallel: int
    data_parallel: int  # model replicas, each reading its own sequences
    tensor_parallel: int
    context_parallel: int = 1  # ranks that split each sequence of one replica between them
    expert_parallel: int = 1  # data x context ranks that split each mixture's experts between them
    data_shard: int | None = None  # data x context ranks FSDP2 shards each weight over (HSDP); None: all of them

    def __post_init__(self) -> None:
        if (self.data_parallel * self.context_parallel) % self.expert_parallel:
            raise ValueError(f"expert_parallel={self.expert_parallel} does not divide data x context ({self})")
        if (self.data_parallel * self.context_parallel) % self.shard_ranks:
            raise ValueError(f"data_shard={self.data_shard} does not divide data x context ({self})")

    @property
    def shard_ranks(self) -> int:
        """The data x context ranks FSDP2 shards each weight over: all of them, or HSDP's groups."""
        return self.data_shard or self.data_parallel * self.context_parallel

    @property
    def hybrid(self) -> bool:
        """Whether FSDP2 shards within groups and replicates across them (HSDP)."""
        return self.shard_ranks < self.data_parallel * self.context_parallel

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel * self.data_parallel * self.context_parallel * self.tensor_parallel

    @cached_property
    def dimensions(self) -> dict[str, Dimension]:
        """Every named dimension (DENSE, then REGROUPED), each outermost first."""
        pp, dp, cp, tp = self.pipeline_parallel, self.data_parallel, self.context_parallel, self.tensor_parallel
        ep = self.expert_parallel
        dense = [Dimension(pp, dp * cp * tp), Dimension(dp, cp * tp), Dimension(cp, tp), Dimension(tp, 1)]
        shard = self.shard_ranks
        regrouped = [Dimension(dp * cp, tp), Dimension(dp * cp // ep, ep * tp), Dimension(ep, tp)]
        regrouped += [Dimension(dp * cp // shard, shard * tp), Dimension(shard, tp)]
        return dict(zip(DENSE + REGROUPED, dense + regrouped, strict=True))

    def describe(self) -> str:
        """`pipeline 2 x data 4 x context 2 x tensor 8`, and the experts' regrouping where there is one."""
        dims = self.dimensions
        said = " x ".join(f"{name} {dims[name].size}" for name in DENSE if name != "context" or dims[name].size > 1)
        if self.hybrid:
            said += f" (HSDP: data_replicate {dims['data_replicate'].size} x data_shard {self.shard_ranks})"
        if self.expert_parallel > 1:
            said += f" (experts: expert_data {dims['expert_data'].size} x expert {self.expert_parallel})"
        return said

    def coordinate(self, rank: int, name: str) -> int:
        """Global rank `rank`'s coordinate on dimension `name`."""
        size, stride = self.dimensions[name]
        return rank // stride % size

    def rank_at(self, **coordinates: int) -> int:
        """The global rank at these coordinates (dimensions of one view: sizes), 0 on every other dimension."""
        return sum(value * self.dimensions[name].stride for name, value in coordinates.items())

    def group(self, rank: int, names: Iterable[str]) -> list[int]:
        """The global ranks of `rank`'s group along the dimensions `names` (those whose other coordinates are
        `rank`'s), in the mesh's order."""
        members = [rank]
        for name in names:
            size, stride = self.dimensions[name]
            base = [r - self.coordinate(r, name) * stride for r in members]
            members = [b + i * stride for b in base for i in range(size)]
        return sorted(set(members))

    def sizes(self, names: Iterable[str]) -> tuple[int, ...]:
        """The sizes of a process mesh whose dimensions are `names` (outermost first): they must cover every rank,
        each dimension's neighbours one whole step of the next inner one apart, as torch's init_device_mesh lays a
        mesh over the ranks in order."""
        names = tuple(names)
        dims = [self.dimensions[n] for n in names]
        stride = 1
        for name, dim in reversed(list(zip(names, dims))):
            if dim.stride != stride and dim.size > 1:
                raise ValueError(f"the mesh dimensions {names} of {self} do not tile its ranks in order at {name!r}")
            stride *= dim.size
        if stride != self.world_size:
            raise ValueError(f"the mesh dimensions {names} of {self} hold {stride} of its {self.world_size} ranks")
        return tuple(dim.size for dim in dims)


def mesh_shape(strategy_cfg: Mapping[str, Any], world_size: int, devices_per_node: int) -> MeshShape:
    """The degrees a strategy config asks for on `world_size` devices.

    `tensor_parallel_size: auto` takes what the other degrees leave, or a whole node;
    `pipeline_parallel_size: auto` takes what tensor (and a fixed data) parallelism leave;
    `data_parallel_size: auto` fills the rest. `context_parallel_size` and `expert_parallel_size` are numbers
    (default 1); `data_parallel_shard_size` a number, `node` (the data x context ranks of a node) or null (FSDP2
    shards over every data x context rank).
    Strategies without a setting have degree 1 there (data parallelism: auto).
    """
    pp = strategy_cfg.get("pipeline_parallel_size", 1)
    dp = strategy_cfg.get("data_parallel_size", "auto")
    tp = strategy_cfg.get("tensor_parallel_size", 1)
    cp = strategy_cfg.get("context_parallel_size", 1)
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ConfigError(
            f"strategy.context_parallel_size={cp}: give the number of ranks that split each sequence (1: none)."
        )
    if tp == "auto":
        tp = world_size // (int(pp) * int(dp) * cp) if "auto" not in (pp, dp) else devices_per_node
    if pp == "auto":
        pp = world_size // (int(tp) * cp * (1 if dp == "auto" else int(dp))) or 1
    degrees = {"tensor_parallel_size": int(tp), "pipeline_parallel_size": int(pp), "context_parallel_size": cp}
    for name, degree in degrees.items():
        if degree < 1 or world_size % degree:
            raise ConfigError(
                f"strategy.{name}={degree} does not divide the {world_size} devices: "
                "choose a divisor of trainer.devices x trainer.num_nodes."
            )
    if world_size % math.prod(degrees.values()):
        named = f"pipeline_parallel_size={pp} x tensor_parallel_size={tp}"
        if cp > 1:
            named = f"pipeline_parallel_size={pp} x context_parallel_size={cp} x tensor_parallel_size={tp}"
        raise ConfigError(
            f"strategy.{named} does not divide the {world_size} devices (trainer.devices x trainer.num_nodes): "
            "choose degrees whose product divides it."
        )
    replicas = world_size // math.prod(degrees.values())
    if dp != "auto" and int(dp) != replicas:
        parts = [f"data_parallel_size={dp}", f"tensor_parallel_size={tp}"]
        if cp > 1:
            parts.insert(1, f"context_parallel_size={cp}")
        if "pipeline_parallel_size" in strategy_cfg:
            parts.insert(0, f"pipeline_parallel_size={pp}")
        named = " x ".join(parts)
        raise ConfigError(
            f"strategy.{named} must equal the {world_size} devices "
            "(trainer.devices x trainer.num_nodes); set data_parallel_size=auto to fill the mesh."
        )
    ep = strategy_cfg.get("expert_parallel_size", 1)
    check_expert_degree(ep, replicas * cp, int(pp))
    shard = strategy_cfg.get("data_parallel_shard_size")
    if shard == "node":  # the data x context ranks of one node
        shard = max(1, devices_per_node // int(tp))
    setting = f"strategy.{strategy_cfg.get('shard_size_setting', 'data_parallel_shard_size')}"
    check_shard_degree(shard, replicas * cp, devices_per_node // int(tp), setting)
    shard = None if shard == replicas * cp else shard  # every data x context rank: FSDP2's own sharding
    check_gradient_sync(strategy_cfg.get("gradient_sync", GRADIENT_SYNCS[0]), shard is not None)
    return MeshShape(int(pp), replicas, int(tp), context_parallel=cp, expert_parallel=ep, data_shard=shard)


def check_gradient_sync(sync: Any, hybrid: bool) -> None:
    """Refuse a gradient sync across replicas where there are none (project.config.values checks the choice)."""
    if sync == "replicas_at_last" and not hybrid:
        raise ConfigError(
            "strategy.gradient_sync=replicas_at_last defers the all-reduce across HSDP's replicas, and this run has "
            "none: set strategy.data_parallel_shard_size to the ranks of a node (HSDP), or choose at_last (every "
            "reduction after the last micro batch) or every_micro_batch."
        )


def check_shard_degree(
    shard: Any, ranks: int, per_node: int, setting: str = "strategy.data_parallel_shard_size"
) -> None:
    """Refuse an HSDP shard group that is no whole number of a stage's `ranks` data x context ranks (`per_node`
    of them in one node); `setting`: the name the user gave it."""
    if shard is None:
        return
    if not isinstance(shard, int) or isinstance(shard, bool) or shard < 1 or ranks % shard:
        node = f" ({per_node} of them share a node)" if 1 < per_node < ranks else ""
        raise ConfigError(
            f"{setting}={shard} does not divide the {ranks} data x context ranks{node}: "
            "FSDP2 shards each weight within groups of that many neighbouring ranks and replicates across the groups "
            f"(HSDP). Choose a divisor of {ranks}, such as the ranks of one node, or null to shard over all of them."
        )


def check_expert_degree(ep: Any, shards: int, pp: int) -> None:
    """Refuse an expert-parallel degree that is no whole number of the `shards` data x context ranks."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ConfigError(
            f"strategy.expert_parallel_size={ep}: give the number of data-parallel ranks that split each mixture's "
            "experts between them (1: every rank holds every expert)."
        )
    if shards % ep:
        # A pipeline's expert groups are made of each stage's data-parallel ranks (data x context).
        stage = " of each pipeline stage" if pp > 1 else ""
        raise ConfigError(
            f"strategy.expert_parallel_size={ep} does not divide the {shards} data-parallel ranks{stage}: an "
            f"expert group is made of data-parallel ranks. Choose a divisor of {shards}, or more devices."
        )


# Ring attention's query and key positions per block of scores (project.parallel.ring_attention; the planner counts
# its blocks with it): kept here, free of torch, for the planner's checks that run before torch is imported.
RING_TILE = 1024


def check_context_parallel_kv(kv: str, regather: bool, block_masks: list[str] | None = None) -> None:
    """Refuse regathering keys and values that a ring never gathers, and a ring on GPUs where the settings in
    `block_masks` make FlexAttention's block masks (which the ring does not split)."""
    if kv == "ring" and block_masks:
        raise ConfigError(
            "strategy.context_parallel_kv=ring does not split FlexAttention's block masks, and on GPUs the attention "
            f"takes them for {' and '.join(block_masks)}: set strategy.context_parallel_kv=gather."
        )
    if kv == "ring" and regather:
        raise ConfigError(
            "strategy.regather_kv=true gathers the keys and values again in the backward, and "
            "strategy.context_parallel_kv=ring never gathers them (each rank holds its own part already): choose one."
        )


def check_context_parallel_degree(cp: int, seq_len: int, strategy: str, supported: bool) -> None:
    """Refuse, before any process starts, context parallelism on a strategy without it or a sequence that does
    not cut into 2 x cp equal chunks (each rank keeps two: project.parallel.context_parallel)."""
    if cp == 1:
        return
    if not supported:
        raise ConfigError(
            f"strategy.context_parallel_size={cp}: strategy={strategy} does not split sequences. Use strategy=fsdp2 "
            "(or tp_fsdp, tp, pipeline) with strategy.context_parallel_size, or remove the setting."
        )
    if seq_len % (2 * cp):
        raise ConfigError(
            f"data.seq_len={seq_len} does not cut into 2 x strategy.context_parallel_size={cp} = {2 * cp} equal "
            f"chunks (each context-parallel rank keeps two, one early and one late in the sequence): choose a "
            f"data.seq_len divisible by {2 * cp}, or another context_parallel_size."
        )


def check_tensor_parallel_degree(config: LlamaConfig, tp: int, sequence_parallel_seq_len: int | None = None) -> None:
    """Refuse, before any process starts, a degree that cannot split the model (or the sequence) evenly."""
    sizes = [
        ("n_heads", config.n_heads),
        ("n_kv_heads", config.kv_heads),
        ("ffn hidden size", config.ffn_hidden_dim),
        ("vocab_size", config.vocab_size),
    ]
    for name, value in sizes:
        if value % tp:
            raise ConfigError(
                f"model {name}={value} is not divisible by strategy.tensor_parallel_size={tp}: each tensor-parallel "
                "rank holds an equal slice of it. Choose a tensor-parallel size that divides it."
            )
    # A mixture's experts (and shared expert): each one's hidden units split as a dense feed-forward's.
    for width in sorted({m.width for i in range(config.n_layers) if (m := config.mixture(i)) is not None}):
        if width % tp:
            raise ConfigError(
                f"model expert_ffn_dim={width} is not divisible by strategy.tensor_parallel_size={tp}: each "
                "tensor-parallel rank holds an equal slice of every expert's hidden units. Choose a tensor-parallel "
                "size that divides it, or another model.expert_ffn_dim."
            )
    if sequence_parallel_seq_len is not None and sequence_parallel_seq_len % tp:
        raise ConfigError(
            f"data.seq_len={sequence_parallel_seq_len} is not divisible by strategy.tensor_parallel_size={tp}: "
            "sequence parallelism splits each sequence evenly across the tensor-parallel ranks. Choose a divisible "
            "data.seq_len or set strategy.sequence_parallel=false."
        )
