"""strategy.float8 checked before the imports: torchao is there, the model has layers float8 can take as each rank
holds them, and each rank's micro batch has tokens float8's products can take."""

from __future__ import annotations

from omegaconf import DictConfig

from project.config.values import model_config
from project.model.config import LlamaConfig
from project.parallel.float8_rules import (
    FLOAT8_GPUS,
    FLOAT8_MULTIPLE,
    INSTALL_HINT,
    has_float8_products,
    in_float8,
    torchao_installed,
    widths_not_taken,
)
from project.parallel.mesh import MeshShape
from project.runtime.errors import ConfigError


def check_float8(cfg: DictConfig, shape: MeshShape | None = None, dry_run: bool = False) -> None:
    """`shape`: the run's mesh where the device count is known (its tensor- and context-parallel degrees);
    `dry_run`: the job is checked against the cluster preset it names (cluster=), not this machine."""
    recipe = cfg.strategy.get("float8")
    if recipe is None:
        return
    if not torchao_installed():
        raise ConfigError(
            f"strategy.float8={recipe} needs torchao, which this environment lacks: {INSTALL_HINT}; or set "
            "strategy.float8=null."
        )
    if dry_run:
        check_cluster_has_float8(cfg, recipe)
    model = model_config(cfg)
    tp, cp = (shape.tensor_parallel, shape.context_parallel) if shape else (1, 1)
    if not in_float8(model, tp):
        split = f", split over {tp} tensor-parallel ranks" if tp > 1 else ""
        raise ConfigError(
            f"strategy.float8={recipe}: no linear layer of the blocks has sides that are multiples of "
            f"{FLOAT8_MULTIPLE}{split}: {_widths_not_taken_said(model, tp)}, or set strategy.float8=null."
        )
    tokens = cfg.data.seq_len // cp  # of each sequence, on a rank
    if tokens % FLOAT8_MULTIPLE:
        where = f" / strategy.context_parallel_size={cp}" if cp > 1 else ""
        raise ConfigError(
            f"strategy.float8={recipe}: data.seq_len={cfg.data.seq_len}{where} gives each rank {tokens} tokens of a "
            f"sequence, not a multiple of {FLOAT8_MULTIPLE}: a weight's gradient multiplies over the tokens, and "
            f"float8 products take multiples of {FLOAT8_MULTIPLE}. Choose data.seq_len accordingly, or "
            "strategy.float8=null."
        )


def _widths_not_taken_said(model: LlamaConfig, tp: int) -> str:
    """`model.dim=72 and the key/value heads' width 36 (2 heads of 18) are not, so ...: choose model.dim and
    model.n_kv_heads so that these widths are multiples of 16`: the failing widths only, and what sets each."""
    failing = widths_not_taken(model, tp)
    on_a_rank = " on a rank" if tp > 1 else ""
    said = {
        "model": (f"model.dim={model.dim}", "model.dim"),
        "query": (f"the query heads' width{on_a_rank} {failing.get('query')}", "model.n_heads"),
        "key_value": (
            f"the key/value heads' width{on_a_rank} {failing.get('key_value')} ({model.kv_heads} heads of "
            f"{model.head_dim})",
            "model.n_kv_heads",
        ),
        "feed_forward": (
            f"the feed-forward width{on_a_rank} {failing.get('feed_forward')}",
            "the feed-forward width (model.multiple_of or model.ffn_dim)",
        ),
    }
    widths, settings = zip(*(said[name] for name in failing))
    one = len(widths) == 1
    return (
        f"{_listed(widths)} {'is' if one else 'are'} not, so none can train in float8: choose {_listed(settings)} so "
        f"that {'this width is a multiple' if one else 'these widths are multiples'} of {FLOAT8_MULTIPLE}"
        f"{' times the tensor-parallel degree' if tp > 1 else ''}"
    )


def _listed(items: tuple[str, ...]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return " and ".join(items) if len(items) < 3 else f"{', '.join(items[:-1])} and {items[-1]}"


def check_cluster_has_float8(cfg: DictConfig, recipe: str) -> None:
    """A dry run checks the job against a cluster preset (`cluster=NAME`): its GPUs must have float8 products. A real
    run is checked once the Trainer sees the node's GPU (project.training.trainer.check_devices)."""
    cluster = cfg.get("cluster")
    if cluster is None or cluster.get("accelerator") != "gpu" or has_float8_products(cluster.get("peak_tflops") or {}):
        return
    raise ConfigError(
        f"strategy.float8={recipe} on cluster={cluster.get('name')}: its GPUs have no float8 matrix products (the "
        f"preset gives no peak_tflops.fp8); {FLOAT8_GPUS}. Set strategy.float8=null, or check the job against the "
        "cluster it will run on (cluster=h100_80gb, cluster=h200)."
    )
