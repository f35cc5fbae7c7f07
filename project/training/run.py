"""One training run, from a composed and pre-checked config (project.train is its command line).

Builds in order: strategy -> trainer -> layout -> data -> module, and fits. With a multi-process
strategy Lightning re-runs the same command for the other local ranks (pointing them at this run's
directory), so everything here runs on every rank.
"""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from project.checkpoint.files import checkpoint_metadata, checkpoint_step, resolve_ckpt_path, resumable_by
from project.config.checks import (
    Layout,
    check_data,
    check_trainer_arguments,
    data_settings_differ,
    is_horovod,
    plan_layout,
    read_manifest,
)
from project.data.datamodule import TokenShardDataModule
from project.data.prepare import prepare_from_config
from project.data.sampler import DEFAULT_WINDOW_CHUNKS
from project.data.shards import MANIFEST_NAME
from project.data.storage import is_remote
from project.parallel.contract import contract_of
from project.runtime.console import keep_console, launch_rank, silence_known_noise
from project.runtime.errors import ConfigError
from project.runtime.processes import watch_children
from project.runtime.secrets import redact_text, redacted_container, secret_values
from project.training.callbacks import (
    BestCheckpoint,
    LayoutFacts,
    LlamaModelSummary,
    MemoryMonitor,
    StepCheckpoint,
    StepProgressBar,
    TokenThroughput,
)
from project.training.callbacks.preemption import REQUEUE_EXIT_STATUS, StopOnSignal
from project.training.lit_module import LlamaLitModule, check_resumable
from project.training.loggers import build_loggers


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


def build_trainer(cfg: DictConfig, run_dir: Path) -> L.Trainer:
    checkpoints = [
        # last.ckpt every N steps and after the final step, for resuming ...
        StepCheckpoint(
            dirpath=run_dir / "checkpoints",
            every_n_train_steps=cfg.ckpt_every_n_steps,
            every_minutes=cfg.get("ckpt_every_minutes"),
        ),
        # ... and the best model, ranked when each validation ends, so by its own val/loss.
        BestCheckpoint(
            dirpath=run_dir / "checkpoints",
            filename="best-step{step:06d}",
            auto_insert_metric_name=False,
            monitor="val/loss",
            mode="min",
            save_top_k=1,
            save_on_train_epoch_end=False,
        ),
    ]
    callbacks = [*checkpoints, TokenThroughput(cfg.peak_flops_per_device), MemoryMonitor(run_dir)]
    plugins, stop_signals = [], (signal.SIGTERM,)
    if SLURMEnvironment.detect():  # our handler checkpoints between steps; Lightning's would save mid-step
        if not is_horovod(cfg.strategy):  # under horovodrun in a batch job, Horovod gives the ranks, not SLURM's tasks
            plugins.append(SLURMEnvironment(auto_requeue=False))
        stop_signals += (signal.SIGUSR1,)
    callbacks.append(StopOnSignal(checkpoints[0], stop_signals))
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(StepProgressBar())
    if cfg.trainer.get("enable_model_summary", True):
        callbacks.append(LlamaModelSummary())
    check_trainer_arguments(cfg)
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    # Lightning logs every log_every_n_steps steps only: a shorter run would write no metrics at all.
    trainer_kwargs["log_every_n_steps"] = min(trainer_kwargs.get("log_every_n_steps", 50), trainer_kwargs["max_steps"])
    try:
        return L.Trainer(
            **trainer_kwargs,
            strategy=instantiate(cfg.strategy, _convert_="all"),
            callbacks=callbacks,
            plugins=plugins,
            logger=False,  # set once the layout, which names the run, is known
            default_root_dir=run_dir,
            check_val_every_n_epoch=None,  # validation is counted in steps: the training stream has no epochs
            use_distributed_sampler=False,  # our sampler splits by data-parallel replica, not by global rank
        )
    except (ValueError, MisconfigurationException) as error:  # Lightning's word on devices, precision, strategy
        choice = HydraConfig.get().runtime.choices.get("strategy")
        raise ConfigError(f"Lightning refused the trainer settings (trainer.*, strategy={choice}): {error}") from error


def record_console(cfg: DictConfig, run_dir: Path) -> None:
    """Known noise filtered, the console kept in the run directory, secrets out of what is written there."""
    silence_known_noise()
    keep_console(run_dir, launch_rank(cfg.trainer.get("num_nodes", 1)), secret_values(cfg))
    if cfg.ckpt_path is not None:
        # Resuming in its own run directory, where its checkpoints are expected; or from another run's,
        # when the best checkpoint is tracked afresh in this one.
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        warnings.filterwarnings("ignore", message=r"The dirpath has changed from")


