"""Train a Llama: `python -m project.train experiment=NAME [overrides]`.

Composes the config, then builds in order: strategy -> trainer -> batch plan -> data -> module,
and fits. With a multi-process strategy Lightning re-runs this same command for the other local
ranks (pointing them at this run's directory), so everything here runs on every rank.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from project.callbacks import MemoryMonitor, StepCheckpoint, StepProgressBar, TokenThroughput
from project.checkpoints import checkpoint_step, previous_checkpoint, resumable_by
from project.data.datamodule import TokenShardDataModule
from project.data.prepare import prepare_from_config
from project.errors import ConfigError, exit_on_config_error
from project.lit_module import LlamaLitModule
from project.loggers import build_loggers
from project.model import LlamaConfig
from project.parallel import mesh_shape, plan_batches, plan_pipeline_batches
from project.parallel.pipeline import check_pipeline
from project.parallel.pipeline_strategy import LlamaPipelineStrategy
from project.parallel.tensor_parallel import check_tensor_parallel_degree


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> str | None:
    if ckpt_path is None:
        return None
    path = run_dir / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    previous = previous_checkpoint(path)
    if not path.exists() and previous is not None:
        rank_zero_info(f"{path} was being replaced when the run stopped: resuming from the previous one")
        path = previous
    if not path.exists():  # a file, or a folder from a sharded strategy
        hint = (
            " `ckpt_path=last` resumes the run in this run directory: pass the directory of the run to resume "
            "as hydra.run.dir=DIR."
            if ckpt_path == "last"
            else ""
        )
        raise ConfigError(f"ckpt_path={ckpt_path}: no checkpoint at {path}.{hint}")
    return str(path)


def limit_cpu_threads(trainer: L.Trainer, threads_per_process: int | None) -> None:
    # Several processes sharing a few cores thrash if each takes all threads (about 30x slower on 2 cores).
    # Runs before fit, so the ranks Lightning launches inherit the setting.
    if isinstance(trainer.accelerator, CPUAccelerator) and trainer.num_devices > 1:
        threads = threads_per_process or 1
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def is_first_process(trainer: L.Trainer) -> bool:
    """Global rank 0, known before the process group exists: from torchrun's or SLURM's variables,
    or, under Lightning's own launcher, from being the process that launches the others."""
    env = getattr(trainer.strategy, "cluster_environment", None)
    return env is None or (env.global_rank() == 0 and env.local_rank() == 0 and env.node_rank() == 0)


# Derived from the batch plan and the step-based schedule; a value set by hand would silently disagree.
COMPUTED_TRAINER_KEYS = {
    "accumulate_grad_batches": "set global_batch_size and micro_batch_size instead",
    "val_check_interval": "set val_every_n_steps instead",
    "check_val_every_n_epoch": "set val_every_n_steps instead",
    "gradient_clip_val": "set optim.grad_clip instead (the module clips and logs the norm)",
    "use_distributed_sampler": "the data module splits the data by data-parallel replica itself",
}


