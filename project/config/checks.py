"""Checks of a training run's settings that need no process group, no model and no Lightning.

`project.train` runs `preflight` before it imports torch or Lightning, so a typo is answered in about
a second instead of after the imports; the same functions run again once the Trainer has resolved
what the config left open (`trainer.devices: auto`, data prepared on the way). Nothing here imports
torch: keep it so (tests/test_checks.py watches it).
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from project.data.corpus import NoSourcesError, resolve_sources
from project.data.shards import MANIFEST_NAME, read_manifest
from project.data.storage import check_prepared_shards
from project.model.config import DTYPE_NAMES, LlamaConfig
from project.parallel.batch import BatchPlan, plan_batches, plan_pipeline_batches
from project.parallel.mesh import MeshShape, check_tensor_parallel_degree, mesh_shape
from project.parallel.pipeline_layout import SCHEDULE_NAMES, check_pipeline, default_virtual_stages
from project.runtime.console import launch_rank
from project.runtime.errors import ConfigError
from project.runtime.folders import unwritable

# Derived from the batch plan and the step-based schedule; a value set by hand would silently disagree.
COMPUTED_TRAINER_KEYS = {
    "accumulate_grad_batches": "set global_batch_size and micro_batch_size instead",
    "val_check_interval": "set val_every_n_steps instead",
    "check_val_every_n_epoch": "set val_every_n_steps instead",
    "gradient_clip_val": "set optim.grad_clip instead (the module clips and logs the norm)",
    "use_distributed_sampler": "the data module splits the data by data-parallel replica itself",
}


@dataclass(frozen=True)
class Layout:
    """How a run spreads over its devices: the mesh degrees and the batch plan."""

    shape: MeshShape
    plan: BatchPlan

    def name(self, model: str, strategy: str) -> str:
        """`small10m_dp2-tp2-pp1_mb4_fsdp2`: the model preset, the degrees, the micro batch and the strategy."""
        pp, dp, tp = self.shape
        return f"{model}_dp{dp}-tp{tp}-pp{pp}_mb{self.plan.micro_batch_size}_{strategy}"

    def facts(self) -> dict[str, int]:
        """The layout as numbers, logged beside the metrics so that runs can be compared by them."""
        pp, dp, tp = self.shape
        return {
            "layout/world_size": pp * dp * tp,
            "layout/data_parallel": dp,
            "layout/tensor_parallel": tp,
            "layout/pipeline_parallel": pp,
            "layout/micro_batch_size": self.plan.micro_batch_size,
            "layout/accumulation": self.plan.accumulate_grad_batches,
            "layout/pipeline_microbatches": self.plan.pipeline_microbatches,
            "layout/global_batch_size": self.plan.global_batch_size,
        }


CONF = Path(__file__).resolve().parents[2] / "conf"


def _close(word: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(word, choices, n=1)
    return f" Did you mean {match[0]}?" if match else ""


def check_command_line(argv: list[str], config_name: str = "train") -> None:
    """Compose the config from `argv` as Hydra will, and answer what it refuses (a config group option
    that does not exist, a key that is not in the config, an override that does not parse) as one
    paragraph with a suggestion, instead of Hydra's message and traceback hint. Command lines with
    Hydra's own flags (-m, --cfg, ...) are left to Hydra."""
    _check_flags(argv, config_name)
    if any(arg.startswith("-") for arg in argv):
        return
    # Hydra's own settings are Hydra's to check, but for its search path: it adds config files (a planned sweep's
    # layouts).
    overrides = [
        arg for arg in argv if not arg.lstrip("+~").startswith("hydra.") or arg.startswith("hydra.searchpath=")
    ]
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name, overrides=overrides)
    except HydraException as error:
        raise ConfigError(_explain(error, overrides, config_name)) from None
    _check_run_dir(argv, cfg)


# Hydra's own command-line flags (`--hydra-help` lists them); any other `--name` is an argparse habit.
HYDRA_FLAGS = {
    "--help",
    "--hydra-help",
    "--version",
    "--cfg",
    "--resolve",
    "--package",
    "--run",
    "--multirun",
    "--shell-completion",
    "--config-path",
    "--config-name",
    "--config-dir",
    "--info",
    "--experimental-rerun",
}


