"""Loggers: a CSV file in the run directory always; wandb when the logger group asks for it."""

from __future__ import annotations

import csv
import netrc
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


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


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv; a resumed run continues it instead.

    Rows the interrupted run logged after its last checkpoint are replayed by the resumed run, so
    the first step this run logs drops every older row at that step or later.
    """

    def _check_log_dir_exists(self) -> None:
        self._resuming = self._fs.isfile(self.metrics_file_path)
        if self._resuming:
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = list(csv.DictReader(file).fieldnames or [])

    def log_metrics(self, metrics_dict: dict, step: int | None = None) -> None:
        if self._resuming and step is not None:
            self._resuming = False
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                kept = [row for row in csv.DictReader(file) if int(row["step"]) < step]
            self._replace_whole(self.metrics_keys, kept)
        super().log_metrics(metrics_dict, step)

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        """Lightning's rewrite of every row when a column first appears (val/loss, checkpoint/*), made whole
        before it replaces the file: a run killed meanwhile keeps the rows it had."""
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            rows = list(csv.DictReader(file))
        self._replace_whole(fieldnames, rows)

    def _replace_whole(self, fieldnames: list[str], rows: list[dict]) -> None:
        partial = f"{self.metrics_file_path}.partial"
        with self._fs.open(partial, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)
        self._fs.mv(partial, self.metrics_file_path)


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


class RunCSVLogger(CSVLogger):
    """metrics.csv and hparams.yaml directly in the run directory, kept across resumes."""

    def __init__(self, run: RunIdentity):
        # Each row is written as it is logged: a run killed later has the metrics of every step it checkpointed.
        super().__init__(save_dir=run.dir, name="", version="", flush_logs_every_n_steps=1)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.log_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment  # type: ignore[return-value]  # Lightning types it as its private writer class


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
