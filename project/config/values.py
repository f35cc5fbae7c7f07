"""The values of a run's settings, checked against the ranges the code relies on before torch is imported."""

from __future__ import annotations

from typing import Any, Mapping

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from project.config.command_line import CONF, close_match, strategies_with
from project.config.optim import OptimConfig
from project.config.stability import StabilityConfig
from project.model import families
from project.model.config import DTYPE_NAMES, LlamaConfig
from project.parallel.float8_rules import RECIPES
from project.parallel.mesh import GRADIENT_SYNCS
from project.parallel.pipeline_layout import SCHEDULE_NAMES
from project.runtime.errors import ConfigError
from project.runtime.settings import Rule, above, accepted, or_null, out_of_range, whole

# Settings whose range the code relies on: (key, accepts, what it must be). None is allowed only where stated.
# Those of a dataclass (model.*: LlamaConfig, optim.*: OptimConfig, stability.*: StabilityConfig) are declared on
# its fields.
RULES: list[Rule] = [
    ("trainer.max_steps", whole(1), "a whole number of optimizer steps, 1 or more"),
    ("global_batch_size", whole(1), "a whole number of sequences, 1 or more"),
    (
        "micro_batch_size",
        or_null(whole(1)),
        "null (the whole per-replica share) or 1 or more",
    ),
    ("val_every_n_steps", whole(1), "a whole number of steps, 1 or more"),
    ("ckpt_every_n_steps", whole(1), "a whole number of steps, 1 or more"),
    ("val_sequences", or_null(whole(1)), "null (the whole split) or 1 or more"),
    ("ckpt_every_minutes", or_null(above(0)), "null (by steps only) or minutes above 0"),
    ("ckpt_check_every_n_steps", whole(1), "a whole number of steps, 1 or more (10 by default)"),
    ("ckpt_keep_last", whole(1), "a whole number of checkpoints, 1 or more (1: last.ckpt alone)"),
    ("threads_per_process", or_null(whole(1)), "null (1) or 1 or more"),
    (
        "strategy.collective_timeout_minutes",
        or_null(above(0)),
        "minutes above 0 (multi-process strategies), e.g. 10",
    ),
    (
        "strategy.startup_timeout_minutes",
        or_null(above(0)),
        "minutes above 0 (multi-process strategies), e.g. 30: the collective timeout until the first step has ended",
    ),
    ("peak_flops_per_device", or_null(above(0)), "null (unknown) or FLOP/s above 0"),
    (
        "strategy.hybrid_shard_size",
        or_null(whole(2)),
        "null (the devices of a node) or 2 or more: a group of one rank holds a whole copy, which "
        "sharding_strategy=NO_SHARD says",
    ),
    ("data.seq_len", whole(2), "a whole number of tokens, 2 or more"),
    (
        "data.prepare_part_mb",
        lambda v: isinstance(v, (int, float)) and v > 0,
        "MB of source text per part, above 0 (4 by default)",
    ),
    (
        "data.prepare_nodes",
        or_null(whole(1)),
        "null (from SLURM or torchrun) or a number of machines, 1 or more",
    ),
    (
        "data.prepare_node_rank",
        or_null(whole(0)),
        "null (from SLURM or torchrun) or 0 to data.prepare_nodes - 1",
    ),
    (
        "data.chunk_mb",
        lambda v: isinstance(v, (int, float)) and v > 0,
        "MB per shard chunk, above 0 (1 small corpora, 64 large ones)",
    ),
    (
        "data.shuffle_window",
        whole(1),
        "a whole number of chunks, 1 or more (8 by default)",
    ),
    # seed_everything takes an unsigned 32-bit seed; a string would end in Lightning's traceback.
    ("seed", lambda v: isinstance(v, int) and 0 <= v < 2**32, "a whole number from 0 to 4294967295"),
    ("data.seed", lambda v: isinstance(v, int) and 0 <= v < 2**32, "a whole number from 0 to 4294967295"),
    (
        "data.loader_workers",
        whole(0),
        "a whole number, 0 (read in the training process) or more",
    ),
]

