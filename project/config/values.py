"""The values of a run's settings, checked against the ranges the code relies on before torch is imported."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from project.config.command_line import CONF, close_match
from project.model.config import DTYPE_NAMES, LlamaConfig
from project.parallel.pipeline_layout import SCHEDULE_NAMES
from project.runtime.errors import ConfigError

Rule = tuple[str, Callable[[Any], bool], str]
# Settings whose range the code relies on: (key, accepts, what it must be). None is allowed only where stated.
RULES: list[Rule] = [
    ("optim.lr", lambda v: v > 0, "above 0, e.g. 3e-4"),
    ("optim.min_lr", lambda v: v >= 0, "0 or more (the cosine's floor)"),
    ("optim.warmup_steps", lambda v: isinstance(v, int) and v >= 0, "a whole number of steps, 0 or more"),
    (
        "optim.decay_steps",
        lambda v: v is None or isinstance(v, int) and v > 0,
        "null (trainer.max_steps) or a number of steps above 0",
    ),
    ("optim.weight_decay", lambda v: v >= 0, "0 or more"),
    ("optim.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1), e.g. [0.9, 0.95]"),
    ("optim.eps", lambda v: v > 0, "above 0, e.g. 1e-8"),
    ("optim.grad_clip", lambda v: v is None or v >= 0, "null or 0 (no clipping), or a norm above 0"),
    (
        "optim.max_skipped_steps",
        lambda v: isinstance(v, int) and v >= 0,
        "a whole number of steps, 0 (stop at the first) or more",
    ),
    ("trainer.max_steps", lambda v: isinstance(v, int) and v >= 1, "a whole number of optimizer steps, 1 or more"),
    ("global_batch_size", lambda v: isinstance(v, int) and v >= 1, "a whole number of sequences, 1 or more"),
    (
        "micro_batch_size",
        lambda v: v is None or isinstance(v, int) and v >= 1,
        "null (the whole per-replica share) or 1 or more",
    ),
    ("val_every_n_steps", lambda v: isinstance(v, int) and v >= 1, "a whole number of steps, 1 or more"),
    ("ckpt_every_n_steps", lambda v: isinstance(v, int) and v >= 1, "a whole number of steps, 1 or more"),
    ("val_sequences", lambda v: v is None or isinstance(v, int) and v >= 1, "null (the whole split) or 1 or more"),
    ("ckpt_every_minutes", lambda v: v is None or v > 0, "null (by steps only) or minutes above 0"),
    ("threads_per_process", lambda v: v is None or isinstance(v, int) and v >= 1, "null (1) or 1 or more"),
    (
        "strategy.collective_timeout_minutes",
        lambda v: v is None or v > 0,
        "minutes above 0 (multi-process strategies), e.g. 10",
    ),
    ("peak_flops_per_device", lambda v: v is None or v > 0, "null (unknown) or FLOP/s above 0"),
    ("data.seq_len", lambda v: isinstance(v, int) and v >= 2, "a whole number of tokens, 2 or more"),
    (
        "data.prepare_part_mb",
        lambda v: isinstance(v, (int, float)) and v > 0,
        "MB of source text per part, above 0 (4 by default)",
    ),
    (
        "data.prepare_nodes",
        lambda v: v is None or isinstance(v, int) and v >= 1,
        "null (from SLURM or torchrun) or a number of machines, 1 or more",
    ),
    (
        "data.prepare_node_rank",
        lambda v: v is None or isinstance(v, int) and v >= 0,
        "null (from SLURM or torchrun) or 0 to data.prepare_nodes - 1",
    ),
    (
        "data.chunk_mb",
        lambda v: isinstance(v, (int, float)) and v > 0,
        "MB per shard chunk, above 0 (1 small corpora, 64 large ones)",
    ),
    (
        "data.shuffle_window",
        lambda v: isinstance(v, int) and v >= 1,
        "a whole number of chunks, 1 or more (8 by default)",
    ),
    ("model.vocab_size", lambda v: isinstance(v, int) and v >= 2, "a whole number, at least the tokenizer's size"),
    ("model.dim", lambda v: isinstance(v, int) and v >= 1, "a whole number above 0"),
    ("model.n_layers", lambda v: isinstance(v, int) and v >= 1, "a whole number above 0"),
    ("model.n_heads", lambda v: isinstance(v, int) and v >= 1, "a whole number above 0"),
    (
        "model.n_kv_heads",
        lambda v: v is None or isinstance(v, int) and v >= 1,
        "null (= n_heads) or a whole number above 0",
    ),
    ("model.multiple_of", lambda v: isinstance(v, int) and v >= 1, "a whole number above 0"),
    ("model.ffn_dim_multiplier", lambda v: v is None or v > 0, "null or above 0"),
    (
        "model.ffn_dim",
        lambda v: v is None or isinstance(v, int) and v >= 1,
        "null (the rule of multiple_of) or a whole number above 0",
    ),
    ("model.norm_eps", lambda v: v > 0, "above 0, e.g. 1e-5"),
    ("model.rope_theta", lambda v: v > 0, "above 0, e.g. 10000"),
    ("model.max_seq_len", lambda v: isinstance(v, int) and v >= 1, "a whole number of tokens above 0"),
    ("model.init_std", lambda v: v > 0, "above 0, e.g. 0.02"),
    # seed_everything takes an unsigned 32-bit seed; a string would end in Lightning's traceback.
    ("seed", lambda v: isinstance(v, int) and 0 <= v < 2**32, "a whole number from 0 to 4294967295"),
    ("data.seed", lambda v: isinstance(v, int) and 0 <= v < 2**32, "a whole number from 0 to 4294967295"),
    (
        "data.loader_workers",
        lambda v: isinstance(v, int) and v >= 0,
        "a whole number, 0 (read in the training process) or more",
    ),
]

BOOLEAN_SETTINGS = ("document_mask", "data.overwrite", "data.auto_prepare", "data.allow_repeats", "dry_run.enabled")
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
        try:
            ok = not isinstance(value, bool) and accepts(value)
        except TypeError:  # a string or a list where a number belongs, or a null where none is allowed
            ok = False
        if not ok:
            raise ConfigError(f"{key}={value} is out of range: it must be {must_be}.")
    for key in BOOLEAN_SETTINGS:
        if (value := OmegaConf.select(cfg, key)) is not None and not isinstance(value, bool):
            raise ConfigError(f"{key}={value} must be true or false.")
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    check_strategy_choices(OmegaConf.to_container(cfg.strategy, resolve=True), choices.get("strategy", ""))
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(
            f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}: the cosine decays from lr down to "
            "min_lr."
        )
    model_config(cfg)


def model_config(cfg: DictConfig) -> LlamaConfig:
    """The model's LlamaConfig; shapes it cannot take (dim not divisible by the heads, ...) as a ConfigError."""
    try:
        return LlamaConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error)) from None
