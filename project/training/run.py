"""One training run, from a composed and pre-checked config (project.train is its command line).

Builds in order: strategy -> layout -> Trainer (project.training.trainer) -> data -> module, and fits. With a
multi-process strategy Lightning re-runs the same command for the other local ranks (pointing them at this run's
directory), so everything here runs on every rank.
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, cast

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from project.checkpoint.files import checkpoint_metadata, checkpoint_step, resolve_ckpt_path
from project.checkpoint.latest import latest, refuse_another_runs
from project.checkpoint.locations import check_reachable, exists, join, use_object_storage
from project.config.checkpoints import AUTO, checkpoint_dir, resume_point
from project.config.data import check_data, data_settings_differ
from project.config.layout import Layout, plan_layout
from project.data.datamodule import TokenShardDataModule
from project.data.prepare import prepare_from_config
from project.data.shards import MANIFEST_NAME, read_manifest
from project.data.storage import is_remote
from project.parallel.batch import BatchPlan
from project.parallel.contract import contract_of
from project.runtime.console import keep_console, launch_rank, silence_known_noise
from project.runtime.processes import watch_children
from project.runtime.secrets import redact_text, redacted_container, secret_values
from project.training.callbacks.evaluation import HeldOutEvaluation
from project.training.callbacks.preemption import REQUEUE_EXIT_STATUS, StopOnSignal
from project.training.callbacks.starting_point import SameStartOnEveryRank
from project.training.lit_module import check_resumable
from project.training.stability import Rollback, RollbackRequested, describe, escalate
from project.training.trainer import build_trainer, check_devices, devices_per_node, limit_cpu_threads


def record_console(cfg: DictConfig, run_dir: Path) -> Callable[[], None]:
    """Known noise filtered, the console kept in the run directory, secrets out of what is written there;
    returns what puts the console back."""
    silence_known_noise()
    restore = keep_console(run_dir, launch_rank(cfg.trainer.get("num_nodes", 1)), secret_values(cfg))
    if cfg.ckpt_path is not None:
        expect_checkpoints()
    return restore


def expect_checkpoints() -> None:
    """Resuming in its own run directory, where its checkpoints are expected (also after a rollback); or from
    another run's, when the best checkpoint is tracked afresh in this one: Lightning's warnings say nothing new."""
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
    cfg.ckpt_dir = checkpoint_dir(cfg, run_dir)  # the callbacks' folder (conf/callbacks), as the record says
    if is_remote(cfg.ckpt_dir) or is_remote(cfg.ckpt_path):
        use_object_storage()  # before the callbacks are built: Lightning's ModelCheckpoint reaches s3:// by fsspec
        for setting in ("ckpt_dir", "ckpt_path"):
            if is_remote(cfg[setting]):
                check_reachable(cfg[setting], setting)
    auto = str(cfg.ckpt_path) == AUTO
    if (
        auto
    ):  # decided once, here: the rest of the run sees `last`, a save of its own or None, and its record says which
        cfg.ckpt_path = resume_point(cfg, run_dir)
    if is_remote(cfg.ckpt_dir):
        refuse_another_runs(cfg.ckpt_dir, cfg.ckpt_path)
    restore_console = record_console(cfg, run_dir)
    if auto:
        if cfg.ckpt_path is None:
            rank_zero_info(f"ckpt_path=auto: no checkpoint in {cfg.ckpt_dir} yet: starting the run")
        elif cfg.ckpt_path == "last":
            rank_zero_info(f"ckpt_path=auto: resuming the run from its last checkpoint in {cfg.ckpt_dir}")
        else:
            rank_zero_info(
                f"ckpt_path=auto: resuming the run from {cfg.ckpt_path}, its newest whole save (no last.ckpt)"
            )
    metrics = fit(cfg, run_dir, layout)
    # Not after an error: what the entry point then prints (the error, a failed rank's report) belongs in the log.
    restore_console()
    return metrics


@dataclass
class Restart:
    """Where a run rolled back after a loss spike goes on from: a checkpoint (None: the initial weights) and a data
    position, with every rollback so far (project.training.stability)."""

    ckpt_path: str | None
    sample: int
    rollbacks: list[Rollback] = field(default_factory=list)


def fit(cfg: DictConfig, run_dir: Path, layout: Layout | None) -> dict[str, float]:
    """Build the run from `cfg` in `run_dir` and fit; the final metrics. Under stability.action=rollback a loss
    spike ends the fit on every rank alike, and the run is built again from its last checkpoint, reading on past
    the spike's batches (`restart_after`)."""
    restart: Restart | None = None
    StopOnSignal.forget_handed_on()  # a signal stays within the run it reached (rollbacks hand it on)
    while True:
        try:
            return fit_once(cfg, run_dir, layout, restart)
        except RollbackRequested as spike:
            restart = restart_after(cfg, run_dir, spike, restart)
            expect_checkpoints()
        # Out of the handler, the old Trainer and module are unreferenced: their memory goes before the new ones'.
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def fit_once(cfg: DictConfig, run_dir: Path, layout: Layout | None, restart: Restart | None) -> dict[str, float]:
    """Build the run (strategy, layout, Trainer, data, module) and fit, from `restart` where it restarts."""
    # Loader workers draw no random numbers (the sampler orders the data), so Lightning need not seed
    # them: its seeding function would be a Lightning import in every worker (project.data.loader_workers).
    L.seed_everything(cfg.seed, workers=False)
    strategy = instantiate(cfg.strategy, _convert_="all")
    layout = layout or plan_layout(cfg, cfg.trainer.get("num_nodes", 1), devices_per_node(cfg))
    contract_of(strategy).plan_batches(layout.plan)  # the pipeline's microbatches
    contract_of(strategy).save_in_background(bool(cfg.get("ckpt_async", False)))
    trainer = build_trainer(cfg, run_dir, strategy, layout)
    check_devices(cfg, trainer)
    limit_cpu_threads(trainer, cfg.threads_per_process)
    prepare_if_needed(cfg)
    datamodule = build_datamodule(cfg, layout.plan, restart.sample if restart else None)
    ckpt_path = restart.ckpt_path if restart else resolve_ckpt_path(cfg.ckpt_path, checkpoint_dir(cfg, run_dir))
    module = instantiate(
        cfg.module,
        eos_id=datamodule.eos_id,
        init_on_meta=contract_of(strategy).model_on_meta,  # a strategy that shards the model initializes it
        weights_from_checkpoint=ckpt_path is not None,
        rollbacks=[vars(r) for r in restart.rollbacks] if restart else None,  # plain values, as Hydra passes them
        _convert_="all",
    )
    announce(run_dir, layout.plan)
    # The checkpoint's records (its step, model and tokenizer), read once: by every rank, as no process group joins
    # them before the fit (SameStartOnEveryRank then checks that they all start from the same checkpoint).
    records = checkpoint_metadata(ckpt_path) if ckpt_path is not None else None
    if records is not None and restart is None and trained_to_the_end(cfg, int(records["global_step"])):
        return {}
    if records is not None:  # a checkpoint of another model or tokenizer, refused by name before anything loads
        model_cfg = cast(dict, OmegaConf.to_container(cfg.model, resolve=True))
        check_resumable(records, model_cfg, datamodule.tokenizer_identity, ckpt_path, cfg.data.dir)
    if trainer.is_global_zero and restart is None:  # only now: a refused or no-op start leaves the run's record
        OmegaConf.save(redacted_container(cfg), run_dir / "config.yaml")
        write_hydra_record(cfg, run_dir)
    if restart is None:  # the launcher that started this node's other ranks: the first fit's (Lightning's launcher
        # set LOCAL_RANK on this rank when it did, so that a later fit in the process launches nothing)
        watch_children(trainer.strategy.launcher)
    trainer.callbacks.append(SameStartOnEveryRank(ckpt_path))  # type: ignore[attr-defined]  # Lightning's list
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    finally:  # after Lightning's teardown, which puts back the handlers it found as the fit started: this fit's
        for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning, undeclared
            if isinstance(callback, StopOnSignal):
                callback.restore()
    return finish(trainer, checkpoint_dir(cfg, run_dir))