def _check_flags(argv: list[str], config_name: str) -> None:
    """`--max_steps 10` or `--max_steps=10` gets the override it meant (`trainer.max_steps=10`), not Hydra's usage
    text."""
    for i, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if not flag.startswith("--") or flag in HYDRA_FLAGS or flag == "--":
            continue
        if not equals and i + 1 < len(argv) and not argv[i + 1].startswith("-") and "=" not in argv[i + 1]:
            value = argv[i + 1]
        name = flag[2:].replace("-", "_")
        key = _setting_named(name, config_name) or name
        override = f"{key}={value or 'VALUE'}"
        raise ConfigError(
            f"{arg}: settings are Hydra overrides, key=value without dashes: write {override} "
            f"(e.g. `python -m project.{config_name} {override}`)."
        )


def _setting_named(name: str, config_name: str) -> str | None:
    """The full key of the setting whose last part is `name` (max_steps -> trainer.max_steps), or the closest one."""
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = OmegaConf.to_container(compose(config_name), resolve=False)
    except HydraException:
        return None
    keys: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            keys.append(f"{prefix}{key}")
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")

    walk(cfg, "")
    if name in keys:
        return name
    exact = [key for key in keys if key.rpartition(".")[2] == name]
    if exact:
        return min(exact, key=len)
    close = difflib.get_close_matches(name, keys, n=1) or difflib.get_close_matches(
        name, [k.rpartition(".")[2] for k in keys], n=1
    )
    return next((key for key in keys if close and (key == close[0] or key.endswith("." + close[0]))), None)


def _check_run_dir(argv: list[str], cfg: DictConfig) -> None:
    """Hydra makes the run directory before any of our code runs, and answers a folder it cannot write
    with a traceback: say it first. The directory is hydra.run.dir, or by default a folder in paths.log_dir."""
    given = [arg.partition("=")[2] for arg in argv if arg.startswith("hydra.run.dir=")]
    setting, folder = (
        ("hydra.run.dir", given[-1]) if given else ("paths.log_dir", OmegaConf.select(cfg, "paths.log_dir"))
    )
    problem = unwritable(folder) if folder else None
    if problem:
        raise ConfigError(
            f"{setting}={folder}: cannot make the run directory there ({problem}). Choose a folder you can write to "
            "with hydra.run.dir=DIR (or paths.log_dir=DIR, where run directories go by default)."
        )


def _explain(error: HydraException, overrides: list[str], config_name: str) -> str:
    message = str(error)
    if missing := re.search(r"Could not find '([\w/]+)/([^']+)'", message):
        group, name = missing.groups()
        options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        return (
            f"{group}={name}: there is no conf/{group}/{name}.yaml.{_close(name, options)} Choose one of: "
            f"{', '.join(options)}."
        )
    if unknown := re.search(r"Could not override '([^']+)'", message):
        key = unknown.group(1)
        parent, _, leaf = key.rpartition(".")
        groups_only = [o for o in overrides if (CONF / o.split("=")[0]).is_dir()]  # the structure, without the typo
        try:
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                base = compose(config_name, overrides=groups_only)
            node = OmegaConf.select(base, parent) if parent else base
            siblings = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        except HydraException:
            siblings = []
        where = f"in {parent}" if parent else "at the top level"
        listed = f" Settings there: {', '.join(siblings)}." if siblings and len(siblings) <= 20 else ""
        return (
            f"{key}: no such setting {where}.{_close(leaf, siblings)}{listed} To add a new key on purpose, write "
            f"+{key}=VALUE."
        )
    first_line = message.strip().splitlines()[0]
    return f"{first_line} (Hydra's override syntax: https://hydra.cc/docs/advanced/override_grammar/basic/)."


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
            f"strategy.{key} is not a setting of {which}.{_close(key, settings)} "
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


def is_pipeline(strategy_cfg: Mapping[str, Any]) -> bool:
    return str(strategy_cfg.get("_target_", "")).endswith("LlamaPipelineStrategy")


def is_horovod(strategy_cfg: Mapping[str, Any]) -> bool:
    return str(strategy_cfg.get("_target_", "")).startswith("project.parallel.horovod.")


