"""The run's settings, kept in each checkpoint, and what a resume changes of them, said once as the resume starts.

A resume may change the layout and the bookkeeping freely (every layout continues every other's checkpoint
exactly); a setting that changes what the run computes (the batch, the model, the data, the precision, float8)
is the user's to mean, so it is named in one warning with the values that continue the checkpoint's run as it was.
A change of the learning-rate schedule is said in the same warning, in the schedule's own words
(project.training.schedule), which also give the learning rate at the resumed step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from project.training.schedule import SCHEDULE_SETTINGS, schedule_change

RECORD = "run_settings"  # the checkpoint's entry: {dotted setting: its value as JSON}

# Not settings of their own: what conf/train.yaml builds from the others, and where this start runs.
NOT_SETTINGS = ("datamodule.", "module.", "paths.", "dry_run.", "ckpt_path")
# What a resume may change without changing what the run computes (docs/runs.md): the layout and its devices, the
# run's length, how often it validates, saves, logs and reports, and how the data is read (not which data). A
# strategy's float8 changes the arithmetic, and is not among them.
LAYOUT_AND_BOOKKEEPING = (
    "strategy.",
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.accelerator",
    "trainer.max_steps",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.log_every_n_steps",
    "micro_batch_size",
    "threads_per_process",
    "ckpt_",
    "val_every_n_steps",
    "val_sequences",
    "logger.",
    "callbacks.",
    "eval.",
    "cluster",
    "memory_check",
    "peak_flops_per_device",
    "init_from",
    "data.loader_workers",
    "data.auto_prepare",
    "data.overwrite",
    "data.fetch",
    "data.cache_dir",
    "data.cache_size",
    "data.storage_options",
    "data.name",
    "data.prepare_",
    "data.chunk_mb",
    "trainer.num_sanity_val_steps",
    "stability.numerics_every_n_steps",
    "stability.straggler_factor",
    "stability.replica_check_every_n_steps",
    # The initial weights' seed: a resume's weights are the checkpoint's (the data's order has data.seed).
    "seed",
)
COMPUTING_EVEN_IF_LAYOUT = ("strategy.float8",)


def as_json(value: Any, root: str) -> str:
    """A setting's value as JSON, as two runs of the same settings write it alike: a path under the project's root
    relative to it (a checkout moved, or another machine's), a whole number as the float it may also be written as
    (`optim.grad_clip=1` and `1.0`)."""

    def plain(item: Any) -> Any:
        if isinstance(item, str) and root and item.startswith(root):
            return item[len(root) :].lstrip("/") or "."
        if isinstance(item, int) and not isinstance(item, bool):
            return float(item)
        if isinstance(item, list):
            return [plain(i) for i in item]
        return item

    return json.dumps(plain(value), sort_keys=True, default=str, separators=(",", ":"))


def flat_settings(config: Mapping[str, Any], prefix: str = "", root: str | None = None) -> dict[str, str]:
    """{dotted setting: its value as JSON (as_json)} of a resolved config's leaves (a list is one value); `root`, the
    project's root, by default the config's paths.root_dir."""
    if root is None:
        root = str(Path(str((config.get("paths") or {}).get("root_dir") or ".")).resolve())
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flat_settings(value, f"{name}.", root))
        elif not name.startswith(NOT_SETTINGS):
            flat[name] = as_json(value, root)
    return flat


def computes_the_same(setting: str) -> bool:
    """Whether `setting` may change on a resume without changing what the run computes."""
    return setting.startswith(LAYOUT_AND_BOOKKEEPING) and not setting.startswith(COMPUTING_EVEN_IF_LAYOUT)


def value_of(settings: Mapping[str, str], setting: str) -> str:
    """A setting's value as JSON; one a run does not have is null (a strategy without float8 has no such key)."""
    return settings.get(setting, "null")


def shown(value: str) -> str:
    """A setting's JSON value as the warning says it: a whole number without its `.0`."""
    decoded = json.loads(value)
    return str(int(decoded)) if isinstance(decoded, float) and decoded.is_integer() else value


def as_override(setting: str, value: str, now: Mapping[str, str]) -> str:
    """`setting=value` as a command line sets it back: a string bare, anything else as JSON writes it (without
    spaces, one shell word), a whole number without its `.0`; `+setting` where this run's config has no such key."""
    decoded = json.loads(value)
    return f"{'' if setting in now else '+'}{setting}={decoded if isinstance(decoded, str) else shown(value)}"


def settings_changed(saved: Mapping[str, str], now: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """The settings whose values differ between the checkpoint's run and this one: those that change what the run
    computes, and the layout's and bookkeeping's; the schedule's are left out."""
    names = saved.keys() | now.keys()
    differ = sorted(k for k in names if value_of(saved, k) != value_of(now, k) and k not in SCHEDULE_SETTINGS)
    return [k for k in differ if not computes_the_same(k)], [k for k in differ if computes_the_same(k)]


def resume_warning(saved: Mapping[str, str], now: Mapping[str, str], computing: list[str]) -> str:
    said = "; ".join(f"{k}: {shown(value_of(saved, k))} there, {shown(value_of(now, k))} here" for k in computing)
    keep = " ".join(as_override(k, value_of(saved, k), now) for k in computing)
    return (
        f"resuming with settings that change what the run computes, against the checkpoint's run: {said}. To "
        f"continue the checkpoint's run as it was, set {keep}; a resume may change the layout and the bookkeeping "
        "freely (docs/runs.md, 'What a resume may change')."
    )


class RunSettings(Callback):
    """Keeps `settings` (flat_settings of the run's resolved config, secrets redacted) in every checkpoint, and warns
    once, as a resume loads its checkpoint, of the settings that change what the run computes and of a change of the
    learning-rate `schedule` (schedule_record of this run), in one warning. A checkpoint written before the settings'
    record says only its schedule's change. A rollback that restarts from the checkpoint the run resumed from says it
    again."""

    def __init__(self, settings: dict[str, str], schedule: Mapping[str, float]):
        self.settings = settings
        self.schedule = dict(schedule)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[RECORD] = dict(self.settings)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        said = []
        saved = checkpoint.get(RECORD)
        computing, bookkeeping = settings_changed(saved, self.settings) if isinstance(saved, Mapping) else ([], [])
        if computing:
            said.append(resume_warning(saved, self.settings, computing))  # type: ignore[arg-type]
        step = int(checkpoint.get("global_step", 0))
        if schedule := schedule_change(checkpoint["schedule"], self.schedule, step):
            said.append(schedule[0].upper() + schedule[1:] if said else schedule)
        if said:
            rank_zero_warn(" ".join(said))
        if bookkeeping:
            rank_zero_info(f"resuming with other settings of the layout or bookkeeping: {', '.join(bookkeeping)}")
