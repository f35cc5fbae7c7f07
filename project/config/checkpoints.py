"""ckpt_path and init_from: the checkpoint or published folder a run starts from, checked before torch."""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from project.checkpoint.urls import check_url, is_remote
from project.runtime.errors import ConfigError

# ckpt_path=auto: resume from the run's last checkpoint where there is one, start the run otherwise.
AUTO = "auto"
# The step in a save's name: step-000012.ckpt (kept by ckpt_keep_last), best-step000012.ckpt (the best checkpoint).
STEP_IN_NAME = re.compile(r"step[=-]?(\d+)\.ckpt$")
# torch.distributed.checkpoint's index of a sharded folder, written after every rank's shards (as
# project.checkpoint.locations names it; that module imports torch, which these checks run before).
SHARDED_METADATA = ".metadata"


def checkpoint_dir(cfg: DictConfig, run_dir: str | os.PathLike) -> str:
    """Where the run's checkpoints go: `ckpt_dir`, a local folder or an s3:// URL; by default the run directory's
    checkpoints/."""
    value = cfg.get("ckpt_dir")
    return str(value).rstrip("/") if value else str(Path(run_dir) / "checkpoints")


def check_ckpt_dir(cfg: DictConfig) -> None:
    """An object-storage `ckpt_dir` or `ckpt_path` is one the platform reads and writes (S3)."""
    value = cfg.get("ckpt_dir")
    for setting, url in (("ckpt_dir", value), ("ckpt_path", cfg.get("ckpt_path"))):
        if is_remote(url):
            check_url(url, setting)


def saves_in(folder: str | os.PathLike) -> list[Path]:
    """The checkpoints a local checkpoint folder holds: last.ckpt (or the previous one kept aside while it is
    replaced, last.ckpt.old), best-step*.ckpt, step-*.ckpt; files or sharded folders."""
    path = Path(folder)
    return sorted(p for p in path.iterdir() if p.name.endswith((".ckpt", ".ckpt.old"))) if path.is_dir() else []


def step_in_name(path: Path) -> int | None:
    """The step a save's name carries (step-000012.ckpt, best-step000012.ckpt), or None for another name."""
    match = STEP_IN_NAME.search(path.name)
    return int(match[1]) if match else None


def complete_save(path: Path) -> bool:
    """A save whose writing ended: a file that is a whole zip archive (torch.save's, whose directory is written
    last), or a sharded folder with its `.metadata` (written after every rank's shards)."""
    return zipfile.is_zipfile(path) if path.is_file() else (path / SHARDED_METADATA).is_file()


def newest_complete_save(folder: str | os.PathLike) -> Path | None:
    """Of a checkpoint folder's step-<N> and best-step<N> saves, the complete one of the highest step."""
    stepped = [(step, path) for path in saves_in(folder) if (step := step_in_name(path)) is not None]
    return next((path for _, path in sorted(stepped, reverse=True) if complete_save(path)), None)


def resume_point(cfg: DictConfig, run_dir: str | os.PathLike) -> str | None:
    """What `ckpt_path` resumes from, with `auto` decided: `last` where the run's checkpoint folder holds last.ckpt
    (or the one kept aside while it was replaced); else the newest complete save there (step-<N>.ckpt,
    best-step<N>.ckpt: last.ckpt left out or removed), as a path; else None, a new run. Any other value as it is.
    In object storage, where `latest` names the last complete save (project.checkpoint.latest)."""
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is None or str(ckpt_path) != AUTO:
        return ckpt_path
    folder = checkpoint_dir(cfg, run_dir)
    if is_remote(folder):
        from project.checkpoint.latest import latest  # reads the storage: only as the run starts

        return "last" if latest(folder) is not None else None
    last = Path(folder) / "last.ckpt"
    if last.exists() or last.with_name(f"{last.name}.old").exists():
        return "last"
    if newest := newest_complete_save(folder):
        return str(newest)
    if found := saves_in(folder):  # saves, but none whole: each cut short, or of names that carry no step
        raise ConfigError(
            f"ckpt_path=auto: {folder} holds checkpoints ({', '.join(p.name for p in found[:3])}) but none that is "
            "whole and names its step (each save was cut short, or is named otherwise), and a new run there would "
            "replace them: give this run a folder of its own (hydra.run.dir=outputs/runs/NAME), or, for a save of "
            "another name, pass it as ckpt_path=PATH."
        )
    return None