def horovod_devices(cfg: DictConfig, dry_run: bool) -> int:
    """The processes horovodrun started: Horovod's launcher, not the trainer settings, says how many."""
    if dry_run:
        raise ConfigError(
            "dry_run=true does not model strategy=horovod: dry-run strategy=ddp with trainer.devices and "
            "trainer.num_nodes of your job instead (the same replicas, memory and batch plan)."
        )
    if cfg.trainer.get("devices", 1) != 1 or cfg.trainer.get("num_nodes", 1) != 1:
        raise ConfigError(
            f"strategy=horovod runs one process per device and horovodrun starts them (-np N -H host:slots,...): "
            f"leave trainer.devices=1 and trainer.num_nodes=1 (they are {cfg.trainer.get('devices')} and "
            f"{cfg.trainer.get('num_nodes', 1)})."
        )
    if str(cfg.trainer.get("precision")) == "bf16-true":  # Lightning reads "bf16" as bf16-mixed
        raise ConfigError(
            f"strategy=horovod with trainer.precision={cfg.trainer.precision}: Horovod 0.28's PyTorch operations have "
            "no bfloat16, and weights and gradients would be bfloat16. Use trainer.precision=bf16-mixed (bfloat16 "
            "compute, float32 weights and gradients) or 32-true."
        )
    from project.parallel.horovod import horovod_world  # imports torch and Horovod: only for Horovod runs

    processes = horovod_world(OmegaConf.to_container(cfg.strategy, resolve=True))
    overrides = HydraConfig.get().overrides.hydra if HydraConfig.initialized() else []
    if processes > 1 and not any(o.lstrip("+").startswith("hydra.run.dir=") for o in overrides):
        raise ConfigError(
            f"strategy=horovod with {processes} processes needs one run directory for all of them: add "
            "hydra.run.dir=outputs/runs/NAME (on a file system every node shares); each would otherwise name its own "
            "from its clock."
        )
    return processes


def check_trainer(cfg: DictConfig, here: bool = True) -> None:
    """`here`: the run is to start on this machine (not a dry run of a job for another), so a GPU it asks for must be
    here."""
    if cfg.trainer.get("max_steps", -1) in (None, -1):
        raise ConfigError("trainer.max_steps must be set: training length is counted in optimizer steps.")
    for key, fix in COMPUTED_TRAINER_KEYS.items():
        if key in cfg.trainer:
            raise ConfigError(f"trainer.{key} is computed by project.train: {fix}.")
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and here:
        import torch  # only here: a CPU run's settings check should not wait for it

        if not torch.cuda.is_available():
            reason = (
                f"this torch ({torch.__version__}) is a CPU build: on a GPU machine install a CUDA build, e.g. "
                '`make install TORCH="torch==2.11.0"`'
                if torch.version.cuda is None
                else f"this torch (CUDA {torch.version.cuda}) sees no GPU: check the driver (nvidia-smi) and "
                "CUDA_VISIBLE_DEVICES"
            )
            raise ConfigError(
                f"trainer.accelerator={accelerator} (trainer=gpu) needs a CUDA GPU, but {reason}; or train on the CPU "
                "with trainer=cpu."
            )


def plan_layout(cfg: DictConfig, num_nodes: int, devices_per_node: int) -> Layout:
    """Degrees and batch plan of the run on `num_nodes x devices_per_node` devices, refusing what
    cannot be built: degrees that do not divide the devices or the model, batches that do not split,
    pipelines that cannot be scheduled."""
    strategy_cfg = OmegaConf.to_container(cfg.strategy, resolve=True)
    model = model_config(cfg)
    shape = mesh_shape(strategy_cfg, num_nodes * devices_per_node, devices_per_node)
    if shape.tensor_parallel > 1:
        sequence_parallel = strategy_cfg.get("sequence_parallel", False)
        check_tensor_parallel_degree(model, shape.tensor_parallel, cfg.data.seq_len if sequence_parallel else None)
    if not is_pipeline(strategy_cfg):
        return Layout(shape, plan_batches(cfg.global_batch_size, shape.data_parallel, cfg.micro_batch_size))
    plan = plan_pipeline_batches(
        cfg.global_batch_size, shape.data_parallel, cfg.micro_batch_size, strategy_cfg.get("n_microbatches")
    )
    schedule = strategy_cfg.get("schedule", "1f1b")
    check_pipeline(
        model,
        schedule,
        shape,
        strategy_cfg.get("virtual_stages") or default_virtual_stages(schedule),
        plan.pipeline_microbatches,
        strategy_cfg.get("stage_layers"),
        strategy_cfg.get("compile", False),
        strategy_cfg.get("param_dtype"),
    )
    return Layout(shape, plan)


