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
import time
import traceback
from pathlib import Path

_PR_SET_PDEATHSIG = 1

# Lightning's launcher on this node, once the trainer has one: its `procs` are ranks 1.. of the node.
_launcher = None


def watch_children(launcher) -> None:
    """Remember the launcher of this node's other ranks, so that a failure here can name the one that ended."""
    global _launcher
    _launcher = launcher if hasattr(launcher, "procs") else None


def ended_children(wait_seconds: float = 8.0) -> list[tuple[int, int, int]]:
    """(global rank, PID, exit code) of this node's child ranks that ended with an error, those killed by a
    signal first, waiting up to `wait_seconds` for one.

    A rank killed outright leaves no error of its own: rank 0 sees only a failed collective, and
    Lightning's observer, which names the child, looks only every 5 s. Waiting here names it either way.
    Other ranks may fail in their own collectives meanwhile (status 1): a signal names the cause better.
    """
    procs = list(getattr(_launcher, "procs", None) or [])
    deadline = time.monotonic() + wait_seconds
    while procs:
        ended = [(local_rank, proc) for local_rank, proc in enumerate(procs, start=1) if proc.poll()]
        if ended or time.monotonic() > deadline:
            node = _launcher.cluster_environment.node_rank()
            found = [
                (node * _launcher.num_processes + local_rank, proc.pid, proc.returncode) for local_rank, proc in ended
            ]
            return sorted(found, key=lambda child: (child[2] > 0, child[0]))  # killed by a signal: negative codes
        time.sleep(0.2)
    return []


def _ended_by(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def launched_by_another_process() -> bool:
    """A rank that Lightning's launcher (LOCAL_RANK > 0 in a plain run) or torchrun started."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return True
    return os.environ.get("LOCAL_RANK", "0") != "0" and "SLURM_PROCID" not in os.environ


def die_with_launcher() -> None:
    """SIGKILL this process when the process that started it ends (Linux; elsewhere nothing changes)."""
    if launched_by_another_process():
        die_with_parent()


def die_with_parent() -> None:
    """SIGKILL this process when its parent process ends (Linux; elsewhere nothing changes). The parent's
    thread that started this process must be its main thread: Linux acts when that thread ends."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the request was in place
        os.kill(os.getpid(), signal.SIGKILL)


def world() -> tuple[int, int]:
    """(global rank, world size) of this process: the process group's once it exists, else the launcher's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from project.runtime.console import launch_rank

    sizes = (os.environ.get(v) for v in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"))  # as launch_rank
    return launch_rank(), int(next((size for size in sizes if size), 1))


def report_failed_rank(error: BaseException, run_dir: Path) -> None:
    """After a rank's traceback, one line naming the rank and what ended it, in a run of several processes.

    The first rank to fail raises its own error; the others then fail in their next collective, or are
    ended by the launcher. These lines tell a user which rank to look at.
    """
    rank, size = world()
    if size <= 1:
        return
    reason = next((line for line in str(error).strip().splitlines() if line.strip()), "")
    if _is_collective_failure(error) and (ended := ended_children()):
        other, pid, code = ended[0]
        also = "".join(f"; rank {r} (PID {p}) {_ended_by(c)} too" for r, p, c in ended[1:])
        what = (
            f"a collective operation failed, because rank {other} (PID {pid}) ended: {_ended_by(code)} "
            f"(its console is in {run_dir / f'train.rank{other}.log'}){also}"
        )
    elif _is_collective_failure(error):
        what = (
            "a collective operation failed, because another rank ended or stopped answering "
            "(look for the first rank that failed: its error comes first, or in its own train.rank<N>.log; "
            "strategy.collective_timeout_minutes bounds the wait, strategy.startup_timeout_minutes until the first "
            "step has ended)"
        )
        if rank == 0:  # no rank ended: one stopped answering. Where each one was, from the stacks they wrote
            what += calls_said(error, run_dir, size)
    else:
        what = f"{type(error).__name__}: {reason}"
    log = run_dir / ("train.log" if rank == 0 else f"train.rank{rank}.log")
    print(f"error: rank {rank} of {size} failed: {what}. Its console is in {log}.", file=sys.stderr, flush=True)


def calls_said(error: BaseException, run_dir: Path, size: int) -> str:
    """`; the ranks were in: rank 0 in all_reduce (...), rank 1 in ...`: this rank's from its error's traceback,
    the others' from the stacks their watchdog wrote into their console logs (project.runtime.stacks)."""
    from project.runtime.stacks import calls_of_ranks, short_path

    calls = calls_of_ranks(run_dir, size)
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        frame = frames[-1]
        calls[0] = f"{frame.name} ({short_path(frame.filename)}:{frame.lineno})"
    said = "; ".join(f"rank {rank} in {calls[rank]}" for rank in sorted(calls))
    silent = [str(rank) for rank in range(size) if rank not in calls]
    where = f"; the ranks were in: {said}" if said else ""
    return where + (f" (rank(s) {', '.join(silent)} wrote no stack)" if silent else "")


def _is_collective_failure(error: BaseException) -> bool:
    import torch.distributed as dist

    text = str(error)
    return (
        isinstance(error, dist.DistError)
        or type(error).__name__ == "HorovodInternalError"
        or any(
            sign in text
            for sign in (
                "Connection closed by peer",
                "Connection reset by peer",
                "Timed out",
                "timed out",
                "Broken pipe",
            )
        )
    )