BOOLEAN_SETTINGS = (
    "document_mask",
    "data.overwrite",
    "data.auto_prepare",
    "data.allow_repeats",
    "dry_run.enabled",
    "memory_check",
    "ckpt_async",
)
_BOOLEAN = (True, False)
_DTYPE_NAMES = (None, *DTYPE_NAMES)
# Strategy settings that take one of a few values, checked here for whichever strategy has them, so that
# a typo is answered before the imports (the strategies check them again when built from Python).
STRATEGY_CHOICES: dict[str, tuple] = {
    "grad_reduction": ("mean", "sum"),
    "sharding_strategy": ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"),
    "state_dict_type": ("sharded", "full"),
    "compression": ("none", "fp16"),
    "schedule": SCHEDULE_NAMES,
    "param_dtype": _DTYPE_NAMES,
    "reduce_dtype": _DTYPE_NAMES,
    "float8": (None, *RECIPES),
    "gradient_sync": GRADIENT_SYNCS,
    "context_parallel_kv": ("gather", "ring"),
    **dict.fromkeys(
        (
            "sequence_parallel",
            "loss_parallel",
            "activation_checkpointing",
            "compile",
            "cpu_offload",
            "find_unused_parameters",
            "static_graph",
            "hierarchical_allreduce",
            "regather_kv",
            "reshard_after_forward",
        ),
        _BOOLEAN,
    ),
}


def _strategy_settings(strategy_cfg: Mapping[str, Any], strategy_name: str) -> list[str] | None:
    """The settings of the strategy group `strategy_name`, or (unnamed) of every group that builds the same
    `_target_`."""
    groups = sorted((CONF / "strategy").glob("*.yaml"))
    named = [path for path in groups if path.stem == strategy_name]
    configs = [OmegaConf.load(path) for path in named or groups]
    same = [c for c in configs if named or c.get("_target_") == strategy_cfg.get("_target_")]
    return sorted({str(key) for c in same for key in c.keys()}) or None


def _one_of(value: Any, choices: tuple) -> bool:
    # By type as well: 1 == True, and a YAML `yes` or `1` for a boolean setting is a mistake worth naming.
    return any(value == choice and type(value) is type(choice) for choice in choices)


def check_strategy_choices(strategy_cfg: Mapping[str, Any], strategy_name: str = "") -> None:
    # A key added with +strategy.KEY=... would reach the strategy's constructor, and end in a TypeError.
    settings = _strategy_settings(strategy_cfg, strategy_name)
    for key in sorted(set(strategy_cfg) - set(settings or strategy_cfg)):
        which = f"strategy={strategy_name}" if strategy_name else strategy_cfg.get("_target_")
        if key == "context_parallel_size":
            raise ConfigError(
                f"strategy.context_parallel_size: {which} does not split sequences. Context parallelism runs under "
                "strategy=fsdp2, tp_fsdp, tp or pipeline (strategy.context_parallel_size=N); or remove the setting."
            )
        if others := strategies_with(key):  # the same words as the command line's check (+strategy.KEY gets here)
            raise ConfigError(
                f"strategy.{key} is not a setting of {which}: it is one of strategy={', '.join(others)}. Choose one "
                "of those, or remove the setting."
            )
        raise ConfigError(
            f"strategy.{key} is not a setting of {which}.{close_match(key, settings)} "
            f"Its settings: {', '.join(k for k in settings if k != '_target_')}."
        )
    for key, choices in STRATEGY_CHOICES.items():
        if key in strategy_cfg and not _one_of(strategy_cfg[key], choices):
            shown = ", ".join(
                "null" if c is None else str(c).lower() if isinstance(c, bool) else str(c) for c in choices
            )
            where = f" (strategy={strategy_name})" if strategy_name else ""
            raise ConfigError(f"strategy.{key}={strategy_cfg[key]}{where} is not a choice: it must be one of {shown}.")


def check_values(cfg: DictConfig) -> None:
    for key, accepts, must_be in RULES:
        value = OmegaConf.select(cfg, key)
        if not accepted(value, accepts):
            raise ConfigError(out_of_range(key, value, must_be))
    for key in BOOLEAN_SETTINGS:
        if (value := OmegaConf.select(cfg, key)) is not None and not isinstance(value, bool):
            raise ConfigError(f"{key}={value} must be true or false.")
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    check_strategy_choices(OmegaConf.to_container(cfg.strategy, resolve=True), choices.get("strategy", ""))
    try:
        OptimConfig(**OmegaConf.to_container(cfg.optim, resolve=True))
        StabilityConfig(**OmegaConf.to_container(cfg.stability, resolve=True))
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error)) from None
    if refused := model_config(cfg).refuses_precision(str(cfg.trainer.get("precision", "32-true"))):
        raise ConfigError(refused)


def model_config(cfg: DictConfig) -> LlamaConfig:
    """The model's config, of its family's class (project.model.families); shapes it cannot take (dim not divisible
    by the heads, ...) as a ConfigError."""
    try:
        return families.model_config(OmegaConf.to_container(cfg.model, resolve=True))
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error)) from None
