"""Checkpoints written in the background (`ckpt_async=true`).

The step that saves copies the training state to host memory, into the host tensors of the save before it
(project.checkpoint.staging), and training goes on while a thread writes the copy: a folder of shards through
torch's distributed checkpoint `async_save`, or one file streamed by torch.save (write_checkpoint_file). One write
at a time: `wait` returns when the one in flight has ended.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from project.checkpoint.locations import Location, storage_errors, storage_writer
from project.checkpoint.staging import ReusedHostCopies


class BackgroundWriter:
    """Writes one checkpoint at a time in a thread, from a copy made in host memory as the save is asked for."""

    def __init__(self, pinned: bool):
        # Staged while the caller waits (the state must not change while it is copied); pinned on a GPU, where
        # the copy from the device is then faster.
        self._stager = ReusedHostCopies(pinned)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self.in_flight: Future | None = None
        self.path: Location | None = None  # where the write in flight goes

    def write_folder(self, state: dict[str, Any], path: Location, group: dist.ProcessGroup | None) -> Future:
        """A distributed checkpoint of `state` (every rank its shards) in the folder `path`; `group` must have a CPU
        backend (gloo): the ranks agree on the metadata from the writing thread."""
        written = dcp.async_save(
            state, storage_writer=storage_writer(path), process_group=group, async_stager=self._stager
        )
        assert isinstance(written, Future)  # staged in this thread, so the future is the write's
        return self._started(written, path)

    def write_file(self, checkpoint: dict[str, Any], path: Location, write: Callable[[Any, Location], Any]) -> Future:
        """`write(copy, path)` in the thread, `copy` the checkpoint's tensors staged in host memory."""
        staged = self._stager.stage(checkpoint)  # staged here (not asynchronous staging): the copy itself
        return self._started(self._thread.submit(write, staged, path), path)

    def nothing_to_write(self, path: Location) -> Future:
        """A rank that writes nothing of this save (DDP's others) holds a finished write, like the rank that does."""
        return self._started(finished(), path)

    def _started(self, written: Future, path: Location) -> Future:
        self.in_flight, self.path = written, path
        return written

    def wait(self) -> tuple[Location | None, BaseException | None]:
        """Wait for the write in flight: (its path, its error, if it failed); (None, None) when none was."""
        written, path = self.in_flight, self.path
        self.in_flight = self.path = None
        if written is None:
            return None, None
        try:
            written.result()
        except BaseException as error:  # reported by the caller, which agrees with the other ranks first
            return path, error
        return path, None

    def close(self) -> None:
        path, error = self.wait()
        if error is not None:  # a run ending otherwise (an exception): the write's failure is said, not raised
            warnings.warn(f"the checkpoint written in the background to {path} failed: {cause_of(error)}", stacklevel=2)
        self._thread.shutdown(wait=True)
        self._stager.close()


def cause_of(error: BaseException) -> BaseException:
    """What made a write fail: for torch's distributed checkpoint, which gathers every rank's failure with its
    traceback, the first rank's own error (a full disk's OSError first)."""
    failures = [failure for failure, _ in getattr(error, "failures", {}).values()]  # CheckpointException's
    return next((f for f in failures if isinstance(f, storage_errors())), failures[0] if failures else error)


def finished() -> Future:
    """A write that is already over: what a save written before it returned, or by another rank, stands for."""
    done: Future = Future()
    done.set_result(None)
    return done