def data_on_this_machine(cfg: DictConfig) -> bool:
    """False for a local data.dir that does not exist here: a dry run of a job for another machine, whose
    shards are there, cannot check them (a real start prepares them, or refuses)."""
    return bool(cfg.data.get("mix")) or "://" in str(cfg.data.dir) or Path(cfg.data.dir).exists()


def check_data(cfg: DictConfig, shards: bool = True, prepared: bool = False) -> None:
    """The model against the prepared shards, and the shards themselves, when they exist (they may yet be
    prepared by the run). `shards=False`: the sequence length against the model only. `prepared`: the run has
    just prepared them, so their settings must now be the run's, data.overwrite or not."""
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}.")
    if not shards:
        return
    options = (cfg.data.get("cache_dir"), cfg.data.get("storage_options"))
    if cfg.data.get("mix"):  # corpora prepared one by one beforehand; the datamodule checks their tokenizers agree
        for entry in cfg.data.mix:
            data_dir = entry.get("dir") if isinstance(entry, Mapping) else None
            if data_dir is None:
                raise ConfigError(
                    f"data.mix entry {entry!r} needs a `dir` (prepared shards) and a `weight`, e.g. "
                    f"{{dir: data/web, weight: 0.7}}."
                )
            check_prepared_shards(data_dir, cfg.data.seq_len, *options)
    if "://" in str(cfg.data.dir):  # training does not prepare into object storage: the shards must be there
        _check_vocabulary(cfg, check_prepared_shards(cfg.data.dir, cfg.data.seq_len, *options)[1])
        return
    data_dir = Path(cfg.data.dir)
    if not (data_dir / MANIFEST_NAME).is_file():
        if cfg.data.get("mix") or not cfg.data.get("auto_prepare", False):
            read_manifest(data_dir)  # refuses
        elif data_dir.is_dir() and any(data_dir.iterdir()):
            # Said by project.data.prepare too, but only once it has the sources, which it may first download.
            raise ConfigError(
                f"data.dir={data_dir} exists, is not empty and holds no {MANIFEST_NAME}, so it is not a prepared "
                "dataset and will not be prepared into; point data.dir at prepared shards, or a new or empty folder."
            )
        return
    # A mixture's corpora are prepared one by one with settings of their own, which data.* does not describe.
    differences = [] if cfg.data.get("mix") else data_settings_differ(cfg, read_manifest(data_dir))
    if differences:
        if cfg.data.get("overwrite") and cfg.data.get("auto_prepare") and not prepared:
            return  # training prepares them again from this run's settings, then checks again (prepared=True)
        again = (
            "data.overwrite=true to prepare them again in place (with data.auto_prepare=true, training does it first)"
        )
        raise ConfigError(
            f"data.dir={data_dir} holds shards prepared from other data settings than this run's: "
            f"{'; '.join(differences)}. Point data.dir at a new folder to prepare them there and keep both, set "
            f"{again}, or give the settings the shards were prepared from to train on them as they are."
        )
    _check_vocabulary(cfg, check_prepared_shards(data_dir, cfg.data.seq_len)[1])


