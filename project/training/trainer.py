"""The Lightning Trainer of a run, built once from conf/trainer with what the run computes (strategy, callbacks,
loggers, accumulation, validation interval), and what is asked of it before fit: the devices it took, the threads
of each process, whether this process is the first."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.accelerators import AcceleratorRegistry, CPUAccelerator
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelSummary, ProgressBar
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from project.config.callbacks import build_callback, callbacks_of
from project.config.layout import Layout
from project.config.optim import OptimConfig
from project.config.trainer import check_trainer_arguments
from project.parallel.contract import contract_of
from project.runtime.errors import ConfigError
from project.runtime.secrets import redacted_container, secret_values
from project.training.callbacks import CollectiveTimeouts, LayoutFacts, StepCheckpoint, StepProgressBar
from project.training.callbacks.preemption import StopOnSignal
from project.training.callbacks.run_settings import RunSettings, flat_settings
from project.training.loggers import RunIdentity
from project.training.schedule import schedule_record


def limit_cpu_threads(trainer: L.Trainer, threads_per_process: int | None) -> None:
    # Several processes sharing a few cores thrash if each takes all threads (about 30x slower on 2 cores).
    # Runs before fit, so the ranks Lightning launches inherit the setting.
    # A strategy whose processes another launcher started (Horovod) says how many share this node.
    processes_here = contract_of(trainer.strategy).processes_per_node(trainer)
    if isinstance(trainer.accelerator, CPUAccelerator) and processes_here > 1:
        threads = threads_per_process or 1
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


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
    """conf/callbacks' (those the trainer settings leave on), each checked as it is built (project.config.callbacks),
    the layout's facts, the stop on a signal and the collective timeouts (not the user's to remove: the strategies make
    their groups with the start-up bound, which only CollectiveTimeouts lowers)."""
    callbacks = [build_callback(name, node) for name, node in callbacks_of(cfg)]
    if sum(isinstance(c, ProgressBar) for c in callbacks) > 1:  # callbacks=rich_progress, or one added by name:
        callbacks = [c for c in callbacks if type(c) is not StepProgressBar]  # Lightning takes one bar only
    if not cfg.trainer.get("enable_progress_bar", True):
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    if not cfg.trainer.get("enable_model_summary", True):
        callbacks = [c for c in callbacks if not isinstance(c, ModelSummary)]
    stop_signals = (signal.SIGTERM, signal.SIGINT, *((signal.SIGUSR1,) if SLURMEnvironment.detect() else ()))
    step_checkpoints = [c for c in callbacks if isinstance(c, StepCheckpoint)]
    if step_checkpoints:  # without one (~callbacks.last_checkpoint), a signal stops the run as Lightning does
        callbacks.append(StopOnSignal(step_checkpoints[0], stop_signals))
    strategy = cfg.strategy
    callbacks.append(
        CollectiveTimeouts(strategy.get("startup_timeout_minutes"), strategy.get("collective_timeout_minutes"))
    )
    optim = cast(dict[str, Any], OmegaConf.to_container(cfg.optim, resolve=True))
    schedule = schedule_record(OptimConfig(**optim), cfg.trainer.max_steps)
    settings = RunSettings(flat_settings(redacted_container(cfg)), schedule)
    return [*callbacks, LayoutFacts(layout.facts(), layout_name(layout)), settings]


def layout_name(layout: Layout) -> str:
    """The layout's name (Layout.name) with the model preset and strategy the run composed."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    return layout.name(choices.get("model", "model"), choices.get("strategy", "strategy"))


def build_loggers(cfg: DictConfig, run_dir: Path, layout: Layout) -> list[Logger]:
    """conf/logger's loggers, each told the run it logs: named after the layout, grouped by sweep or experiment."""
    choices = HydraConfig.get().runtime.choices
    model_name, strategy_name = choices.get("model", "model"), choices.get("strategy", "strategy")
    run = RunIdentity(
        dir=run_dir,
        name=layout_name(layout),
        group=os.environ.get("WANDB_SWEEP_ID") or choices.get("experiment") or None,
        tags=[strategy_name, model_name, f"{layout.shape.world_size}-devices"],
        config=redacted_container(cfg),
        has_secrets=bool(secret_values(cfg)),
    )
    return [instantiate(node)(run) for node in cfg.logger.values() if node is not None]


def cluster_plugins(strategy: Strategy) -> list[SLURMEnvironment]:
    """SLURM's environment in a SLURM job, without its requeue on a signal: our handler checkpoints between steps,
    Lightning's would save mid-step. A strategy with a cluster environment of its own (Horovod's: horovodrun gives
    the ranks, also in a batch job) keeps it, as Lightning takes only one."""
    own = isinstance(strategy, ParallelStrategy) and strategy.cluster_environment is not None
    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() and not own else []


def build_trainer(cfg: DictConfig, run_dir: Path, strategy: Strategy, layout: Layout) -> L.Trainer:
    """lightning.Trainer from conf/trainer, with what the run computes: the strategy, callbacks and loggers, and the
    layout's accumulation and validation interval (validation is counted in optimizer steps)."""
    check_trainer_arguments(cfg)
    plan = layout.plan
    callbacks = build_callbacks(cfg, layout)
    try:
        return instantiate(
            cfg.trainer,
            strategy=strategy,
            callbacks=callbacks,
            # Lightning adds a ModelCheckpoint of its own (epoch=...ckpt) to a run without a Checkpoint callback:
            # StepCheckpoint and BestCheckpoint are ours, and a run that leaves both out wants none.
            enable_checkpointing=cfg.trainer.get("enable_checkpointing", True)
            and any(isinstance(c, Checkpoint) for c in callbacks),
            logger=build_loggers(cfg, run_dir, layout),
            plugins=cluster_plugins(strategy),
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


def check_devices(cfg: DictConfig, trainer: L.Trainer) -> None:
    """A single-device strategy takes one device whatever trainer.devices asks: refuse the difference. And
    strategy.float8 on a GPU without float8 products, refused here, before the data is prepared and the model built
    (the checks before the imports cannot see the node's GPUs)."""
    recipe = cfg.strategy.get("float8")
    if recipe is not None:
        from project.parallel.float8 import refuse_device_without_float8

        refuse_device_without_float8(recipe, trainer.strategy.root_device)
    requested = cfg.trainer.devices
    if str(requested).isdigit() and int(requested) != trainer.num_devices:
        strategy_name = HydraConfig.get().runtime.choices.get("strategy")
        raise ConfigError(
            f"strategy={strategy_name} runs on {trainer.num_devices} device(s) per node, not "
            f"trainer.devices={requested}: choose a multi-device strategy (strategy=ddp) or "
            f"trainer.devices={trainer.num_devices}."
        )
