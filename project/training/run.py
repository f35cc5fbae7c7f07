"""One training run, from a composed and pre-checked config (project.train is its command line).

Builds in order: strategy -> trainer -> layout -> data -> module, and fits. With a multi-process
strategy Lightning re-runs the same command for the other local ranks (pointing them at this run's
directory), so everything here runs on every rank.
"""

from __future__ import annotations

import math
import os
import signal
import warnings
from pathlib import Path
from typing import Callable, cast

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.accelerators import AcceleratorRegistry, CPUAccelerator
from lightning.pytorch.callbacks import Callback, ModelSummary, ProgressBar
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from project.checkpoint.files import checkpoint_metadata, checkpoint_step, resolve_ckpt_path, resumable_by
from project.config.data import check_data, data_settings_differ
from project.config.layout import Layout, plan_layout
from project.config.trainer import check_trainer_arguments
from project.data.prepare import prepare_from_config
from project.data.shards import MANIFEST_NAME, read_manifest
from project.data.storage import is_remote
from project.parallel.contract import contract_of
from project.runtime.console import keep_console, launch_rank, silence_known_noise
from project.runtime.errors import ConfigError
from project.runtime.processes import watch_children
from project.runtime.secrets import redact_text, redacted_container, secret_values
from project.training.callbacks import LayoutFacts, StepCheckpoint
from project.training.callbacks.preemption import REQUEUE_EXIT_STATUS, StopOnSignal
from project.training.lit_module import check_resumable
from project.training.loggers import RunIdentity


def limit_cpu_threads(trainer: L.Trainer, threads_per_process: int | None) -> None:
    # Several processes sharing a few cores thrash if each takes all threads (about 30x slower on 2 cores).
    # Runs before fit, so the ranks Lightning launches inherit the setting.
    # A strategy whose processes another launcher started (Horovod) says how many share this node.
    processes_here = contract_of(trainer.strategy).processes_per_node(trainer)
    if isinstance(trainer.accelerator, CPUAccelerator) and processes_here > 1:
        threads = threads_per_process or 1
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def is_first_process(trainer: L.Trainer) -> bool:
    """Global rank 0, known before the process group exists: from torchrun's or SLURM's variables,
    or, under Lightning's own launcher, from being the process that launches the others."""
    if not isinstance(trainer.strategy, ParallelStrategy):  # one process
        return True
    env = trainer.strategy.cluster_environment
    return env is None or (env.global_rank() == 0 and env.local_rank() == 0 and env.node_rank() == 0)


def devices_per_node(cfg: DictConfig) -> int:
    """The devices per node the Trainer will take for trainer.accelerator and trainer.devices (`auto`, -1, a list),
    asked of Lightning's accelerator before the Trainer exists, so that it is built once, with the layout's values."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator in ("auto", "gpu"):
        found = next((name for name in ("cuda", "mps") if AcceleratorRegistry.get(name).is_available()), None)
        accelerator = found or ("cpu" if accelerator == "auto" else "cuda")
    kind = type(AcceleratorRegistry.get(accelerator))
    devices = cfg.trainer.get("devices", "auto")
    devices = kind.auto_device_count() if devices == "auto" else devices
    return len(kind.get_parallel_devices(kind.parse_devices(devices)))


def build_callbacks(cfg: DictConfig, layout: Layout) -> list[Callback]:
    """conf/callbacks' (those the trainer settings leave on), the layout's facts, and the stop on a signal."""
    callbacks = [instantiate(node) for node in cfg.callbacks.values() if node is not None]
    if not cfg.trainer.get("enable_progress_bar", True):
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    if not cfg.trainer.get("enable_model_summary", True):
        callbacks = [c for c in callbacks if not isinstance(c, ModelSummary)]
    stop_signals = (signal.SIGTERM, signal.SIGUSR1) if SLURMEnvironment.detect() else (signal.SIGTERM,)
    step_checkpoints = [c for c in callbacks if isinstance(c, StepCheckpoint)]
    if step_checkpoints:  # without one (~callbacks.last_checkpoint), a signal stops the run as Lightning does
        callbacks.append(StopOnSignal(step_checkpoints[0], stop_signals))
    return [*callbacks, LayoutFacts(layout.facts())]


def build_loggers(cfg: DictConfig, run_dir: Path, layout: Layout) -> list[Logger]:
    """conf/logger's loggers, each told the run it logs: named after the layout, grouped by sweep or experiment."""
    choices = HydraConfig.get().runtime.choices
    model_name, strategy_name = choices.get("model", "model"), choices.get("strategy", "strategy")
    run = RunIdentity(
        dir=run_dir,
        name=layout.name(model_name, strategy_name),
        group=os.environ.get("WANDB_SWEEP_ID") or choices.get("experiment") or None,
        tags=[strategy_name, model_name, f"{math.prod(layout.shape)}-devices"],
        config=redacted_container(cfg),
        has_secrets=bool(secret_values(cfg)),
    )
    return [instantiate(node)(run) for node in cfg.logger.values() if node is not None]


