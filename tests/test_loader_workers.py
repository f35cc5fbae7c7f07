"""Loader workers start cleanly however many threads the training process runs when it starts them."""

import threading

import torch
from torch.utils.data import DataLoader, Dataset

from project.loader_workers import loader_options

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
