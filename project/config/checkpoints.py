"""ckpt_path and init_from: the checkpoint or published folder a run starts from, checked before torch."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from project.checkpoint.urls import check_url, is_remote
from project.parallel.kinds import strategy_kind
from project.runtime.errors import ConfigError


def checkpoint_dir(cfg: DictConfig, run_dir: str | os.PathLike) -> str:
    """Where the run's checkpoints go: `ckpt_dir`, a local folder or an s3:// URL; by default the run directory's
    checkpoints/."""
    value = cfg.get("ckpt_dir")
    return str(value).rstrip("/") if value else str(Path(run_dir) / "checkpoints")


def check_ckpt_dir(cfg: DictConfig) -> None:
    """An object-storage `ckpt_dir` is one the platform writes to (S3), with a strategy that can."""
    value = cfg.get("ckpt_dir")
    for setting, url in (("ckpt_dir", value), ("ckpt_path", cfg.get("ckpt_path"))):
        if is_remote(url):
            check_url(url, setting)
    if is_remote(value) and strategy_kind(cfg.get("strategy", {})).local_checkpoints:
        raise ConfigError(
            f"ckpt_dir={value} with strategy=fsdp: FSDP1 writes its checkpoints to local folders only. Use "
            "strategy=fsdp2 (the same sharding, and what the platform recommends), or a local ckpt_dir."
        )


def check_ckpt_path(cfg: DictConfig, run_dir: str | os.PathLike | None = None) -> None:
    """A checkpoint named by path exists; `last`, that of the run directory `run_dir` (Hydra's, by default), or of
    `ckpt_dir`. One in object storage is looked for when the run starts (this check reads no network)."""
    check_ckpt_dir(cfg)
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is None or is_remote(ckpt_path):
        return
    if str(ckpt_path) == "last":
        if run_dir is None and HydraConfig.initialized():
            run_dir = HydraConfig.get().runtime.output_dir
        if run_dir is None and not cfg.get("ckpt_dir"):
            return
        folder = checkpoint_dir(cfg, run_dir or ".")
        if is_remote(folder):
            return
        path = Path(folder) / "last.ckpt"
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