def write_hydra_record(cfg: DictConfig, run_dir: Path) -> None:
    """Hydra's record of the run in .hydra/ (config.yaml, hydra.yaml, overrides.yaml, as Hydra writes them),
    secrets redacted. conf/train.yaml keeps Hydra from writing it before any of our code runs, which would
    replace the record of a finished run with that of a start that then refuses or has nothing to do."""
    hydra, folder, secrets = HydraConfig.get(), run_dir / ".hydra", secret_values(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    records = {"config.yaml": cfg, "hydra.yaml": {"hydra": hydra}, "overrides.yaml": hydra.overrides.task}
    for name, record in records.items():
        (folder / name).write_text(redact_text(OmegaConf.to_yaml(record), secrets))


def attach_loggers(trainer: L.Trainer, cfg: DictConfig, run_dir: Path, layout: Layout) -> None:
    """Loggers named after the layout, which is known only now, and the layout logged as metrics."""
    choices = HydraConfig.get().runtime.choices
    model_name, strategy_name = choices.get("model", "model"), choices.get("strategy", "strategy")
    trainer.loggers = build_loggers(
        cfg,
        run_dir,
        name=layout.name(model_name, strategy_name),
        group=os.environ.get("WANDB_SWEEP_ID") or choices.get("experiment") or None,
        tags=[strategy_name, model_name, f"{trainer.world_size}-devices"],
    )
    trainer.callbacks.append(LayoutFacts(layout.facts()))


def train(cfg: DictConfig, layout: Layout | None = None) -> dict[str, float]:
    """Fit; `layout` is what project.config.checks.preflight planned, None where it could not (devices: auto)."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    record_console(cfg, run_dir)
    # Loader workers draw no random numbers (the sampler orders the data), so Lightning need not seed
    # them: its seeding function would be a Lightning import in every worker (project.data.loader_workers).
    L.seed_everything(cfg.seed, workers=False)

    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    trainer = build_trainer(cfg, run_dir)
    requested = cfg.trainer.devices
    if str(requested).isdigit() and int(requested) != trainer.num_devices:
        raise ConfigError(
            f"strategy={HydraConfig.get().runtime.choices.get('strategy')} runs on {trainer.num_devices} device(s) per node, "
            f"not trainer.devices={requested}: choose a multi-device strategy (strategy=ddp) or trainer.devices={trainer.num_devices}."
        )
    limit_cpu_threads(trainer, cfg.threads_per_process)
    if layout is None:  # trainer.devices or num_nodes was left to Lightning
        layout = plan_layout(cfg, trainer.num_nodes, trainer.num_devices)
    plan = layout.plan
    attach_loggers(trainer, cfg, run_dir, layout)
    contract_of(trainer.strategy).plan_batches(plan)  # the pipeline's microbatches
    # The Trainer resolves devices and nodes; only then is the accumulation count known.
    trainer.accumulate_grad_batches = plan.accumulate_grad_batches
    trainer.val_check_interval = cfg.val_every_n_steps * plan.accumulate_grad_batches

    local = not cfg.data.get("mix") and not is_remote(cfg.data.dir)
    manifest = Path(cfg.data.dir) / MANIFEST_NAME
    stale = manifest.is_file() and cfg.data.get("overwrite") and data_settings_differ(cfg, read_manifest(cfg.data.dir))
    if cfg.data.get("auto_prepare", False) and local and (not manifest.is_file() or stale):
        # Missing, or prepared from other settings with data.overwrite=true (project.config.checks refuses them otherwise).
        # Every process may get here (torchrun, SLURM): prepare_shards lets one build, the others wait.
        said = "no prepared shards" if not manifest.is_file() else "data.overwrite=true and shards from other settings"
        rank_zero_info(
            f"{said} in {cfg.data.dir}: preparing them from data.sources (data.auto_prepare=false skips this)"
        )
        prepare_from_config(OmegaConf.to_container(cfg.data, resolve=True))
        check_data(cfg, prepared=True)  # a process that did not merge the new shards must not train on the old ones
    datamodule = TokenShardDataModule(
        data_dir=cfg.data.dir,
        seq_len=cfg.data.seq_len,
        global_batch_size=plan.global_batch_size,
        micro_batch_size=plan.loader_batch_size,
        seed=cfg.data.seed,
        num_workers=cfg.data.loader_workers,
        val_sequences=cfg.val_sequences,
        allow_repeats=cfg.data.get("allow_repeats", False),
        mix=OmegaConf.to_container(cfg.data.mix, resolve=True) if cfg.data.get("mix") else None,
        shuffle_window=cfg.data.get("shuffle_window", DEFAULT_WINDOW_CHUNKS),
        cache_dir=cfg.data.get("cache_dir"),
        cache_size=cfg.data.get("cache_size"),
        storage_options=OmegaConf.to_container(cfg.data.storage_options, resolve=True)
        if cfg.data.get("storage_options")
        else None,
    )
    if model_cfg["vocab_size"] > datamodule.vocab_size:
        rank_zero_warn(
            f"model.vocab_size={model_cfg['vocab_size']} is larger than the tokenizer's {datamodule.vocab_size} tokens: "
            f"{model_cfg['vocab_size'] - datamodule.vocab_size} embedding rows will never train. Set model.vocab_size (or "
            f"data.vocab_size, which the small presets follow) to {datamodule.vocab_size} unless you mean to grow the vocabulary."
        )
    module = LlamaLitModule(
        model=model_cfg,
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        document_mask=cfg.document_mask,
        eos_id=datamodule.eos_id,
        # Strategies that shard the model themselves also initialize it, after sharding.
        init_on_meta=contract_of(trainer.strategy).model_on_meta,
        weights_from_checkpoint=cfg.ckpt_path is not None,
        init_from=cfg.get("init_from"),
        init_seed=cfg.seed,
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
            f"already trained to step {trained} (trainer.max_steps={cfg.trainer.max_steps}): nothing to do. To train longer, "
            "raise trainer.max_steps (and set optim.decay_steps to the original schedule's length to keep its learning rates)."
        )
        return {}
    if ckpt_path is not None:  # a checkpoint of another model or tokenizer, refused by name before anything loads
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
    if any(isinstance(callback, StopOnSignal) and callback.stopped_for_requeue for callback in trainer.callbacks):
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