def build_trainer(cfg: DictConfig, run_dir: Path, strategy: Strategy, layout: Layout) -> L.Trainer:
    """lightning.Trainer from conf/trainer, with what the run computes: the strategy, callbacks and loggers, and the
    layout's accumulation and validation interval (validation is counted in optimizer steps)."""
    check_trainer_arguments(cfg)
    plan = layout.plan
    # Our handler checkpoints between steps; Lightning's would save mid-step. Under horovodrun in a batch job,
    # Horovod gives the ranks, not SLURM's tasks.
    slurm = SLURMEnvironment.detect() and not contract_of(strategy).ranks_from_own_launcher
    try:
        return instantiate(
            cfg.trainer,
            strategy=strategy,
            callbacks=build_callbacks(cfg, layout),
            logger=build_loggers(cfg, run_dir, layout),
            plugins=[SLURMEnvironment(auto_requeue=False)] if slurm else [],
            # Lightning logs every log_every_n_steps steps only: a shorter run would write no metrics at all.
            log_every_n_steps=min(cfg.trainer.get("log_every_n_steps", 50), cfg.trainer.max_steps),
            accumulate_grad_batches=plan.accumulate_grad_batches,
            val_check_interval=cfg.val_every_n_steps * plan.accumulate_grad_batches,
            default_root_dir=run_dir,
            check_val_every_n_epoch=None,  # the training stream has no epochs
            use_distributed_sampler=False,  # our sampler splits by data-parallel replica, not by global rank
        )
    except Exception as error:  # Lightning's word on devices, precision, strategy, wrapped by Hydra's instantiate
        cause = error.__cause__ if isinstance(error.__cause__, (ValueError, MisconfigurationException)) else error
        if not isinstance(cause, (ValueError, MisconfigurationException)) or isinstance(cause, ConfigError):
            raise
        choice = HydraConfig.get().runtime.choices.get("strategy")
        raise ConfigError(f"Lightning refused the trainer settings (trainer.*, strategy={choice}): {cause}") from error


def record_console(cfg: DictConfig, run_dir: Path) -> Callable[[], None]:
    """Known noise filtered, the console kept in the run directory, secrets out of what is written there;
    returns what puts the console back."""
    silence_known_noise()
    restore = keep_console(run_dir, launch_rank(cfg.trainer.get("num_nodes", 1)), secret_values(cfg))
    if cfg.ckpt_path is not None:
        # Resuming in its own run directory, where its checkpoints are expected; or from another run's,
        # when the best checkpoint is tracked afresh in this one.
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
    return restore


