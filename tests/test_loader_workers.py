"""Loader workers start cleanly however many threads the training process runs when it starts them."""

import contextlib
import os
import signal
import sys
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from project.data.loader_workers import loader_options

# Held by the test's main thread while the loader starts its worker, as another thread of a training
# process (wandb's, a progress bar's, a queue feeder's) may hold one of its locks at that instant.
HELD = threading.Lock()


class NeedsTheLock(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        with HELD:  # a worker forked from this process would inherit the lock held, and wait here forever
            return torch.tensor([index])


def test_a_worker_does_not_inherit_a_lock_another_thread_holds_when_it_starts():
    loader = DataLoader(NeedsTheLock(), batch_size=2, timeout=60, **loader_options(1))
    with HELD:
        batches = iter(loader)
        batch = next(batches)  # raises "DataLoader timed out" if the worker hangs on the lock
    assert batch.tolist() == [[0], [1]]


def test_no_workers_reads_in_the_training_process():
    assert loader_options(0) == {"num_workers": 0}


def descendants(pid: int) -> list[int]:
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the worker server is Linux's")
def test_workers_outlive_the_preemption_signal_a_launcher_sends_to_every_process_of_the_job():
    others = set(descendants(os.getpid()))  # this test process's own helpers (tests/warm_start.py's server)
    batches = iter(DataLoader(list(range(20)), batch_size=2, timeout=60, **loader_options(1)))
    assert next(batches).tolist() == [0, 1]
    started = [pid for pid in descendants(os.getpid()) if pid not in others]  # server, resource tracker, worker
    assert started
    for pid in started:  # as `scancel --signal=USR1` does to a SLURM job's processes
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(1)
    assert [next(batches).tolist() for _ in range(3)] == [[2, 3], [4, 5], [6, 7]]
