"""Loader worker processes that start safely from a training process, which has threads by then.

When a loader starts its workers, the training process runs other threads: wandb's, Lightning's
observer of the other ranks, the progress bar's monitor, the feeders of the loader before. A worker
forked from it inherits their locks as they were at that instant, and one held then is held for good
in the worker: the worker hangs on it, and training waits on the worker (wandb's issue 12079 is one
such lock; Python 3.12 warns at every such fork and 3.14 no longer forks by default).

So workers fork from a forkserver instead: a process started for the purpose, with one thread, that
has imported what a worker runs (project.data.blocks: torch and litdata) once. `project.train` starts
it before its own imports, so that the two import side by side and the first batch does not wait.
Kept out of the project.data package, whose import would load litdata here, before the run's imports.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

# The first ends the server with the training process; the second is what a worker runs.
WORKER_IMPORTS = ["project.loader_server", "project.data.blocks"]


def start_method() -> str | None:
    """"forkserver" where the platform has it (Linux, macOS); otherwise multiprocessing's default."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else None


def start_worker_server() -> None:
    """Start the process that loader workers fork from, unless it runs; returns without waiting for it."""
    if start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    # Only the first start reads the list: later calls find the server running and change nothing.
    multiprocessing.set_forkserver_preload(WORKER_IMPORTS)
    forkserver.ensure_running()


def loader_options(workers: int) -> dict[str, Any]:
    """DataLoader arguments for `workers` worker processes (0: batches are read in the training process)."""
    if workers == 0:
        return {"num_workers": 0}
    start_worker_server()
    return {"num_workers": workers, "persistent_workers": True, "multiprocessing_context": start_method()}
