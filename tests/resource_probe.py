"""A callback for tests/test_stability.py, added to a run as `+callbacks.resources._target_=tests.resource_probe.
CountResources`: as each fit starts (the first, and each that a rollback builds again in the same process), it
appends to `<output_dir>/resources/rank<R>.jsonl` what the process holds: open file descriptors (the sockets of every
gloo process group among them), threads (the process's own, from /proc: those of the groups' native workers too) and
Python threads."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer


class CountResources(Callback):
    def __init__(self, output_dir: str):
        self.output_dir = Path(output_dir)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        held = {
            "step": trainer.global_step,
            "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task")),
            "python_threads": threading.active_count(),
        }
        path = self.output_dir / "resources" / f"rank{trainer.global_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(json.dumps(held) + "\n")
