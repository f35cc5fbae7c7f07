"""Loggers: a CSV file in the run directory always; wandb when the logger group asks for it."""

from __future__ import annotations

import csv
import netrc
import os
import secrets
from argparse import Namespace
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor


def wandb_mode(mode: str) -> str:
    """'auto' -> online when the user is logged in (WANDB_API_KEY or `wandb login`'s netrc entry), else offline."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return "online" if netrc.netrc(os.environ.get("NETRC")).authenticators(host) else "offline"
    except (FileNotFoundError, netrc.NetrcParseError):
        return "offline"


@dataclass(frozen=True)
class RunIdentity:
    """What a logger is told of the run it logs, known only once the layout is: each logger of conf/logger is a
    partial that the run calls with this."""

    dir: Path
    name: str  # the layout's, e.g. small10m_dp2-tp1-pp1_mb8_ddp
    group: str | None  # the sweep's id under a wandb agent, else the experiment's name
    tags: list[str]  # the strategy, the model and the device count
    config: dict[str, Any]  # the run's config, secrets redacted
    has_secrets: bool


class RunCSVLogger(Logger):
    """metrics.csv and hparams.yaml directly in the run directory, kept across resumes.

    Lightning's CSVLogger deletes an existing metrics.csv; a resumed run continues it instead. Rows the interrupted
    run logged after its last checkpoint are replayed by the resumed run, so the first step this run logs drops every
    older row at that step or later. Each row is written as it is logged (a run killed later has the metrics of every
    step it checkpointed), and a file rewritten whole (a column that first appears: val/loss, checkpoint/*; the rows
    dropped on resume) is made beside it and renamed into place, so a run killed meanwhile keeps the rows it had.
    """

    def __init__(self, run: RunIdentity):
        super().__init__()
        self.run_dir = Path(run.dir)
        self.metrics_file = self.run_dir / "metrics.csv"
        self.hparams: dict[str, Any] = {}
        self.columns: list[str] | None = None  # metrics.csv's header, once this run has read or written it

    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.run_dir)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        self.hparams.update(vars(params) if isinstance(params, Namespace) else params)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_hparams_to_yaml(self.run_dir / "hparams.yaml", self.hparams)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        row: dict[str, Any] = {k: v.item() if isinstance(v, Tensor) else v for k, v in metrics.items()}
        row["step"] = step if step is not None else 0
        if self.columns is None:  # this run's first row: continue a resumed run's file from this step
            self.columns = self._read_header()
            if self.columns:
                rows = self._read_rows()
                if len(kept := [old for old in rows if int(old["step"]) < row["step"]]) < len(rows):
                    self._replace_whole(self.columns, kept)
        if new := set(row) - set(self.columns):
            self.columns = sorted({*self.columns, *new})
            self._replace_whole(self.columns, self._read_rows() if self.metrics_file.exists() else [])
        with self.metrics_file.open("a", newline="") as file:
            csv.DictWriter(file, fieldnames=self.columns).writerow(row)

    def _read_header(self) -> list[str]:
        if not self.metrics_file.is_file():
            return []
        with self.metrics_file.open(newline="") as file:
            return list(csv.DictReader(file).fieldnames or [])

    def _read_rows(self) -> list[dict[str, str]]:
        with self.metrics_file.open(newline="") as file:
            return list(csv.DictReader(file))

    def _replace_whole(self, columns: list[str], rows: list[dict[str, Any]]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        partial = self.metrics_file.with_name(f"{self.metrics_file.name}.partial")
        with partial.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        partial.replace(self.metrics_file)


def wandb_run_id(run_dir: Path) -> str:
    """The wandb run id of this run directory, created once (every rank reads the same file); under a
    wandb agent, the sweep run's own id, which wandb would use whatever we pass."""
    path = run_dir / "wandb_id"
    run_dir.mkdir(parents=True, exist_ok=True)
    if os.environ.get("WANDB_RUN_ID") and not path.exists():
        path.write_text(os.environ["WANDB_RUN_ID"])
    try:  # exclusive create: with ranks started together (torchrun, srun), the first writer wins
        with open(path, "x") as f:
            f.write(secrets.token_hex(4))
    except FileExistsError:
        pass
    return path.read_text().strip()


def run_wandb_logger(
    run: RunIdentity,
    project: str,
    name: str | None = None,
    group: str | None = None,
    tags: list[str] | None = None,
    mode: str = "auto",
) -> WandbLogger:
    """wandb, continuing the run directory's own wandb run; `name`, `group` and `tags` add to or replace the run's."""
    import wandb  # here, not at the top: 0.8 s of every process's start, and most runs log to CSV only

    logger = WandbLogger(
        id=wandb_run_id(run.dir),  # a run resumed in its directory continues its wandb run
        resume="allow",
        project=project,
        name=name or run.name,
        group=group or run.group,
        tags=[*run.tags, *(tags or [])],
        save_dir=str(run.dir),
        mode=wandb_mode(mode),
        config=run.config,
        # wandb records the command line among its system metadata; with a secret on it, it records none.
        settings=wandb.Settings(x_disable_meta=True) if run.has_secrets else None,
    )
    # Lightning passes `anonymous` to wandb.init even when unset, and wandb 0.31 warns on every run
    # that the setting has no effect.
    logger._wandb_init.pop("anonymous", None)
    return logger
