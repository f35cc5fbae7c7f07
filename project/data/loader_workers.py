"""Loader worker processes that start safely from a training process, which has threads by then.

When a loader starts its workers, the training process runs other threads: wandb's, Lightning's
observer of the other ranks, the progress bar's monitor, the feeders of the loader before. A worker
forked from it inherits their locks as they were at that instant, and one held then is held for good
in the worker: the worker hangs on it, and training waits on the worker (wandb's issue 12079 is one
such lock; Python 3.12 warns at every such fork and 3.14 no longer forks by default).

So on Linux workers fork from a forkserver instead: a process started for the purpose, running no
Python thread but its main one, that has imported what a worker runs (project.data.blocks: torch and
litdata; the imports of the main module, which each worker re-runs) once. `project.train` starts it before its own
imports, so that the two import side by side and the first batch does not wait.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from typing import Any

from project.runtime.processes import die_with_parent

# The first ends the server with the training process; the second is what a worker runs.
WORKER_IMPORTS = ["project.data.loader_server", "project.data.blocks"]
JOB_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# Ctrl-C and `kill -TERM -PGID` reach every process of the job's group; the training process saves at its next step
# and stops (project.training.callbacks.preemption), and what it reads from must go on until then.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def start_method() -> str | None:
    """ "forkserver" on Linux; elsewhere multiprocessing's default (spawn on macOS and Windows), since only
    Linux can end the server with the training process (project.data.loader_server)."""
    return "forkserver" if sys.platform.startswith("linux") else None


def start_worker_server() -> None:
    """Start the process that loader workers fork from, unless it runs; returns without waiting for it."""
    if start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    # Only the first start reads the list: later calls find the server running and change nothing.
    multiprocessing.set_forkserver_preload(WORKER_IMPORTS + imports_of_main())
    # Started with these ignored, the server and multiprocessing's resource tracker keep them ignored (exec
    # keeps an ignored signal ignored), and so do the workers the server forks. A launcher sends them to
    # every process of a job for the training process to act on (SLURM's SIGUSR1 ahead of a preemption or
    # its time limit); their default would end these processes at once, and the training process, which
    # saves at its next step, would find its loader broken. So would it if Ctrl-C or a group's SIGTERM ended the
    # server (it ends with the training process: project.data.loader_server); workers leave the group instead
    # (`start_worker`). Handlers can be set from the main thread only.
    main_thread = threading.current_thread() is threading.main_thread()
    ignored = (*JOB_SIGNALS, *STOP_SIGNALS)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignored} if main_thread else {}
    try:
        forkserver.ensure_running()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def imports_of_main() -> list[str]:
    """What the main module has imported so far of its own package and of Hydra, for the server to preload.

    A worker re-runs the main module (as __mp_main__, the rule of every start method but fork); with these
    loaded in the server, that re-run finds its imports ready. The main module itself is left out: runpy
    warns in every worker when the module it is to run was imported already.
    """
    main = getattr(sys.modules["__main__"].__spec__, "name", None)  # `python -m NAME`; None for a script
    if main is None or main.endswith("__main__"):  # a script or a package's __main__ is not re-run
        return []
    roots = {main.partition(".")[0], "hydra", "omegaconf"}
    return sorted(name for name in list(sys.modules) if name != main and name.partition(".")[0] in roots)


def start_worker(worker_id: int) -> None:
    """A worker's start (DataLoader's worker_init_fn).

    A process group of its own, so that a signal to the job's group (a terminal's Ctrl-C, `kill -TERM -PGID`) reaches
    the training process, which acts on it at a step, and not its workers, which read on; the loader still ends them
    as it does (its queues, then SIGTERM). Outside the terminal's foreground group, a write to the terminal must not
    stop the worker (SIGTTOU).

    And an end with the server it was forked from, which ends with the training process (project.data.loader_server):
    a run killed outright leaves no worker behind, where torch's own watch of the parent would take up to five
    seconds (its MP_STATUS_CHECK_INTERVAL), holding the worker's memory and the job's console till then.
    """
    os.setpgid(0, 0)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    die_with_parent()


def loader_options(workers: int) -> dict[str, Any]:
    """DataLoader arguments for `workers` worker processes (0: batches are read in the training process)."""
    if workers == 0:
        return {"num_workers": 0}
    start_worker_server()
    return {
        "num_workers": workers,
        "persistent_workers": True,
        "multiprocessing_context": start_method(),
        "worker_init_fn": start_worker,
    }