def write_hydra_record(cfg: DictConfig, run_dir: Path) -> None:
    """Hydra's record of the run in .hydra/ (config.yaml, hydra.yaml, overrides.yaml, as Hydra writes them),
    secrets redacted. conf/train.yaml keeps Hydra from writing it before any of our code runs, which would
    replace the record of a finished run with that of a start that then refuses or has nothing to do."""
    hydra, folder, secrets = HydraConfig.get(), run_dir / ".hydra", secret_values(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    records = {"config.yaml": cfg, "hydra.yaml": {"hydra": hydra}, "overrides.yaml": hydra.overrides.task}
    for name, record in records.items():
        (folder / name).write_text(redact_text(OmegaConf.to_yaml(record), secrets))


def prepare_if_needed(cfg: DictConfig) -> None:
    """With data.auto_prepare, shards missing from a local data.dir, or prepared from other settings with
    data.overwrite=true (project.config.checks refuses them otherwise), are prepared first. Every process may
    get here (torchrun, SLURM): prepare_shards lets one build, the others wait."""
    manifest = Path(cfg.data.dir) / MANIFEST_NAME
    if not cfg.data.get("auto_prepare", False) or cfg.data.get("mix") or is_remote(cfg.data.dir):
        return
    stale = manifest.is_file() and cfg.data.get("overwrite") and data_settings_differ(cfg, read_manifest(cfg.data.dir))
    if manifest.is_file() and not stale:
        return
    said = "no prepared shards" if not manifest.is_file() else "data.overwrite=true and shards from other settings"
    rank_zero_info(f"{said} in {cfg.data.dir}: preparing them from data.sources (data.auto_prepare=false skips this)")
    prepare_from_config(cast(dict, OmegaConf.to_container(cfg.data, resolve=True)))
    check_data(cfg, prepared=True)  # a process that did not merge the new shards must not train on the old ones


def train(cfg: DictConfig, layout: Layout | None = None) -> dict[str, float]:
    """Fit; `layout` is what project.config.checks.preflight planned, None where it could not (devices: auto)."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    cfg.paths.run_dir = str(run_dir)
    restore_console = record_console(cfg, run_dir)
    metrics = fit(cfg, run_dir, layout)
    # Not after an error: what the entry point then prints (the error, a failed rank's report) belongs in the log.
    restore_console()
    return metrics


def fit(cfg: DictConfig, run_dir: Path, layout: Layout | None) -> dict[str, float]:
    """Build the run from `cfg` (strategy, layout, data, module, Trainer) in `run_dir` and fit; the final metrics."""
    # Loader workers draw no random numbers (the sampler orders the data), so Lightning need not seed
    # them: its seeding function would be a Lightning import in every worker (project.data.loader_workers).
    L.seed_everything(cfg.seed, workers=False)

    strategy = instantiate(cfg.strategy, _convert_="all")
    layout = layout or plan_layout(cfg, cfg.trainer.get("num_nodes", 1), devices_per_node(cfg))
    plan = layout.plan
    contract_of(strategy).plan_batches(plan)  # the pipeline's microbatches
    trainer = build_trainer(cfg, run_dir, strategy, layout)
    requested = cfg.trainer.devices
    if str(requested).isdigit() and int(requested) != trainer.num_devices:
        strategy_name = HydraConfig.get().runtime.choices.get("strategy")
        raise ConfigError(
            f"strategy={strategy_name} runs on {trainer.num_devices} device(s) per node, not "
            f"trainer.devices={requested}: choose a multi-device strategy (strategy=ddp) or "
            f"trainer.devices={trainer.num_devices}."
        )
    limit_cpu_threads(trainer, cfg.threads_per_process)

    prepare_if_needed(cfg)
    datamodule = instantiate(
        cfg.datamodule,
        global_batch_size=plan.global_batch_size,
        micro_batch_size=plan.loader_batch_size,
        _convert_="all",
    )
    if cfg.model.vocab_size > datamodule.vocab_size:
        rank_zero_warn(
            f"model.vocab_size={cfg.model.vocab_size} is larger than the tokenizer's {datamodule.vocab_size} tokens: "
            f"{cfg.model.vocab_size - datamodule.vocab_size} embedding rows will never train. Set model.vocab_size (or "
            f"data.vocab_size, which the small presets follow) to {datamodule.vocab_size} unless you mean to grow the "
            "vocabulary."
        )
    module = instantiate(
        cfg.module,
        eos_id=datamodule.eos_id,
        # Strategies that shard the model themselves also initialize it, after sharding.
        init_on_meta=contract_of(strategy).model_on_meta,
        weights_from_checkpoint=cfg.ckpt_path is not None,
        _convert_="all",
    )
    steps_per_update = (
        f"{plan.pipeline_microbatches} pipeline microbatches"
        if plan.pipeline_microbatches > 1
        else f"{plan.accumulate_grad_batches} accumulation"
    )
    rank_zero_info(
        f"run dir: {run_dir}\nbatch: global {plan.global_batch_size} = micro {plan.micro_batch_size} x "
        f"{steps_per_update} x {plan.data_parallel_size} data-parallel replicas"
    )
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, run_dir)
    if ckpt_path is not None and (trained := checkpoint_step(ckpt_path)) >= cfg.trainer.max_steps:
        rank_zero_info(
            f"already trained to step {trained} (trainer.max_steps={cfg.trainer.max_steps}): nothing to do. To train "
            "longer, raise trainer.max_steps (and set optim.decay_steps to the original schedule's length to keep its "
            "learning rates)."
        )
        return {}
    if ckpt_path is not None:  # a checkpoint of another model or tokenizer, refused by name before anything loads
        model_cfg = cast(dict, OmegaConf.to_container(cfg.model, resolve=True))
        check_resumable(
            checkpoint_metadata(ckpt_path), model_cfg, datamodule.tokenizer_identity, ckpt_path, cfg.data.dir
        )
    if trainer.is_global_zero:  # only now: a refused or no-op start leaves the run's record as it was
        OmegaConf.save(redacted_container(cfg), run_dir / "config.yaml")
        write_hydra_record(cfg, run_dir)
    ckpt_path = resumable_by(
        trainer.strategy, ckpt_path, run_dir, module.optimizer_parameter_names(), converts=is_first_process(trainer)
    )
    watch_children(trainer.strategy.launcher)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
    if any(isinstance(callback, StopOnSignal) and callback.stopped_for_requeue for callback in callbacks):
        rank_zero_info(
            f"stopped at step {trainer.global_step}: resume with ckpt_path=last (exit status {REQUEUE_EXIT_STATUS})"
        )
        raise SystemExit(REQUEUE_EXIT_STATUS)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    rank_zero_info(
        "done: "
        + ", ".join(f"{k}={metrics[k]:.4f}" for k in ("train/loss", "val/loss") if k in metrics)
        + f"; checkpoints in {run_dir / 'checkpoints'}"
    )
    return metrics