def restart_after(cfg: DictConfig, run_dir: Path, spike: RollbackRequested, previous: Restart | None) -> Restart:
    """The restart a spike asks for: from the latest checkpoint of this run's own trajectory (one the fit loaded or
    wrote) at or before the spike's step: the run directory's last.ckpt, else the checkpoint the fit started from,
    else the initial weights; reading on from the batch after the spike's and stability.skip_batches more, so that
    the batches read since that checkpoint are left out too; its cooldown recorded. Said, and written to
    stability.jsonl."""
    stability, spike_step = cfg.stability, int(spike.event["step"])
    ckpt_dir = checkpoint_dir(cfg, run_dir)
    started_from = previous.ckpt_path if previous is not None else resolve_ckpt_path(cfg.ckpt_path, ckpt_dir)
    ckpt_path: str | None = None
    last = latest(ckpt_dir) if is_remote(ckpt_dir) else join(Path(ckpt_dir), "last.ckpt")
    for candidate in (last, started_from):
        if candidate is not None and exists(candidate):
            step = checkpoint_step(candidate)
            if step in spike.checkpoint_steps and step <= spike_step:
                ckpt_path = str(candidate)
                break
    restart_step = checkpoint_step(ckpt_path) if ckpt_path is not None else 0
    plan = escalate(spike.config, spike.rollbacks, spike.event, restart_step, spike.record)  # or stops the run
    batch = spike.global_batch_size
    # The fit read on without a jump since it started, so the checkpoint's position is the spike's minus its steps.
    left_out_from = spike.samples_consumed - (spike_step - restart_step) * batch
    sample = spike.samples_consumed + (1 + plan.skip_batches) * batch
    rollback = Rollback(
        spike_step=spike_step,
        restart_step=restart_step,
        resume_sample=sample,
        left_out_from=left_out_from,
        lr_scale=plan.lr_scale,
        cooldown_until=restart_step + plan.cooldown_steps,
        attempt=plan.attempt,
    )
    rollbacks = [*spike.rollbacks, rollback]
    incidents = sum(r.attempt == 1 for r in rollbacks)
    again = (
        f"; met again since the last rollback to it: attempt {plan.attempt} of stability.max_attempts="
        f"{stability.max_attempts}, leaving out {plan.skip_batches} batches after the spike's"
        + (
            f" and cooling the learning rate to {plan.lr_scale:g}x for {plan.cooldown_steps} steps"
            if plan.attempt >= 3
            else ""
        )
        if plan.attempt > 1
        else f" (incident {incidents} of stability.max_rollbacks={stability.max_rollbacks})"
    )
    rank_zero_warn(
        f"{describe(spike.event)}: {spike.kind}; rolling back to step {restart_step} "
        f"({ckpt_path or 'the initial weights'}) and reading on from sequence {sample} of the data, leaving out the "
        f"{(sample - left_out_from) // batch} batches read since{again}."
    )
    spike.record(
        {
            **spike.event,
            "action": "rollback",
            "restart_step": restart_step,
            "checkpoint": ckpt_path,
            "samples_left_out": [left_out_from, sample],
            "attempt": plan.attempt,
            "lr_scale": plan.lr_scale,
            "cooldown_steps": plan.cooldown_steps,
        }
    )
    return Restart(ckpt_path, sample, rollbacks)