def data_settings_differ(cfg: DictConfig, manifest: Mapping[str, Any]) -> list[str]:
    """What of data.sources, data.text_field, data.tokenizer, data.vocab_size and data.seq_len differs from what
    the shards' manifest records they were prepared from, each as `setting: there, here`.

    Sources are compared on the first process only (a glob of a large corpus on every rank of a job would
    flood a shared file system), and only where the shards' own source files are on this machine: shards
    copied, or moved with their project, without their raw text are taken as they are. The tokenizer is
    compared by its file's content, the rest where the manifest records them (older shards are taken on trust).
    """
    data, differences = cfg.data, []
    if manifest.get("block_size") != data.seq_len + 1:
        differences.append(f"data.seq_len: {int(manifest['block_size']) - 1} there, {data.seq_len} here")
    there = {str(s.get("path")): s.get("bytes") for s in manifest.get("sources", []) if isinstance(s, Mapping)}
    if there and any(Path(path).exists() for path in there) and launch_rank(cfg.trainer.get("num_nodes", 1)) == 0:
        patterns = [data.sources] if isinstance(data.sources, str) else list(data.get("sources") or [])
        try:
            here = {str(path): path.stat().st_size for path in resolve_sources(patterns)}
        except NoSourcesError:
            here = {}
        if here.keys() != there.keys():
            differences.append(f"data.sources: {_files(there)} there, {_files(here)} here")
        elif changed := sorted(path for path in here if here[path] != there[path]):
            differences.append(
                f"data.sources: {changed[0]} held {there[changed[0]]} bytes when prepared, {here[changed[0]]} now"
            )
    settings = manifest.get("settings")
    if not isinstance(settings, Mapping):
        return differences
    if settings.get("text_field") != data.text_field:
        differences.append(f"data.text_field: {settings.get('text_field')} there, {data.text_field} here")
    given, recorded = data.get("tokenizer"), settings.get("tokenizer")
    if (
        (given is None) != (recorded is None)
        or given is not None
        and not _same_tokenizer(given, settings.get("tokenizer_sha256"))
    ):
        differences.append(f"tokenizer: {_tokenizer_said(recorded)} there, {_tokenizer_said(given)} here")
    elif given is None and settings.get("vocab_size") != data.vocab_size:
        differences.append(f"data.vocab_size: {settings.get('vocab_size')} there, {data.vocab_size} here")
    return differences


def _same_tokenizer(given: str, sha256: str | None) -> bool:
    from project.data.tokenizer import (
        file_sha256,
        tokenizer_file,
    )  # tokenizers and sentencepiece: only when one is given

    path = tokenizer_file(given)
    return path.is_file() and file_sha256(path) == sha256


def _tokenizer_said(tokenizer: str | None) -> str:
    return f"data.tokenizer={tokenizer}" if tokenizer else "a BPE trained on the sources (data.tokenizer=null)"


def _files(sizes: Mapping[str, Any]) -> str:
    """`12 files in /data/raw/shakespeare (a_gut.txt, ...)`: what a list of source files is, said briefly."""
    paths = sorted(sizes)
    if not paths:
        return "no files"
    folder = os.path.commonpath([os.path.dirname(p) for p in paths])
    names = ", ".join(os.path.relpath(p, folder) for p in paths[:2]) + (", ..." if len(paths) > 2 else "")
    return f"{len(paths)} file{'s' if len(paths) != 1 else ''} in {folder} ({names})"


def _check_vocabulary(cfg: DictConfig, manifest: Mapping[str, Any]) -> None:
    tokenizer_vocab = int(manifest["tokenizer"]["vocab_size"])
    if cfg.model.vocab_size < tokenizer_vocab and cfg.get("init_from") is not None:
        raise ConfigError(
            f"the shards in data.dir={cfg.data.dir} were made with a tokenizer of {tokenizer_vocab} tokens, more than "
            f"the {cfg.model.vocab_size} of the model in init_from={cfg.init_from}: prepare your text with the "
            f"folder's own tokenizer (python -m project.prepare data.tokenizer={cfg.init_from} ...) and train on those "
            "shards."
        )
    if cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} "
            f"(shards in {cfg.data.dir}): set model.vocab_size={tokenizer_vocab} or more."
        )