def hydra_run_dir(run_dir: str | os.PathLike | None) -> str | os.PathLike | None:
    """`run_dir`, or Hydra's run directory where Hydra runs (not a config composed by Hydra's compose API, which
    has none)."""
    if run_dir is None and HydraConfig.initialized():
        return OmegaConf.select(HydraConfig.get(), "runtime.output_dir", default=None)
    return run_dir


def resumes_from_inside(ckpt_path: object, folder: str) -> bool:
    """Whether `ckpt_path` resumes the run whose checkpoints are in `folder`: last, auto, or a save in it."""
    if str(ckpt_path) in ("last", AUTO):
        return True
    if is_remote(str(ckpt_path)):
        return False
    return Path(folder).resolve() in Path(str(ckpt_path)).resolve().parents


def refuse_new_run_over_saves(cfg: DictConfig, run_dir: str | os.PathLike | None) -> None:
    """A new run (no ckpt_path, or another run's checkpoint) into a local checkpoint folder that holds saves would
    replace them (last.ckpt, the best checkpoint) and, in its run directory, cut metrics.csv and config.yaml:
    refused, naming both ways on."""
    run_dir = hydra_run_dir(run_dir)
    ckpt_path = cfg.get("ckpt_path")
    if run_dir is None and not cfg.get("ckpt_dir"):
        return
    folder = checkpoint_dir(cfg, run_dir or ".")
    if ckpt_path is not None and resumes_from_inside(ckpt_path, folder):
        return
    if is_remote(folder) or not (found := saves_in(folder)):
        return  # object storage: project.checkpoint.latest.refuse_another_runs, once the run can reach it
    where = f"ckpt_dir={folder}" if cfg.get("ckpt_dir") else f"hydra.run.dir={run_dir}"
    what = "a new run" if ckpt_path is None else f"a run resumed from ckpt_path={ckpt_path}, another run's checkpoint,"
    raise ConfigError(
        f"{where} holds the checkpoints of an earlier run ({', '.join(p.name for p in found[:3])}"
        f"{', ...' if len(found) > 3 else ''} in {folder}): {what} there would replace them and its records. "
        "Resume that run with ckpt_path=last (or ckpt_path=auto, which resumes where there is a checkpoint and "
        "starts otherwise), or give this run a folder of its own (hydra.run.dir=outputs/runs/NAME"
        f"{', ckpt_dir=DIR' if cfg.get('ckpt_dir') else ''})."
    )


def check_ckpt_path(cfg: DictConfig, run_dir: str | os.PathLike | None = None, new_runs_checked: bool = True) -> None:
    """A checkpoint named by path exists; `last`, that of the run directory `run_dir` (Hydra's, by default), or of
    `ckpt_dir`; `auto`, either or none. One in object storage is looked for when the run starts (this check reads no
    network). With `new_runs_checked` (not for a dry run, which writes none of a run's files), a new run into a
    folder of saves is refused."""
    check_ckpt_dir(cfg)
    if new_runs_checked:
        refuse_new_run_over_saves(cfg, run_dir)
    ckpt_path = cfg.get("ckpt_path")
    if str(ckpt_path) == AUTO and (run_dir := hydra_run_dir(run_dir)) is not None:
        if not is_remote(checkpoint_dir(cfg, run_dir)):  # object storage is looked at when the run starts
            resume_point(cfg, run_dir)  # refuses saves it cannot resume from
        return
    if ckpt_path is None or is_remote(ckpt_path) or str(ckpt_path) == AUTO:
        return
    if str(ckpt_path) == "last":
        run_dir = hydra_run_dir(run_dir)
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
    if ckpt_path is not None and str(ckpt_path) not in ("last", AUTO):
        raise ConfigError(
            f"init_from={cfg.init_from} and ckpt_path={ckpt_path} both given: init_from starts a new run from a "
            "published model's weights (step 0, a fresh optimizer and schedule); ckpt_path resumes a run from its "
            "checkpoint. Drop ckpt_path to start from the folder, or init_from to resume. (ckpt_path=last or auto "
            "beside init_from resumes the run in hydra.run.dir, the folder giving only the model's shape, so that a "
            "requeued job's command line still works.)"
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
