"""Mesh arithmetic from the strategy config, and the degrees a model can take, before any process starts."""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

from project.model.config import LlamaConfig
from project.runtime.errors import ConfigError


class MeshShape(NamedTuple):
    """Degrees of the (pipeline, data, context, tensor) mesh. Ranks are laid out with tensor parallelism
    innermost (neighbouring ranks, inside a node), context parallelism next (inside a node where it fits, as
    Megatron-LM places it), then data, and pipeline stages outermost (across nodes first). Context parallelism
    comes last in the tuple only so that layouts written before it (three degrees) still read."""

    pipeline_parallel: int
    data_parallel: int  # model replicas, each reading its own sequences
    tensor_parallel: int
    context_parallel: int = 1  # ranks that split each sequence of one replica between them

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel * self.data_parallel * self.context_parallel * self.tensor_parallel


def mesh_shape(strategy_cfg: Mapping[str, Any], world_size: int, devices_per_node: int) -> MeshShape:
    """The degrees a strategy config asks for on `world_size` devices.

    `tensor_parallel_size: auto` takes what the other degrees leave, or a whole node;
    `pipeline_parallel_size: auto` takes what tensor (and a fixed data) parallelism leave;
    `data_parallel_size: auto` fills the rest. `context_parallel_size` is a number (default 1). Strategies
    without a setting have degree 1 there (data parallelism: auto).
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
    return MeshShape(int(pp), replicas, int(tp), cp)


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
    if sequence_parallel_seq_len is not None and sequence_parallel_seq_len % tp:
        raise ConfigError(
            f"data.seq_len={sequence_parallel_seq_len} is not divisible by strategy.tensor_parallel_size={tp}: "
            "sequence parallelism splits each sequence evenly across the tensor-parallel ranks. Choose a divisible "
            "data.seq_len or set strategy.sequence_parallel=false."
        )
    if config.tie_embeddings:
        raise ConfigError(
            "model.tie_embeddings=true is not supported with tensor parallelism yet: set model.tie_embeddings=false."
        )
