"""A report comparing training runs: a Markdown table and plots, from what the runs logged.

    python -m project.report RUN_DIR|SWEEP_DIR|WANDB_RUN_DIR|wandb:ENTITY/PROJECT[/SWEEP_ID]... [name=NAME] [out=DIR]

Each argument is a run directory (the `hydra.run.dir` of `project.train`: `metrics.csv`, `config.yaml`,
`memory/rank<N>.json`); a sweep folder of `tools.sweep` (`points.jsonl`), which stands for all its
points, failed ones included, with the error each printed as their status; a wandb run folder
(`offline-run-*`, holding `run-<id>.wandb`); or `wandb:ENTITY/PROJECT[/SWEEP_ID]`, the runs of a wandb
project or sweep on wandb's server. Writes `report.md`, with one row per run, best throughput first, and
beside it `throughput.svg`, `memory.svg` and `loss.svg`, into `out=DIR` itself, or by default into
`outputs/reports/<name>/` (under $PROJECT_ROOT, as conf/paths): generated files stay out of the source tree,
like every run's. `name=` titles the report; its default is out's folder name, else
`<date>-<first argument's folder name>`. A report in the same folder is replaced: it is made from the runs
alone, so making it again gives the same figures. The reports kept in git, under experiments/reports/, are
made with `out=experiments/reports/<name>`.

The CSV logger writes `metrics.csv` under every logger config, so a run directory is read from it. A run
directory without it (deleted, say) is read from its `wandb/offline-run-*` folders: the transaction log
wandb keeps beside a `logger=wandb` run. A wandb run folder given alone, and a run on wandb's server, are
read alike, but with no Hydra record beside them their model and strategy names come from the tags
training gave the wandb run, and their peak memory from the logged `memory/max_peak_bytes`. Reading wandb
(its own reader of its binary format; its public API, where this machine is logged in) is in
tools/report_wandb.py.

Arguments are `key=value` options and the runs' sources, parsed without Hydra as in tools.sweep and
project.hf.export: there is nothing to compose.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import re
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.svg_plots import bar_chart, heat_map, line_chart
from project.config.layout import Layout
from project.parallel.batch import BatchPlan
from project.parallel.mesh import MeshShape
from project.runtime.arguments import parse_options
from project.runtime.errors import ConfigError, exit_on_config_error
from tools.report_wandb import UnreadableLog, WandbRun, api_runs, is_run_folder, read_folders, run_folders

OPTIONS = {"name": None, "out": None}
USAGE = (
    "usage: python -m project.report RUN_DIR|SWEEP_DIR|WANDB_RUN_DIR|wandb:ENTITY/PROJECT[/SWEEP_ID]... "
    "[name=NAME] [out=DIR]"
)
PLOTS = {
    "throughput": "Tokens/s per device",
    "memory": "Peak memory per rank",
    "loss": "Training loss",
}


@dataclass
class RunSummary:
    """One row of the report: a run, or a sweep point that may have left no run behind."""

    label: str  # where it came from: the run directory's name, <sweep folder>/<point>, or <wandb project>/<run id>
    run_dir: Path | None
    layout: str = ""  # Layout.name() of each layout the run trained in, in order, joined by " → "
    settings: str = ""  # a sweep point's parameters, which name it where no layout was logged
    devices: int | None = None
    tokens_per_sec_per_device: float | None = None
    mfu: float | None = None
    peak_bytes_per_rank: float | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    status: str = "ok"
    train_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, train/loss), the loss curve
    # Per-layer numerics (stability.numerics_every_n_steps): {stat: {(layer, step): value}}, layers in model order.
    numerics: dict[str, dict[tuple[str, int], float]] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)
    # Evaluation inside training (conf/eval): {metric: [(tokens trained on, value)]}, eval/<set>/<stat> but seconds.
    evals: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return self.layout or self.settings or self.label


# ---------------------------------------------------------------- reading one run

# A run's logged metrics, a dict per logged row with its "step": metrics.csv's rows, or wandb's history.
Rows = list[dict[str, Any]]


def read_rows(path: Path) -> Rows:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def series(rows: Rows, name: str) -> list[tuple[int, float]]:
    """(step, value) of every row that logged `name`, in step order (validation rows share their step)."""
    found = []
    for row in rows:
        if row.get(name) not in (None, ""):
            try:
                found.append((int(float(row["step"])), float(row[name])))
            except (KeyError, TypeError, ValueError):
                continue  # a row cut short by a killed run
    return sorted(found, key=lambda item: item[0])


def last(rows: Rows, name: str) -> float | None:
    values = series(rows, name)
    return values[-1][1] if values else None


def steady_median(values: list[tuple[int, float]]) -> float | None:
    """The median of the logged values after the first: the first logging window holds the first step,
    which pays for start-up (allocations, the first collective, lazy initialization), not for the layout."""
    kept = [value for _, value in values][1:] or [value for _, value in values]
    return statistics.median(kept) if kept else None


def hydra_choices(run_dir: Path) -> dict[str, str]:
    """The config-group options the run composed (model preset, strategy), from Hydra's own record."""
    try:
        hydra = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text()) or {}
        return dict(hydra["hydra"]["runtime"]["choices"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return {}


def read_config(run_dir: Path) -> dict[str, Any]:
    try:
        return yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


# Written by training (project.training.callbacks.layout, which imports Lightning: named again here so that a
# report imports no torch; tests/test_report.py reads a trained run's under this name).
LAYOUTS_FILE = "layouts.jsonl"
LAYOUT_FACTS = (
    "pipeline_parallel",
    "data_parallel",
    "tensor_parallel",
    "micro_batch_size",
    "global_batch_size",
    "pipeline_microbatches",
)


def logged_layouts(rows: Rows, choices: dict[str, str]) -> list[str]:
    """The layout name of each start of the run, in order (one where it never changed), as training named its
    wandb run: from the layout facts each start logged. Hydra's record names the last start's strategy; an earlier
    start's, which the metrics do not hold, is `?` where its facts differ from the last's."""
    facts = {name: dict(series(rows, f"layout/{name}")) for name in LAYOUT_FACTS}
    # Logged since their dimensions were added; a run from before had degree 1 there.
    extra = {name: dict(series(rows, f"layout/{name}")) for name in ("context_parallel", "expert_parallel")}
    starts = sorted(set.intersection(*(set(values) for values in facts.values())))
    names = []
    for step in starts:
        f = {name: int(values[step]) for name, values in facts.items()}
        plan = BatchPlan(f["global_batch_size"], f["micro_batch_size"], f["data_parallel"], f["pipeline_microbatches"])
        cp, ep = (int(extra[name].get(step, 1)) for name in ("context_parallel", "expert_parallel"))
        layout = Layout(MeshShape(f["pipeline_parallel"], f["data_parallel"], f["tensor_parallel"], cp, ep), plan)
        last = all(values[step] == values[starts[-1]] for values in facts.values())
        names.append(layout.name(choices.get("model", "model"), choices.get("strategy", "strategy") if last else "?"))
    return without_repeats(names)


def recorded_layouts(run_dir: Path) -> list[str]:
    """The layout name of each start, in order, from the run directory's layouts.jsonl (training writes it,
    project.training.callbacks.layout); [] where there is none (runs from before it, wandb runs)."""
    try:
        lines = (run_dir / LAYOUTS_FILE).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    names = []
    for line in lines:
        try:
            names.append(str(json.loads(line)["layout"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by a killed run
    return without_repeats(names)


def without_repeats(names: list[str]) -> list[str]:
    """A resume, or a rollback's restart, in the same layout is not another layout."""
    return [name for i, name in enumerate(names) if i == 0 or name != names[i - 1]]


def rank_memory(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's memory record (written when training ends)."""
    records = []
    for path in sorted((run_dir / "memory").glob("rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


def configured_devices(config: dict[str, Any]) -> int | None:
    trainer = config.get("trainer") or {}
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    return devices * nodes if isinstance(devices, int) and isinstance(nodes, int) else None


def completion(rows: Rows, memory: list[dict[str, Any]], config: dict[str, Any]) -> str:
    """ "ok" when the run reached trainer.max_steps, else where it stopped."""
    max_steps = (config.get("trainer") or {}).get("max_steps")
    steps = [record["step"] for record in memory if isinstance(record.get("step"), int)]
    done = max(steps) if steps else max((step + 1 for step, _ in series(rows, "train/loss")), default=0)
    if isinstance(max_steps, int) and max_steps > 0 and done < max_steps:
        return f"stopped at step {done} of {max_steps}"
    return "ok"


def summarize_run(run_dir: Path, label: str | None = None) -> RunSummary:
    """The report's row for one run directory: from metrics.csv, else from its wandb folders, else a row
    that says there are no metrics."""
    summary = RunSummary(label=label or run_dir.resolve().name, run_dir=run_dir)
    config = read_config(run_dir)
    summary.devices = configured_devices(config)
    choices = hydra_choices(run_dir)
    if (run_dir / "metrics.csv").is_file():
        try:
            rows = read_rows(run_dir / "metrics.csv")
        except (OSError, UnicodeDecodeError, csv.Error) as error:
            summary.status = f"metrics.csv unreadable: {error}"
            return summary
    elif folders := run_folders(run_dir):
        try:
            run = read_folders(folders, summary.label)
        except UnreadableLog as error:
            summary.status = f"wandb log unreadable: {error}"
            return summary
        rows, config, choices = run.rows, config or run.config, choices or run.choices
    else:
        summary.status = "no metrics"
        return summary
    return summarize_metrics(summary, rows, config, choices, rank_memory(run_dir))


def summarize_wandb(run: WandbRun, run_dir: Path | None = None) -> RunSummary:
    """The report's row for a run known only to wandb: a run folder given alone, or a run on its server."""
    summary = RunSummary(label=run.label, run_dir=run_dir, devices=configured_devices(run.config))
    return summarize_metrics(summary, run.rows, run.config, run.choices, [])


def summarize_wandb_folder(folder: Path) -> RunSummary:
    """The report's row for a wandb run folder given alone, or a row saying wandb could not read it."""
    try:
        return summarize_wandb(read_folders([folder], folder.resolve().name), folder)
    except UnreadableLog as error:
        return RunSummary(label=folder.resolve().name, run_dir=folder, status=f"wandb log unreadable: {error}")


def summarize_metrics(
    summary: RunSummary, rows: Rows, config: dict[str, Any], choices: dict[str, str], memory: list[dict[str, Any]]
) -> RunSummary:
    """`summary` filled in from a run's logged rows, config, config-group choices and rank memory files."""
    world_size = last(rows, "layout/world_size")
    summary.devices = int(world_size) if world_size else summary.devices
    # Files of ranks a resumed run no longer has (it resumed on fewer devices) stay behind: left out.
    memory = [r for r in memory if summary.devices is None or r.get("world_size") in (None, summary.devices)]
    recorded = recorded_layouts(summary.run_dir) if summary.run_dir is not None else []
    summary.layout = " → ".join(recorded or logged_layouts(rows, choices))
    # A run resumed under another layout logged its layout again where it resumed: its speed is the one
    # measured since (Hydra's record of the choices is the last start's too).
    starts = series(rows, "layout/world_size")
    since = starts[-1][0] if starts else 0

    def current(name: str) -> list[tuple[int, float]]:
        return [(step, value) for step, value in series(rows, name) if step >= since]

    # Logged tokens/s count the whole global batch, all devices together.
    tokens_per_sec = steady_median(current("train/tokens_per_sec"))
    if tokens_per_sec is not None and summary.devices:
        summary.tokens_per_sec_per_device = tokens_per_sec / summary.devices
    summary.mfu = steady_median(current("train/mfu"))
    peaks = [record["peak_bytes"] for record in memory if isinstance(record.get("peak_bytes"), (int, float))]
    # A run stopped before its end wrote no rank files; its logged maximum over ranks stands in.
    summary.peak_bytes_per_rank = max(peaks) if peaks else last(rows, "memory/max_peak_bytes")
    summary.train_losses = series(rows, "train/loss")
    summary.train_loss = summary.train_losses[-1][1] if summary.train_losses else None
    summary.val_loss = last(rows, "val/loss")
    summary.layers, summary.numerics = numerics_of(rows)
    summary.evals = evals_of(rows, config)
    summary.status = completion(rows, memory, config)
    return summary


def evals_of(rows: Rows, config: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Each logged eval/<set>/<stat> (project.training.callbacks.evaluation) against the tokens trained on when it
    was taken: the steps so far times the global batch's tokens (the optimizer steps where the config says
    neither)."""
    batch, seq_len = config.get("global_batch_size"), (config.get("data") or {}).get("seq_len")
    per_step = batch * seq_len if isinstance(batch, int) and isinstance(seq_len, int) else 1
    names = sorted({key for row in rows for key in row if key.startswith("eval/") and key != "eval/seconds"})
    return {name: [((step + 1) * per_step, value) for step, value in series(rows, name)] for name in names}


def numerics_of(rows: Rows) -> tuple[list[str], dict[str, dict[tuple[str, int], float]]]:
    """The layers (embedding, block0 .., head) and {stat: {(layer, step): value}} of the logged numerics/<layer>/<stat>
    (project.training.callbacks.numerics); the last value of a step logged twice (a rollback retrained it)."""
    names = sorted({key for row in rows for key in row if key.startswith("numerics/") and key.count("/") == 2})
    figures: dict[str, dict[tuple[str, int], float]] = {}
    for name in names:
        _, layer, stat = name.split("/")
        figures.setdefault(stat, {}).update(((layer, step), value) for step, value in series(rows, name))
    layers = {layer for values in figures.values() for layer, _ in values}
    return sorted(layers, key=model_order), figures


def model_order(layer: str) -> tuple[int, int]:
    """embedding, block0, block1, .., block10, .., head: the order of the model's layers."""
    number = layer.removeprefix("block")
    if layer == "embedding":
        return (0, 0)
    return (1, int(number)) if number.isdigit() else (2, 0)


# ---------------------------------------------------------------- what the arguments stand for


# What a dry run (dry_run=true) leaves in its folder, and nothing else (project.planning.dry_run).
DRY_RUN_RECORD = "dry_run.json"


def is_run_dir(path: Path) -> bool:
    """What project.train writes into every run directory, from its first second (metrics.csv may be missing)."""
    return any((path / name).exists() for name in ("metrics.csv", "config.yaml", ".hydra", "train.log"))


def command_devices(command: list[str]) -> int | None:
    """trainer.devices x trainer.num_nodes from a point's command line (the last of a key winning, as in
    Hydra), for a point that left no run: they need not be parameters of the spec."""
    values = dict(arg.lstrip("+").split("=", 1) for arg in command if "=" in arg)
    devices, nodes = values.get("trainer.devices", ""), values.get("trainer.num_nodes", "1")
    return int(devices) * int(nodes) if devices.isdigit() and nodes.isdigit() else None


def point_settings(record: dict[str, Any], varied: list[str]) -> str:
    """What sets a point apart from the others: its parameters as it ran them (tools.sweep records them
    after the runner's overrides, trainer.devices=2 for the spec's 4)."""
    parameters = record.get("parameters") or {}
    return " ".join(f"{key}={parameters[key]}" for key in varied if key in parameters)


def read_points(sweep_dir: Path) -> list[dict[str, Any]]:
    """The records of points.jsonl, one per finished point."""
    records = []
    for number, line in enumerate((sweep_dir / "points.jsonl").read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise ConfigError(
                f"{sweep_dir / 'points.jsonl'} line {number} is not a point's JSON record: is this a "
                "tools.sweep folder?"
            )
        records.append(record)
    return records


def summarize_sweep(sweep_dir: Path) -> list[RunSummary]:
    """A row per point in points.jsonl; a failed point's status is its exit status and the error it printed."""
    records = read_points(sweep_dir)
    keys = list(dict.fromkeys(key for record in records for key in record.get("parameters") or {}))
    # A failed point is named by the parameters that differ between points; a point alone, by all of them.
    varied = [
        key for key in keys if len({json.dumps((r.get("parameters") or {}).get(key)) for r in records}) > 1
    ] or keys
    summaries = []
    for index, record in enumerate(records):
        point = str(record.get("point", index))
        # The folder the runner gave the point, found again if the sweep folder was moved since.
        run_dir = sweep_dir / point
        if not run_dir.is_dir() and record.get("run_dir"):
            run_dir = Path(record["run_dir"])
        label = f"{sweep_dir.resolve().name}/{point}"
        if run_dir.is_dir() and is_run_dir(run_dir):
            summary = summarize_run(run_dir, label)
        else:  # refused by the settings check: training left no run directory
            devices = command_devices(record.get("command") or [])
            summary = RunSummary(label=label, run_dir=None, devices=devices, status="no run directory")
        if not summary.layout:  # no layout logged: the point's own settings say what it was
            summary.settings = point_settings(record, varied)
        status = record.get("status", 0)
        if status != 0:
            error = record.get("error") or "no error printed"
            summary.status = f"failed ({status}): {error}"
        summaries.append(summary)
    return summaries


def collect(sources: list[str]) -> list[RunSummary]:
    """Every run the arguments stand for: sweep folders and wandb projects expand to their runs, in the order given."""
    if not sources:
        raise ConfigError(f"give one or more run directories or sweep folders.\n{USAGE}")
    summaries: list[RunSummary] = []
    dry_runs: list[Path] = []
    for source in sources:
        path = Path(source)
        if source.startswith("wandb:"):
            summaries.extend(summarize_wandb(run) for run in api_runs(source))
        elif (path / "points.jsonl").is_file():
            summaries.extend(summarize_sweep(path))
        elif path.is_dir() and is_run_dir(path):
            summaries.append(summarize_run(path))
        elif is_run_folder(path):
            summaries.append(summarize_wandb_folder(path))
        elif (path / DRY_RUN_RECORD).is_file():
            # `outputs/runs/*` takes in the folders of the docs' dry runs, which trained nothing: not the user's error.
            print(
                f"note: skipped {path}: a dry run's folder ({DRY_RUN_RECORD}), nothing trained there.", file=sys.stderr
            )
            dry_runs.append(path)
        else:
            what = "does not exist" if not path.exists() else "is neither a run directory nor a sweep folder"
            raise ConfigError(
                f"{path} {what}: give the run directories of project.train (holding metrics.csv or config.yaml), "
                "sweep folders of tools.sweep (holding points.jsonl), e.g. "
                "outputs/sweeps/layouts-<date>_<time>, wandb run folders (holding run-*.wandb), or "
                "wandb:ENTITY/PROJECT[/SWEEP_ID]."
            )
    if not summaries and dry_runs:
        raise ConfigError(
            f"{', '.join(map(str, dry_runs))}: only dry runs' folders, which trained nothing; give the run directories "
            "of project.train (holding metrics.csv or config.yaml) or sweep folders."
        )
    return summaries


def ranked(summaries: list[RunSummary]) -> list[RunSummary]:
    """Best tokens/s per device first; runs without a throughput keep their order after the rest."""
    return sorted(summaries, key=lambda s: (s.tokens_per_sec_per_device is None, -(s.tokens_per_sec_per_device or 0.0)))


# ---------------------------------------------------------------- writing the report


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**30:.2f} GiB" if value >= 10 * 2**30 else f"{value / 2**20:,.0f} MiB"


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def cell(text: str) -> str:
    """Markdown table cells cannot hold a pipe or a line break."""
    return text.replace("|", "\\|").replace("\n", " ")


def table(summaries: list[RunSummary]) -> str:
    header = [
        "#",
        "layout",
        "run",
        "devices",
        "tokens/s per device",
        "MFU",
        "peak memory per rank",
        "train/loss",
        "val/loss",
        "status",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rank, s in enumerate(summaries, 1):
        row = [
            str(rank),
            f"`{s.layout}`" if s.layout else s.settings or "-",
            s.label,
            fmt(s.devices, "d"),
            fmt(s.tokens_per_sec_per_device, ",.0f"),
            "-" if s.mfu is None else f"{s.mfu:.1%}",
            fmt_bytes(s.peak_bytes_per_rank),
            fmt(s.train_loss, ".4f"),
            fmt(s.val_loss, ".4f"),
            s.status,
        ]
        lines.append("| " + " | ".join(cell(c) for c in row) + " |")
    return "\n".join(lines)


def plot_labels(summaries: list[RunSummary]) -> dict[int, str]:
    """Layout names, with the run added where two runs share one (a sweep over anything but the layout)."""
    names = [s.title for s in summaries]
    return {id(s): s.title if names.count(s.title) == 1 else f"{s.title} ({s.label})" for s in summaries}


def write_plots(summaries: list[RunSummary], folder: Path) -> dict[str, str]:
    """{plot: file name} of the plots there are data for, as SVG (text: small, and diffs in git)."""
    labels = plot_labels(summaries)
    throughput = [(labels[id(s)], s.tokens_per_sec_per_device) for s in summaries if s.tokens_per_sec_per_device]
    memory = [(labels[id(s)], s.peak_bytes_per_rank / 2**20) for s in summaries if s.peak_bytes_per_rank]
    curves = [(labels[id(s)], s.train_losses) for s in summaries if s.train_losses]
    charts: dict[str, str] = {}  # bars in the table's order, which bar_chart draws from the top: best first
    if throughput:
        charts["throughput"] = bar_chart(
            PLOTS["throughput"], throughput, "tokens/s per device (median after the first logged window)", ",.0f"
        )
    if memory:
        charts["memory"] = bar_chart(PLOTS["memory"], memory, "peak memory of the highest rank (MiB)", ",.0f")
    if curves:
        charts["loss"] = line_chart(PLOTS["loss"], curves, "optimizer step", "train/loss")
    for key, svg in charts.items():
        (folder / f"{key}.svg").write_text(svg, encoding="utf-8")
    for key in PLOTS.keys() - charts.keys():  # a plot of the report this one replaces would outlive its data
        (folder / f"{key}.svg").unlink(missing_ok=True)
    return {key: f"{key}.svg" for key in charts}


NUMERICS = {
    "update_ratio": "update / parameter norm",
    "grad_norm": "gradient norm",
    "param_norm": "parameter norm",
    "output_rms": "output RMS",
}


def write_evals(summaries: list[RunSummary], folder: Path) -> list[tuple[str, str]]:
    """(title, file name) of a line chart per eval metric, every run that logged it a line against tokens."""
    for stale in folder.glob("eval-*.svg"):  # of the report this one replaces
        stale.unlink()
    labels, charts = plot_labels(summaries), []
    for index, name in enumerate(sorted({name for s in summaries for name in s.evals})):
        curves = [(labels[id(s)], s.evals[name]) for s in summaries if s.evals.get(name)]
        file = f"eval-{index}.svg"
        (folder / file).write_text(line_chart(name, curves, "tokens trained on", name), encoding="utf-8")
        charts.append((name, file))
    return charts


def write_numerics(summaries: list[RunSummary], folder: Path) -> list[tuple[str, str]]:
    """(title, file name) of a heat map (layer x step) per statistic of each run that logged per-layer numerics."""
    for stale in folder.glob("numerics-*.svg"):  # of the report this one replaces
        stale.unlink()
    labels, maps = plot_labels(summaries), []
    for index, s in enumerate(summary for summary in summaries if summary.numerics):
        for stat, shown in NUMERICS.items():
            values = s.numerics.get(stat)
            if not values:
                continue
            title = f"{labels[id(s)]}: {shown} per layer"
            steps = sorted({step for _, step in values})
            name = f"numerics-{index}-{stat}.svg"
            (folder / name).write_text(heat_map(title, s.layers, steps, values, shown), encoding="utf-8")
            maps.append((title, name))
    return maps


NOTES = """\
How each column is made: **devices** is `layout/world_size` (else `trainer.devices` x `trainer.num_nodes`);
**tokens/s per device** is the median of the logged `train/tokens_per_sec` (the whole global batch over the
step time) after the first logged window, which holds the start-up step, divided by the devices (a run resumed
under another layout: since it resumed); **MFU** the
median of `train/mfu` likewise, where it was logged (on a CPU only with `peak_flops_per_device`); **peak memory
per rank** the highest `peak_bytes` in `memory/rank<N>.json` (GPU: torch's peak allocated; CPU: the process's
resident high-water mark), or the logged `memory/max_peak_bytes` where there are none (training stopped before
writing them, or the run was read from wandb alone);
**train/loss** and **val/loss** the last logged values. Rows are sorted by tokens/s per device, best first."""


def write_report(summaries: list[RunSummary], folder: Path, title: str, command: str) -> Path:
    """Write `folder/report.md` and its plots; the path of report.md."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create the report folder {folder}: {error.strerror}; choose another out=.") from None
    summaries = ranked(summaries)
    plots = write_plots(summaries, folder)
    parts = [
        f"# {title}",
        f"Made {datetime.date.today():%Y-%m-%d} with `{command}` from {len(summaries)} run(s).",
        table(summaries),
        NOTES,
    ]
    missing = [PLOTS[key].lower() for key in PLOTS if key not in plots]
    parts += [f"![{PLOTS[key]}]({name})" for key, name in plots.items()]
    if missing:
        parts.append(f"No plot of {', '.join(missing)}: no run logged it.")
    if evals := write_evals(summaries, folder):
        parts.append("Evaluation inside training (`eval`, docs/evaluation.md): each metric against the tokens trained.")
        parts += [f"![{title}]({name})" for title, name in evals]
    if numerics := write_numerics(summaries, folder):
        parts.append(
            "Per-layer numerics (`stability.numerics_every_n_steps`): each cell a layer at a step, coloured by the "
            "logarithm of its value."
        )
        parts += [f"![{title}]({name})" for title, name in numerics]
    path = folder / "report.md"
    path.write_text("\n\n".join(parts) + "\n")
    return path


# ---------------------------------------------------------------- command line


def parse(argv: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """This command's key=value options, and the runs' sources: paths and wandb: projects (everything else)."""
    # Everything else is a source: a path (which may hold '='), or wandb:ENTITY/PROJECT.
    options, sources = parse_options(
        argv, OPTIONS, doc=__doc__, usage=USAGE, rest=lambda arg: "=" not in arg or Path(arg).exists()
    )
    if options["name"] is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", options["name"]):
        raise ConfigError(
            f"name={options['name']}: give a folder name (letters, digits, '.', '_', '-'), e.g. "
            "name=2026-11-24-cpu-layouts."
        )
    return options, sources


def default_name(sources: list[str]) -> str:
    """The first source's folder name (a wandb: source's last part: its project or sweep id)."""
    if not sources:
        first = "runs"
    elif sources[0].startswith("wandb:"):
        first = sources[0].rstrip("/").rsplit("/", 1)[-1]
    else:
        first = Path(sources[0]).resolve().name
    return f"{datetime.date.today():%Y-%m-%d}-{first}" + ("" if len(sources) == 1 else f"-and-{len(sources) - 1}-more")


@exit_on_config_error()
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options, sources = parse(argv)
    summaries = collect(sources)
    if options["out"]:
        folder = Path(options["out"])
        name = options["name"] or folder.resolve().name
    else:
        name = options["name"] or default_name(sources)
        folder = Path(os.environ.get("PROJECT_ROOT", ".")) / "outputs" / "reports" / name
    command = shlex.join(["python", "-m", "project.report", *argv])
    path = write_report(summaries, folder, f"Report {name}", command)
    print(table(ranked(summaries)))
    print(f"\nwrote {path} and its plots")
    return 0
