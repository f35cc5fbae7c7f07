"""Checks of a training run's settings that need no process group, no model and no Lightning.

`project.train` runs `preflight` before it imports torch or Lightning, so a typo is answered in about
a second instead of after the imports; the same functions run again once the Trainer has resolved
what the config left open (`trainer.devices: auto`, data prepared on the way). Nothing here imports
torch: keep it so (tests/test_checks.py watches it).
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from project.checkpoint.urls import is_remote
from project.config.callbacks import check_callbacks
from project.config.checkpoints import check_ckpt_path, check_init_from
from project.config.data import check_data, data_on_this_machine, data_settings_differ
from project.config.float8 import check_float8
from project.config.layout import Layout, horovod_devices, plan_layout
from project.config.trainer import check_trainer
from project.config.values import check_values
from project.data.shards import MANIFEST_NAME, read_manifest
from project.parallel.kinds import strategy_kind
from project.runtime.errors import ConfigError


def preflight(cfg: DictConfig, dry_run: bool = False, run_dir: str | os.PathLike | None = None) -> Layout | None:
    """Every check that the config alone allows; the layout too when the device count is explicit.
    `dry_run`: the devices asked for are those of the job, not of this machine. `run_dir`: where
    `ckpt_path=last` looks (Hydra's run directory by default)."""
    check_init_from(cfg)
    check_trainer(cfg, here=not dry_run)
    check_values(cfg)
    check_callbacks(cfg)
    check_data(cfg, shards=not dry_run or dry_run_reads_shards_here(cfg))
    check_ckpt_path(cfg, run_dir, new_runs_checked=not dry_run)
    nodes, devices = cfg.trainer.get("num_nodes", 1), cfg.trainer.get("devices", "auto")
    kind = strategy_kind(cfg.strategy)
    if kind.own_launcher:
        devices = horovod_devices(cfg, dry_run)
    if kind.single_device:
        check_one_device(cfg, nodes, devices)
    if not (isinstance(nodes, int) and isinstance(devices, int)):
        check_float8(cfg, dry_run=dry_run)
        return None
    layout = plan_layout(cfg, nodes, devices)
    check_float8(cfg, layout.shape, dry_run)
    return layout


def dry_run_reads_shards_here(cfg: DictConfig) -> bool:
    """Whether the shards data.dir names here are those the dry run's job would read, and so checked as a real start
    checks them: not where data.dir is not on this machine, nor where it holds shards prepared from other data
    settings (`make train`'s 256-token shards, for a job of 8,192-token sequences); the dry run says which
    (project.planning.dry_run.unchecked_shards) instead of refusing a job for shards that are not its own."""
    return data_on_this_machine(cfg) and not local_shards_differ(cfg)


def local_shards_differ(cfg: DictConfig) -> list[str]:
    """What of the run's data settings differs from the shards a local data.dir holds (data_settings_differ); [] where
    it holds none, or the data is a mixture or in object storage (the run's own settings are not theirs to compare)."""
    data_dir = Path(str(cfg.data.dir))
    if cfg.data.get("mix") or is_remote(str(cfg.data.dir)) or not (data_dir / MANIFEST_NAME).is_file():
        return []
    return data_settings_differ(cfg, read_manifest(data_dir))


def check_one_device(cfg: DictConfig, nodes: object, devices: object) -> None:
    """A single-device strategy takes one device whatever trainer.devices asks: refused before the imports (the
    Trainer, once built, checks what `auto` became)."""
    if not (isinstance(devices, int) and devices > 1 or isinstance(nodes, int) and nodes > 1):
        return  # one device, `auto`, or a list naming which (the Trainer counts those)
    from hydra.core.hydra_config import HydraConfig

    name = HydraConfig.get().runtime.choices.get("strategy", "single") if HydraConfig.initialized() else "single"
    asked = f"trainer.devices={devices}" if isinstance(devices, int) and devices > 1 else f"trainer.num_nodes={nodes}"
    raise ConfigError(
        f"strategy={name} runs one process on one device, not {asked}: choose a multi-device strategy "
        f"(strategy=ddp {asked}) or trainer.devices=1 trainer.num_nodes=1."
    )
