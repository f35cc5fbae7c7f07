"""Mesh arithmetic from the strategy config, and the degrees a model can take, before any process starts."""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

from project.model.config import LlamaConfig
from project.runtime.errors import ConfigError


class MeshShape(NamedTuple):
    """Degrees of the (pipeline, data, tensor) mesh. Ranks are laid out with tensor parallelism
    innermost (neighbouring ranks, inside a node) and pipeline stages outermost (across nodes first)."""

    pipeline_parallel: int
    data_parallel: int  # model replicas
    tensor_parallel: int


def mesh_shape(strategy_cfg: Mapping[str, Any], world_size: int, devices_per_node: int) -> MeshShape:
    """The degrees a strategy config asks for on `world_size` devices.

    `tensor_parallel_size: auto` takes what the other degrees leave, or a whole node;
    `pipeline_parallel_size: auto` takes what tensor (and a fixed data) parallelism leave;
    `data_parallel_size: auto` fills the rest. Strategies without a setting have degree 1 there
    (data parallelism: auto).
    """
    pp = strategy_cfg.get("pipeline_parallel_size", 1)
    dp = strategy_cfg.get("data_parallel_size", "auto")
    tp = strategy_cfg.get("tensor_parallel_size", 1)
    if tp == "auto":
        tp = world_size // (int(pp) * int(dp)) if "auto" not in (pp, dp) else devices_per_node
    if pp == "auto":
        pp = world_size // (int(tp) * (1 if dp == "auto" else int(dp))) or 1
    degrees = {"tensor_parallel_size": int(tp), "pipeline_parallel_size": int(pp)}
    for name, degree in degrees.items():
        if degree < 1 or world_size % degree:
            raise ConfigError(
                f"strategy.{name}={degree} does not divide the {world_size} devices: "
                "choose a divisor of trainer.devices x trainer.num_nodes."
            )
    if world_size % math.prod(degrees.values()):
        raise ConfigError(
            f"strategy.pipeline_parallel_size={pp} x tensor_parallel_size={tp} does not divide the {world_size} "
            "devices (trainer.devices x trainer.num_nodes): choose degrees whose product divides it."
        )
    replicas = world_size // math.prod(degrees.values())
    if dp != "auto" and int(dp) != replicas:
        parts = [f"data_parallel_size={dp}", f"tensor_parallel_size={tp}"]
        if "pipeline_parallel_size" in strategy_cfg:
            parts.insert(0, f"pipeline_parallel_size={pp}")
        named = " x ".join(parts)
        raise ConfigError(
            f"strategy.{named} must equal the {world_size} devices "
            "(trainer.devices x trainer.num_nodes); set data_parallel_size=auto to fill the mesh."
        )
    return MeshShape(int(pp), replicas, int(tp))


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
