"""Loggers: a CSV file in the run directory always; wandb when the logger group asks for it."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf


def wandb_mode(mode: str) -> str:
    """'auto' -> online when the user is logged in (WANDB_API_KEY or `wandb login`'s netrc entry), else offline."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return "online" if netrc.netrc().authenticators(host) else "offline"
    except (FileNotFoundError, netrc.NetrcParseError):
        return "offline"


def build_loggers(cfg: DictConfig, run_dir: Path) -> list[Logger]:
    # name="" and version="" put metrics.csv and hparams.yaml directly in the run directory.
    loggers: list[Logger] = [CSVLogger(save_dir=run_dir, name="", version="")]
    wandb_cfg = cfg.logger.get("wandb")
    if wandb_cfg is not None:
        loggers.append(
            WandbLogger(
                project=wandb_cfg.project,
                name=wandb_cfg.name or run_dir.name,
                group=wandb_cfg.get("group"),
                tags=list(wandb_cfg.get("tags") or []),
                save_dir=str(run_dir),
                mode=wandb_mode(wandb_cfg.mode),
                config=OmegaConf.to_container(cfg, resolve=True),
            )
        )
    return loggers
