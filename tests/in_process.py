"""Training runs of several layouts in one group of gloo processes, started once.

`python -m project.train` on N processes costs N Python start-ups (about 2 s of imports each, on 2 cores that
take turns) and Lightning's relaunch of the command, per run. Here the ranks start once, forked warm from the
pytest worker's start-up server (tests/warm_start.py), join one gloo process group, and run each case in turn
through the same code as the command (project.config.checks.preflight, then project.training.run.train), with
Lightning's launcher left out: the ranks look to it as if torchrun had started them (LOCAL_RANK, WORLD_SIZE), and
it finds the process group already there. What a case writes (its run directory: metrics.csv, checkpoints,
train.log) is what the command would write.

The command itself stays tested end to end, once per strategy family (tests/test_train_end_to_end.py and others).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def train_in_process(world_size: int, cases: list[tuple[Path, list[str]]], timeout: float = 1800) -> None:
    """Train each case (its run directory, its `project.train` overrides) on `world_size` gloo ranks, in order.

    A case that fails on any rank fails the caller with that rank's traceback; the cases after it do not run.
    """
    from warm_start import shared_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as listed:
        json.dump([[str(run_dir), overrides] for run_dir, overrides in cases], listed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONFAULTHANDLER": "1"}
    env.pop("PYTEST_CURRENT_TEST", None)
    args = [str(world_size), str(port), listed.name]
    ranks = [shared_server().start("tests.in_process", [str(r), *args], ROOT, env) for r in range(world_size)]
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [r.poll() for r in ranks]
            if all(code == 0 for code in codes):
                return
            failed = next((rank for rank, code in enumerate(codes) if code), None)
            if failed is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    ranks[failed].communicate(timeout=30)  # all it printed
                stderr = ranks[failed].printed()[1]
                pytest.fail(f"an in-process run failed on rank {failed}:\n{stderr[-10000:]}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"{len(cases)} in-process runs on {world_size} ranks took more than {timeout:.0f} s")
            time.sleep(0.2)
    finally:
        for r in ranks:
            if r.poll() is None:
                os.killpg(r.pid, signal.SIGKILL)
                r.wait()
        os.unlink(listed.name)


def _rank(rank: int, world_size: int, port: int, cases: list[tuple[Path, list[str]]]) -> None:
    import torch
    import torch.distributed as dist

    # What torchrun would set: Lightning then starts no processes of its own (its environment's
    # creates_processes_externally) and keeps the process group it finds.
    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    for run_dir, overrides in cases:
        try:
            _train(run_dir, overrides)
        except BaseException:  # said with the case, whose overrides the traceback alone would not name
            print(f"{' '.join(overrides)} (rank {rank}):\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            os._exit(1)
        dist.barrier()
    dist.destroy_process_group()
    # Done: leave without the interpreter's shutdown, which gloo's threads abort now and then
    # ("terminate called without an active exception").
    os._exit(0)


def _train(run_dir: Path, overrides: list[str]) -> None:
    """What `python -m project.train OVERRIDES hydra.run.dir=RUN_DIR` runs on this rank, Hydra's main aside; an
    override `FAULT=...` injects faults as `FAULT=... python -m tests.faults` does (tests/faults.py)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    import project.training.run
    from project.config.checks import preflight
    from project.training.run import train
    from tests.faults import Fault, with_faults

    faults = [Fault.parse(f) for o in overrides if o.startswith("FAULT=") for f in o.split("=", 1)[1].split(",")]
    overrides = [o for o in overrides if not o.startswith("FAULT=")]

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    build_trainer = project.training.run.build_trainer
    project.training.run.build_trainer = with_faults(build_trainer, faults)
    try:
        train(cfg, preflight(cfg))
    finally:
        project.training.run.build_trainer = build_trainer


if __name__ == "__main__":  # one rank: python -m tests.in_process RANK WORLD_SIZE PORT CASES.json
    rank_, world_size_, port_, listed_ = sys.argv[1:]
    _rank(int(rank_), int(world_size_), int(port_), [(Path(d), o) for d, o in json.loads(Path(listed_).read_text())])
