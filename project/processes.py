"""The processes of a multi-process run: none outlives its launcher, and a failed rank says who it is.

Lightning's launcher starts ranks 1.. of a node as children of rank 0 and kills them all when one of
them fails; torchrun's agent does the same for its workers. Neither helps when the launcher itself
dies (killed, out of memory): its children would wait in their next collective until the timeout, and
a stopped one forever. `die_with_launcher` asks Linux to kill them with it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def launched_by_another_process() -> bool:
    """A rank that Lightning's launcher (LOCAL_RANK > 0 in a plain run) or torchrun started."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return True
    return os.environ.get("LOCAL_RANK", "0") != "0" and "SLURM_PROCID" not in os.environ


def die_with_launcher() -> None:
    """SIGKILL this process when the process that started it ends (Linux; elsewhere nothing changes)."""
    if not sys.platform.startswith("linux") or not launched_by_another_process():
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher ended before the request was in place
        os.kill(os.getpid(), signal.SIGKILL)


def world() -> tuple[int, int]:
    """(global rank, world size) of this process: the process group's once it exists, else the launcher's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from project.console import launch_rank

    return launch_rank(), int(os.environ.get("WORLD_SIZE", 1))


def report_failed_rank(error: BaseException, run_dir: Path) -> None:
    """After a rank's traceback, one line naming the rank and what ended it, in a run of several processes.

    The first rank to fail raises its own error; the others then fail in their next collective, or are
    ended by the launcher. These lines tell a user which rank to look at.
    """
    rank, size = world()
    if size <= 1:
        return
    reason = next((line for line in str(error).strip().splitlines() if line.strip()), "")
    if _is_collective_failure(error):
        what = (
            "a collective operation failed, because another rank ended or stopped answering "
            "(look for the first rank that failed: its error comes first, or in its own train.rank<N>.log; "
            "strategy.collective_timeout_minutes bounds the wait)"
        )
    else:
        what = f"{type(error).__name__}: {reason}"
    log = run_dir / ("train.log" if rank == 0 else f"train.rank{rank}.log")
    print(f"error: rank {rank} of {size} failed: {what}. Its console is in {log}.", file=sys.stderr, flush=True)


def _is_collective_failure(error: BaseException) -> bool:
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Broken pipe")
    )
