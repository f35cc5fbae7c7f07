"""Train a Llama: `python -m project.train experiment=NAME [overrides]`.

Composes the config with Hydra, checks the settings (project.config.checks) before torch and Lightning are
imported, so a mistake is answered in about a second, then runs project.training.run.train.
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from project.config.checks import preflight
from project.config.command_line import check_command_line
from project.data.loader_workers import start_worker_server
from project.planning.dry_run import dry_run_argv
from project.planning.fits import check_gpu_memory, check_host_memory, trains_on_gpus
from project.runtime.console import launch_rank
from project.runtime.errors import ConfigError, TrainingStopped, config_error_behind, exit_on_config_error
from project.runtime.processes import die_with_launcher, report_failed_rank
from project.runtime.startup import collector_paused_for_imports


def forget_refused_run(run_dir: Path) -> None:
    """Remove the directory Hydra made for a run that was refused before it started: it holds only the
    console logs (and, from older versions, Hydra's record .hydra/), and would read as a run that trained.
    Anything else in it stays."""
    if run_dir.is_dir() and all(
        p.name == ".hydra" or p.name.startswith("train.") and p.suffix == ".log" for p in run_dir.iterdir()
    ):
        shutil.rmtree(run_dir, ignore_errors=True)


def planned_layout(cfg: DictConfig):
    """The layout on the devices the Trainer will take (`trainer.devices: auto` resolved), as training plans it."""
    from project.config.layout import plan_layout
    from project.training.trainer import devices_per_node

    return plan_layout(cfg, cfg.trainer.get("num_nodes", 1), devices_per_node(cfg))


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        # Lightning starts the other ranks by re-running this command, so each re-runs the multirun:
        # conf/train.yaml's hydra.sweep.dir reads this, so that they write into this multirun's folder
        # rather than one named after their own, later, start time.
        os.environ["PROJECT_MULTIRUN_DIR"] = str(Path(HydraConfig.get().sweep.dir).absolute())
    with exit_on_config_error():
        try:
            layout = preflight(cfg, dry_run=cfg.dry_run.enabled)  # seconds, before the imports below
            if cfg.dry_run.enabled:
                from project.planning.dry_run import dry_run

                strategy = HydraConfig.get().runtime.choices.get("strategy", "strategy")
                dry_run(cfg, layout, strategy, Path(HydraConfig.get().runtime.output_dir))
                return None
            if layout is not None:  # a CPU run's processes against this machine's memory, before the imports
                check_host_memory(cfg, layout)
            if cfg.data.get("loader_workers", 0) > 0:
                start_worker_server()  # its imports run beside the ones below
            with collector_paused_for_imports():  # torch, Lightning, litdata: half a second faster
                from project.training.run import train
            if trains_on_gpus(cfg):  # each process against its GPU's memory, now that torch can read it
                check_gpu_memory(cfg, layout or planned_layout(cfg))

            return train(cfg, layout).get("val/loss")
        except ConfigError:
            forget_refused_run(Path(HydraConfig.get().runtime.output_dir))
            raise
        except TrainingStopped:
            raise
        except KeyboardInterrupt:  # Ctrl-C outside the fit's steps (inside them, StopOnSignal saves and stops)
            if launch_rank(cfg.trainer.get("num_nodes", 1)) == 0:
                print("stopped by Ctrl-C outside training's steps: nothing more was saved", file=sys.stderr)
            raise SystemExit(130) from None
        except Exception as error:  # a bug, or a collective that failed because another rank did
            if (cause := config_error_behind(error)) is not None:  # a setting refused inside Hydra's instantiate
                forget_refused_run(Path(HydraConfig.get().runtime.output_dir))
                raise cause from None
            # Printed here rather than by Hydra, whose report repeats the command line's overrides (secrets too).
            traceback.print_exc()
            report_failed_rank(error, Path(HydraConfig.get().runtime.output_dir))
            raise SystemExit(1) from None


if __name__ == "__main__":
    die_with_launcher()
    sys.argv[1:] = dry_run_argv(sys.argv[1:])
    with exit_on_config_error():
        check_command_line(sys.argv[1:])  # before Hydra: its own answer to a typo is a traceback hint
    main()