def build_trainer(cfg: DictConfig, run_dir: Path) -> L.Trainer:
    if cfg.trainer.get("max_steps", -1) in (None, -1):
        raise ConfigError("trainer.max_steps must be set: training length is counted in optimizer steps.")
    for key, fix in COMPUTED_TRAINER_KEYS.items():
        if key in cfg.trainer:
            raise ConfigError(f"trainer.{key} is computed by project.train: {fix}.")
    checkpoints = [
        # last.ckpt every N steps and after the final step, for resuming ...
        StepCheckpoint(dirpath=run_dir / "checkpoints", every_n_train_steps=cfg.ckpt_every_n_steps),
        # ... and the best model, ranked when each validation ends, so by its own val/loss.
        ModelCheckpoint(
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
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(StepProgressBar())
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        reason = (
            f"this torch ({torch.__version__}) is a CPU build: on a GPU machine install a CUDA build, e.g. "
            '`make install TORCH="torch==2.11.0"`'
            if torch.version.cuda is None
            else f"this torch (CUDA {torch.version.cuda}) sees no GPU: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
        )
        raise ConfigError(f"trainer.accelerator={accelerator} (trainer=gpu) needs a CUDA GPU, but {reason}; or train on the CPU with trainer=cpu.")
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    # Lightning logs every log_every_n_steps steps only: a shorter run would write no metrics at all.
    trainer_kwargs["log_every_n_steps"] = min(trainer_kwargs.get("log_every_n_steps", 50), trainer_kwargs["max_steps"])
    strategy, loggers = instantiate(cfg.strategy, _convert_="all"), build_loggers(cfg, run_dir)
    try:
        return L.Trainer(
            **trainer_kwargs,
            strategy=strategy,
            callbacks=callbacks,
            logger=loggers,
            default_root_dir=run_dir,
            check_val_every_n_epoch=None,  # validation is counted in steps: the training stream has no epochs
            use_distributed_sampler=False,  # our sampler splits by data-parallel replica, not by global rank
        )
    except (ValueError, MisconfigurationException) as error:  # Lightning's word on devices, precision, strategy
        choice = HydraConfig.get().runtime.choices.get("strategy")
        raise ConfigError(f"Lightning refused the trainer settings (trainer.*, strategy={choice}): {error}") from error


def train(cfg: DictConfig) -> dict[str, float]:
    logging.getLogger("litdata").setLevel(logging.WARNING)  # per-chunk INFO lines drown the progress bar
    # Lightning advertises a cloud logger on every run.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda record: not str(record.msg).startswith("💡"))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    L.seed_everything(cfg.seed, workers=True)

    trainer = build_trainer(cfg, run_dir)
    requested = cfg.trainer.devices
    if str(requested).isdigit() and int(requested) != trainer.num_devices:
        raise ConfigError(
            f"strategy={HydraConfig.get().runtime.choices.get('strategy')} runs on {trainer.num_devices} device(s) per node, "
            f"not trainer.devices={requested}: choose a multi-device strategy (strategy=ddp) or trainer.devices={trainer.num_devices}."
        )
    limit_cpu_threads(trainer, cfg.threads_per_process)
    strategy_cfg = OmegaConf.to_container(cfg.strategy, resolve=True)
    shape = mesh_shape(strategy_cfg, trainer.num_nodes * trainer.num_devices, trainer.num_devices)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    if shape.tensor_parallel > 1:
        sequence_parallel = strategy_cfg.get("sequence_parallel", False)
        check_tensor_parallel_degree(LlamaConfig(**model_cfg), shape.tensor_parallel, cfg.data.seq_len if sequence_parallel else None)
    if isinstance(trainer.strategy, LlamaPipelineStrategy):
        plan = plan_pipeline_batches(cfg.global_batch_size, shape.data_parallel, cfg.micro_batch_size, strategy_cfg.get("n_microbatches"))
        pipeline = trainer.strategy
        check_pipeline(
            LlamaConfig(**model_cfg), pipeline.schedule, shape, pipeline.virtual_stages, plan.pipeline_microbatches,
            pipeline.stage_layers, pipeline.compile, pipeline.param_dtype,
        )
        pipeline.n_microbatches, pipeline.micro_batch_size = plan.pipeline_microbatches, plan.micro_batch_size
    else:
        plan = plan_batches(cfg.global_batch_size, shape.data_parallel, cfg.micro_batch_size)
    # The Trainer resolves devices and nodes; only then is the accumulation count known.
    trainer.accumulate_grad_batches = plan.accumulate_grad_batches
    trainer.val_check_interval = cfg.val_every_n_steps * plan.accumulate_grad_batches

    if cfg.data.get("auto_prepare", False) and not (Path(cfg.data.dir) / "manifest.json").is_file():
        # Every process may get here (torchrun, SLURM): prepare_shards lets one build, the others wait.
        rank_zero_info(f"no prepared shards in {cfg.data.dir}: preparing them from data.sources (data.auto_prepare=false skips this)")
        prepare_from_config(OmegaConf.to_container(cfg.data, resolve=True))
    datamodule = TokenShardDataModule(
        data_dir=cfg.data.dir,
        seq_len=cfg.data.seq_len,
        global_batch_size=plan.global_batch_size,
        micro_batch_size=plan.loader_batch_size,
        seed=cfg.data.seed,
        num_workers=cfg.data.loader_workers,
        val_sequences=cfg.val_sequences,
        allow_repeats=cfg.data.get("allow_repeats", False),
    )
    if model_cfg["vocab_size"] < datamodule.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_cfg['vocab_size']} is smaller than the tokenizer's {datamodule.vocab_size} "
            f"(shards in {cfg.data.dir}): set model.vocab_size={datamodule.vocab_size} or more."
        )
    if model_cfg["vocab_size"] > datamodule.vocab_size:
        rank_zero_warn(
            f"model.vocab_size={model_cfg['vocab_size']} is larger than the tokenizer's {datamodule.vocab_size} tokens: "
            f"{model_cfg['vocab_size'] - datamodule.vocab_size} embedding rows will never train. Set model.vocab_size (or "
            f"data.vocab_size, which the small presets follow) to {datamodule.vocab_size} unless you mean to grow the vocabulary."
        )
    if cfg.data.seq_len > model_cfg["max_seq_len"]:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={model_cfg['max_seq_len']}.")
    module = LlamaLitModule(
        model=model_cfg,
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        document_mask=cfg.document_mask,
        eos_id=datamodule.eos_id,
        # Strategies that shard the model themselves also initialize it, after sharding.
        init_on_meta=hasattr(trainer.strategy, "parallelize"),
        weights_from_checkpoint=cfg.ckpt_path is not None,
    )
    if trainer.is_global_zero:
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    steps_per_update = (
        f"{plan.pipeline_microbatches} pipeline microbatches" if plan.pipeline_microbatches > 1 else f"{plan.accumulate_grad_batches} accumulation"
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
    ckpt_path = resumable_by(
        trainer.strategy, ckpt_path, run_dir, module.optimizer_parameter_names(), converts=is_first_process(trainer)
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    rank_zero_info(
        "done: "
        + ", ".join(f"{k}={metrics[k]:.4f}" for k in ("train/loss", "val/loss") if k in metrics)
        + f"; checkpoints in {run_dir / 'checkpoints'}"
    )
    return metrics


def forget_refused_run(run_dir: Path) -> None:
    """Remove the directory Hydra made for a run that was refused before it started: it holds only
    Hydra's record (.hydra/, train.log), and would read as a run that trained. Anything else in it stays."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", "train.log"}:
        shutil.rmtree(run_dir, ignore_errors=True)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    with exit_on_config_error():
        try:
            return train(cfg).get("val/loss")
        except ConfigError:
            forget_refused_run(Path(HydraConfig.get().runtime.output_dir))
            raise


if __name__ == "__main__":
    main()
