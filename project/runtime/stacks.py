"""Every thread's Python stack in the rank's console log when the rank seems hung, and which call each rank was in.

A rank stuck in a collective, a driver or a file system runs no Python code, so nothing Python schedules can
report it; faulthandler's watchdog can (a C thread): `arm` sets it to write every thread's stack into the console
log unless `arm` (the next step) or `disarm` comes first, and `dump_on_signal` writes the main thread's when the
job is stopped (SIGTERM: a scheduler's time limit, `scancel`, `kill`), before the run's own handler is called.

After a collective fails, `calls_of_ranks` reads the latest stack each rank wrote into its log (waiting a few
seconds for those still to come) and names the innermost Python call of each rank's main thread, e.g. `rank 0
in all_reduce (torch/distributed/distributed_c10d.py:2950); rank 1 in on_train_batch_start (tests/faults.py:97)`.
"""

from __future__ import annotations

import faulthandler
import re
import signal
import time
from pathlib import Path
from typing import TextIO

from project.runtime import console

RUN_START = "== "  # the line keep_console writes where a run starts appending to a log
# faulthandler's format: a header per thread, then its frames, innermost first.
THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")
FRAME = re.compile(r'^  File "(?P<path>.*)", line (?P<line>\d+) in (?P<function>.*)$')


def _log() -> TextIO | None:
    log = console.current_log()
    if log is not None:
        log.flush()  # what the run printed before stays before the stacks
    return log


def arm(seconds: float) -> None:
    """Write every thread's stack into the console log if `arm` or `disarm` is not called within `seconds`.

    faulthandler's watchdog reads the threads' frames without the interpreter's lock: `seconds` must end while they
    stand still (a rank blocked in a collective), not as the collective's own timeout unwinds them."""
    log = _log()
    if log is not None:
        faulthandler.dump_traceback_later(seconds, repeat=False, file=log)


def disarm() -> None:
    faulthandler.cancel_dump_traceback_later()


def dump_on_signal(signums: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
    """On `signums`, the stack of the thread that receives it (Linux gives a process's signal to its main thread)
    into the console log first, then the handler in place before.

    Not every thread's: faulthandler would read the other threads' frames from inside the signal handler while they
    run on, and a thread that returns from a call or ends meanwhile crashes the reader (SIGSEGV, seen in tests when
    Lightning's child-process observer sent its SIGTERM and then ended)."""
    log = _log()
    if log is not None:
        for signum in signums:
            faulthandler.register(signum, file=log, all_threads=False, chain=True)


def stop_dumping_on_signal(signums: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
    for signum in signums:
        faulthandler.unregister(signum)


def short_path(path: str) -> str:
    """A frame's file as a reader finds it: inside an installed package from the package on, inside the working
    directory (the project) relative to it, else its last three parts."""
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return "/".join(Path(path).parts[-3:])


def innermost_call(text: str) -> str | None:
    """`function (path:line)` of the innermost frame of the main thread in the last stack dump of `text` (the
    part of a log since its run started); None if there is none. The main thread is the one not started by
    threading (its outermost frame is not threading's `_bootstrap`)."""
    threads: list[list[re.Match[str]]] = []
    for line in text.splitlines():
        if THREAD.match(line):
            threads.append([])
        elif threads and (frame := FRAME.match(line)):
            threads[-1].append(frame)
        elif threads and threads[-1] and not line.startswith("  "):
            threads.append([])  # the dump ended; anything after it is not a frame
    threads = [frames for frames in threads if frames]
    if not threads:
        return None
    # The last dump's threads: from the last run of consecutive thread blocks. Main: not started by threading.
    main = [frames for frames in threads if frames[-1]["function"] != "_bootstrap"] or threads
    frame = main[-1][0]
    return f"{frame['function']} ({short_path(frame['path'])}:{frame['line']})"


def _since_run_start(log: Path) -> str:
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    start = text.rfind("\n" + RUN_START)
    return text[start + 1 :] if start >= 0 else text


def calls_of_ranks(run_dir: Path, world_size: int, wait_seconds: float = 10.0) -> dict[int, str]:
    """{rank: innermost call} from each rank's console log (train.log, train.rank<N>.log), waiting up to
    `wait_seconds` for ranks whose stack is not there yet; ranks that wrote none are left out."""
    logs = {rank: run_dir / ("train.log" if rank == 0 else f"train.rank{rank}.log") for rank in range(world_size)}
    found: dict[int, str] = {}
    deadline = time.monotonic() + wait_seconds
    while True:
        for rank, log in logs.items():
            if rank not in found and (call := innermost_call(_since_run_start(log))):
                found[rank] = call
        if len(found) == world_size or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