def check_ckpt_path(cfg: DictConfig, run_dir: str | os.PathLike | None = None) -> None:
    """A checkpoint named by path exists; `last`, that of the run directory `run_dir` (Hydra's, by default)."""
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is None:
        return
    if str(ckpt_path) == "last":
        if run_dir is None and HydraConfig.initialized():
            run_dir = HydraConfig.get().runtime.output_dir
        if run_dir is None:
            return
        path = Path(run_dir) / "checkpoints" / "last.ckpt"
        if not path.exists() and not path.with_name(f"{path.name}.old").exists():
            raise ConfigError(
                f"ckpt_path=last: no checkpoint at {path}. `ckpt_path=last` resumes the run in this run directory: "
                "pass the directory of the run to resume as hydra.run.dir=DIR."
            )
        return
    path = Path(str(ckpt_path))
    # project.checkpoint.files.swap_in keeps the previous checkpoint as <name>.old while it replaces it.
    if not path.exists() and not path.with_name(f"{path.name}.old").exists():
        raise ConfigError(
            f"ckpt_path={ckpt_path}: no checkpoint at {path}. Pass a checkpoint file or sharded checkpoint folder (a "
            "run's checkpoints/last.ckpt), or ckpt_path=last with hydra.run.dir=DIR to resume the run in DIR."
        )
    # torch.save writes a zip archive whose directory is its last bytes: a file cut short, or not a checkpoint
    # at all, is told by reading them, before torch is imported to read the rest. (Files in torch's format
    # from before 1.6, which is not zip, are refused too: this platform never wrote them.)
    if path.is_file() and not zipfile.is_zipfile(path):
        raise ConfigError(
            f"{path} is not a checkpoint this platform can read (no whole zip archive, as torch.save writes: it is "
            f"truncated, or not a checkpoint): set ckpt_path= to another checkpoint, e.g. the run's best-step*.ckpt."
        )


def check_init_from(cfg: DictConfig) -> None:
    """`init_from=DIR`: the model's shape becomes the folder's, and its weights are checked, before anything else."""
    if cfg.get("init_from") is None:
        return
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is not None and str(ckpt_path) != "last":
        raise ConfigError(
            f"init_from={cfg.init_from} and ckpt_path={ckpt_path} both given: init_from starts a new run from a "
            "published model's weights (step 0, a fresh optimizer and schedule); ckpt_path resumes a run from its "
            "checkpoint. Drop ckpt_path to start from the folder, or init_from to resume. (ckpt_path=last beside "
            "init_from resumes the run in hydra.run.dir, the folder giving only the model's shape, so that a requeued "
            "job's command line still works.)"
        )
    from project.hf.folder import apply_init_from

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    try:
        apply_init_from(cfg, overrides)
    except (ValueError, TypeError) as error:  # a shape LlamaConfig cannot take; ConfigError passes as it is
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(
            f"init_from={cfg.init_from}: its config.json gives a model this platform cannot build ({error})."
        ) from None


def check_trainer_arguments(cfg: DictConfig) -> None:
    """Every trainer.* setting is an argument of lightning.Trainer (a key added with +trainer.KEY=... may not be).
    Imports Lightning: a real start checks this once it has, a dry run with its other checks."""
    import lightning

    accepted = set(inspect.signature(lightning.Trainer.__init__).parameters) - {"self"}
    for key in sorted(cfg.trainer.keys() - accepted - {"_target_"}):
        match = difflib.get_close_matches(str(key), sorted(accepted), n=1)
        hint = f" Did you mean trainer.{match[0]}?" if match else ""
        raise ConfigError(f"trainer.{key} is not an argument of lightning.Trainer.{hint}")


def preflight(cfg: DictConfig, dry_run: bool = False, run_dir: str | os.PathLike | None = None) -> Layout | None:
    """Every check that the config alone allows; the layout too when the device count is explicit.
    `dry_run`: the devices asked for are those of the job, not of this machine. `run_dir`: where
    `ckpt_path=last` looks (Hydra's run directory by default)."""
    check_init_from(cfg)
    check_trainer(cfg, here=not dry_run)
    check_values(cfg)
    check_data(cfg, shards=not dry_run or data_on_this_machine(cfg))
    check_ckpt_path(cfg, run_dir)
    nodes, devices = cfg.trainer.get("num_nodes", 1), cfg.trainer.get("devices", "auto")
    if is_horovod(cfg.strategy):
        devices = horovod_devices(cfg, dry_run)
    if isinstance(nodes, int) and isinstance(devices, int):
        return plan_layout(cfg, nodes, devices)
    return None