def build_datamodule(cfg: DictConfig, plan: BatchPlan, continue_from_sample: int | None = None) -> TokenShardDataModule:
    """conf/train.yaml's datamodule with the batch plan's sizes (and the data position of a rollback); a model
    vocabulary beyond the tokenizer's is said."""
    position = {} if continue_from_sample is None else {"continue_from_sample": continue_from_sample}
    datamodule = instantiate(
        cfg.datamodule,
        global_batch_size=plan.global_batch_size,
        micro_batch_size=plan.loader_batch_size,
        **position,
        _convert_="all",
    )
    if cfg.model.vocab_size > datamodule.vocab_size:
        rank_zero_warn(
            f"model.vocab_size={cfg.model.vocab_size} is larger than the tokenizer's {datamodule.vocab_size} tokens: "
            f"{cfg.model.vocab_size - datamodule.vocab_size} embedding rows will never train. Set model.vocab_size (or "
            f"data.vocab_size, which the small presets follow) to {datamodule.vocab_size} unless you mean to grow the "
            "vocabulary."
        )
    return datamodule


def announce(run_dir: Path, plan: BatchPlan) -> None:
    steps_per_update = (
        f"{plan.pipeline_microbatches} pipeline microbatches"
        if plan.pipeline_microbatches > 1
        else f"{plan.accumulate_grad_batches} accumulation"
    )
    rank_zero_info(
        f"run dir: {run_dir}\nbatch: global {plan.global_batch_size} = micro {plan.micro_batch_size} x "
        f"{steps_per_update} x {plan.data_parallel_size} data-parallel replicas"
    )


def trained_to_the_end(cfg: DictConfig, trained: int) -> bool:
    """The checkpoint to resume, `trained` steps in, already reached trainer.max_steps: said, and nothing to do."""
    if trained < cfg.trainer.max_steps:
        return False
    rank_zero_info(
        f"already trained to step {trained} (trainer.max_steps={cfg.trainer.max_steps}): nothing to do. To train "
        "longer, raise trainer.max_steps (and set optim.decay_steps to the original schedule's length to keep its "
        "learning rates)."
    )
    return True


def finish(trainer: L.Trainer, ckpt_dir: str) -> dict[str, float]:
    """The final metrics, said, and where a callback stopped the run before trainer.max_steps (EarlyStopping), at
    which step and why; a run stopped by a signal exits with the status that asks for a requeue."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
    if any(isinstance(callback, StopOnSignal) and callback.stopped_for_requeue for callback in callbacks):
        rank_zero_info(
            f"stopped at step {trainer.global_step}: resume with ckpt_path=last (exit status {REQUEUE_EXIT_STATUS})"
        )
        raise SystemExit(REQUEUE_EXIT_STATUS)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    said = ", ".join(f"{k}={metrics[k]:.4f}" for k in ("train/loss", "val/loss") if k in metrics)
    evaluated = next((c.last_metrics for c in callbacks if isinstance(c, HeldOutEvaluation)), {})
    if evaluated:  # the last in-loop evaluation's figures (conf/eval), its time left out
        said += "".join(f", {k}={v:.4f}" for k, v in evaluated.items() if k != "eval/seconds")
    if trainer.global_step < trainer.max_steps:  # trainer.should_stop, set by a callback (a signal's stop is above)
        # Still a line that starts with `done: `: the run ended as asked (a resume of it has nothing to do).
        reasons = [
            f"by EarlyStopping ({callback.stopping_reason_message.removesuffix(' Signaling Trainer to stop.')})"
            for callback in callbacks
            if isinstance(callback, EarlyStopping) and callback.stopping_reason_message
        ]
        said = (
            f"stopped early at step {trainer.global_step} of trainer.max_steps={trainer.max_steps} "
            f"{reasons[0] if reasons else 'by a callback'}; {said}"
        )
    rank_zero_info(f"done: {said}; checkpoints in {ckpt_dir}")
    return metrics
