"""Runs as wandb recorded them, for tools.report: a run's transaction log on disk, or wandb's server.

Each gives what metrics.csv gives: history rows keyed by the trainer's step (the `trainer/global_step`
that Lightning's WandbLogger adds to every row), and the run's config.

The transaction log (`<run dir>/wandb/offline-run-*/run-<id>.wandb`, also written beside an online run as
`run-*/`) is wandb's own binary format, read here by wandb itself: wandb 0.31 has no Python reader of it
any more (its `sdk/internal/datastore.py` went with the move to the Go core), and the `wandb-core` binary it
ships prints the records as JSON lines (`wandb leet inspect --json`). We run that binary as the `wandb`
command does, found with `wandb.util.get_core_path()`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from project.runtime.errors import ConfigError

# wandb's folders for one start of a run, named <prefix>-<date>_<time>-<id>: a resumed run adds one.
RUN_FOLDERS = ("offline-run-*", "run-*")
API_SOURCE = re.compile(r"wandb:([^/\s]+)/([^/\s]+)(?:/([^/\s]+))?")
API_USAGE = "give wandb:ENTITY/PROJECT or wandb:ENTITY/PROJECT/SWEEP_ID, e.g. wandb:my-team/llama-pretrain."


class UnreadableLog(Exception):
    """A transaction log wandb could not read (a report row says so; the other runs are still reported)."""


@dataclass
class WandbRun:
    label: str  # where it came from: the folder's name, or <project>/<run id>
    config: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # history, each with "step" where it has one

    @property
    def choices(self) -> dict[str, str]:
        """The model preset and strategy, from the tags training gives every wandb run:
        [strategy, model, "<N>-devices", the logger config's own...] (project.training.run)."""
        if len(self.tags) >= 3 and str(self.tags[2]).endswith("-devices"):
            return {"strategy": str(self.tags[0]), "model": str(self.tags[1])}
        return {}


def history_row(item: dict[str, Any]) -> dict[str, Any]:
    """A wandb history row as a metrics.csv row: the step is the trainer's, not wandb's own `_step`."""
    step = item.get("trainer/global_step")
    return {**item, "step": step} if step is not None else dict(item)


def continued(starts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of a run's starts, kept as the CSV logger keeps them: a resumed start logs again the steps
    since its checkpoint, so its first step drops every older row at that step or later."""
    rows: list[dict[str, Any]] = []
    for start in starts:
        first = min((row["step"] for row in start if "step" in row), default=None)
        if first is not None:
            rows = [row for row in rows if row.get("step", first) < first]
        rows += start
    return rows


# ---------------------------------------------------------------- transaction logs on disk


def is_run_folder(path: Path) -> bool:
    """A folder of one wandb run start, as `wandb sync` takes it."""
    return path.is_dir() and any(path.glob("run-*.wandb"))


def run_folders(run_dir: Path) -> list[Path]:
    """The wandb folders of a project.train run directory, oldest start first."""
    found = {path for pattern in RUN_FOLDERS for path in (run_dir / "wandb").glob(pattern) if is_run_folder(path)}
    return sorted(found, key=lambda path: path.name.removeprefix("offline-"))


def transaction_records(log: Path) -> list[dict[str, Any]]:
    """Every record of one `.wandb` file, as wandb-core prints them; a log cut short (a killed run) up to its end."""
    from wandb.errors import WandbCoreNotAvailableError  # here: a report of CSV runs never loads wandb
    from wandb.util import get_core_path

    try:
        core = get_core_path()
    except WandbCoreNotAvailableError as error:
        raise UnreadableLog(str(error)) from None
    # --no-observability: wandb-core would otherwise send its own telemetry to wandb's server.
    command = [core, "leet", "inspect", "--no-observability", "--json", "--run-file", str(log), str(log.parent.parent)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UnreadableLog(str(error)) from None
    if result.returncode != 0:
        said = result.stderr.strip().splitlines()
        raise UnreadableLog(said[-1] if said else f"wandb-core exited with status {result.returncode}")
    try:
        return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    except ValueError as error:
        raise UnreadableLog(f"wandb-core printed no JSON: {error}") from None


def read_folders(folders: list[Path], label: str) -> WandbRun:
    """One run from the folders of its starts: the history of all, the config and tags as last recorded."""
    run, starts = WandbRun(label), []
    for folder in folders:
        start = []
        for log in sorted(folder.glob("run-*.wandb")):
            for record in transaction_records(log):
                kind = record.get("type")
                if kind == "run":
                    run.config.update((record["run"].get("config") or {}).get("update") or {})
                    run.tags = list(record["run"].get("tags") or run.tags)
                elif kind == "config":
                    run.config.update(record["config"].get("update") or {})
                elif kind == "history":
                    start.append(history_row(record["history"].get("item") or {}))
        starts.append(start)
    run.rows = continued(starts)
    return run


# ---------------------------------------------------------------- wandb's server


def connect(source: str):
    """wandb's public API, where this machine is logged in and not told to stay offline."""
    mode = os.environ.get("WANDB_MODE")
    if mode in ("offline", "disabled"):
        raise ConfigError(not_logged_in(source, f"WANDB_MODE={mode} keeps wandb off the network", "unset WANDB_MODE"))
    import wandb

    # prompt=False: no API key makes this False, where wandb.Api() would ask for one at a terminal.
    if not wandb.login(prompt=False, verify=False):
        raise ConfigError(
            not_logged_in(
                source, "this machine is not logged in to wandb", "log in with `wandb login` (or set WANDB_API_KEY)"
            )
        )
    return wandb.Api()


def not_logged_in(source: str, why: str, fix: str) -> str:
    return (
        f"{source}: its runs are read from wandb's server, but {why}: {fix}, or give the runs' folders instead "
        "(a run directory's metrics.csv, else its wandb/offline-run-* folder, is read without a server)."
    )


def api_runs(source: str, api=None) -> list[WandbRun]:
    """The runs of `wandb:ENTITY/PROJECT[/SWEEP_ID]` with their history and config, through wandb's public API
    (`Api.runs`, `Api.sweep(...).runs`, `Run.scan_history`, `Run.config`); `api` stands in for it in tests."""
    match = API_SOURCE.fullmatch(source)
    if not match:
        raise ConfigError(f"{source}: {API_USAGE}")
    entity, project, sweep = match.groups()
    api = api if api is not None else connect(source)
    from wandb.errors import Error as WandbError

    try:  # raised by history downloads, outside wandb.errors in 0.31
        from wandb.sdk.lib.service.service_connection import WandbApiFailedError
    except ImportError:
        WandbApiFailedError = WandbError
    try:
        runs: Iterable = api.sweep(f"{entity}/{project}/{sweep}").runs if sweep else api.runs(f"{entity}/{project}")
        return [
            WandbRun(
                label=f"{project}/{run.id}",
                config=dict(run.config),
                tags=list(run.tags or []),
                rows=[history_row(item) for item in run.scan_history()],
            )
            for run in runs
        ]
    # ValueError: wandb's "Could not find project/sweep"; OSError: the network (requests' errors are OSErrors).
    except (WandbError, WandbApiFailedError, ValueError, OSError) as error:
        raise ConfigError(
            f"{source}: wandb's server did not give the runs ({str(error).strip().rstrip('.')}). Check "
            "ENTITY/PROJECT[/SWEEP_ID] and that this machine reaches wandb and is logged in (`wandb login`), or give "
            "the run directories instead."
        ) from None
