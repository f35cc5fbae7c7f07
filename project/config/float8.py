"""strategy.float8 checked before the imports: torchao is there, and the model has layers float8 can take."""

from __future__ import annotations

import importlib.util

from omegaconf import DictConfig

from project.config.values import model_config
from project.parallel.float8_rules import FLOAT8_MULTIPLE, block_projections, unconvertible
from project.runtime.errors import ConfigError


def check_float8(cfg: DictConfig) -> None:
    recipe = cfg.strategy.get("float8")
    if recipe is None:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"strategy.float8={recipe} needs torchao, which this environment lacks: `make install` brings it "
            "(or pip install torchao==0.18.0); or set strategy.float8=null."
        )
    model = model_config(cfg)
    kept = unconvertible(model)
    if len(kept) == len(block_projections(model)):
        raise ConfigError(
            f"strategy.float8={recipe}: no linear layer of the blocks has sides that are multiples of "
            f"{FLOAT8_MULTIPLE} (model.dim={model.dim}, heads of {model.head_dim}, feed-forward "
            f"{model.ffn_hidden_dim}), so none can train in float8: choose model.dim, model.n_heads and the "
            f"feed-forward width (model.multiple_of or model.ffn_dim) as multiples of {FLOAT8_MULTIPLE}, or set "
            "strategy.float8=null."
        )
