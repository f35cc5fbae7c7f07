"""Training runs of several layouts in one group of gloo processes, started once.

`python -m project.train` on N processes costs N Python start-ups (about 2 s of imports each, on 2 cores that
take turns) and Lightning's relaunch of the command, per run. Here the ranks start once, join one gloo process
group, and run each case in turn through the same code as the command (project.config.checks.preflight, then
project.training.run.train), with Lightning's launcher left out: the ranks look to it as if torchrun had
started them (LOCAL_RANK, WORLD_SIZE), and it finds the process group already there. What a case writes (its
run directory: metrics.csv, checkpoints, train.log) is what the command would write.

The command itself stays tested end to end, once per strategy family (tests/test_train_end_to_end.py and others).
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONF = Path(__file__).resolve().parents[1] / "conf"


def train_in_process(world_size: int, cases: list[tuple[Path, list[str]]], timeout: float = 1800) -> None:
    """Train each case (its run directory, its `project.train` overrides) on `world_size` gloo ranks, in order.

    A case that fails on any rank fails the caller with that rank's traceback; the cases after it do not run.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.spawn(_rank, args=(world_size, port, cases), nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{len(cases)} in-process runs on {world_size} ranks took more than {timeout:.0f} s")
    except mp.ProcessRaisedException as error:
        pytest.fail(f"an in-process run failed:\n{error}", pytrace=False)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def _rank(rank: int, world_size: int, port: int, cases: list[tuple[Path, list[str]]]) -> None:
    # What torchrun would set: Lightning then starts no processes of its own (its environment's
    # creates_processes_externally) and keeps the process group it finds.
    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "WANDB_MODE": "offline",
        }
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    for run_dir, overrides in cases:
        try:
            _train(run_dir, overrides)
        except BaseException as error:  # said with the case, whose overrides the traceback alone would not name
            raise RuntimeError(f"{' '.join(overrides)} (rank {rank}):\n{traceback.format_exc()}") from error
        dist.barrier()
    dist.destroy_process_group()
    # Done: leave without the interpreter's shutdown, which gloo's threads abort now and then
    # ("terminate called without an active exception"), and which mp.spawn would report as a failure.
    os._exit(0)


def _train(run_dir: Path, overrides: list[str]) -> None:
    """What `python -m project.train OVERRIDES hydra.run.dir=RUN_DIR` runs on this rank, Hydra's main aside."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from project.config.checks import preflight
    from project.training.run import train

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    train(cfg, preflight(cfg))
