"""What a run prints: known harmless warnings silenced, and everything else kept in the run directory.

`silence_known_noise` filters warnings that libraries print on every run and that a user cannot act
on; each filter says why it is harmless. A test (tests/test_quiet_runs.py) fails on any other
warning, so a new one is either fixed at its source or argued for here. `silence_import_noise` does the same for
what libraries log as they are imported, also in a process of the user's own that imports transformers (which
imports torchao wherever it is installed). The project's own warnings print as one `warning: ...` line each,
above a progress bar (`show_own_warnings_as_lines`).

`keep_console` copies what rank 0 prints (stdout and stderr, progress bars reduced to their last
state) into `train.log`, and what every other rank writes to stderr (its warnings and errors) into
`train.rank<N>.log`, beside it.
"""

from __future__ import annotations

import atexit
import datetime
import io
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Callable, TextIO

from project.runtime.secrets import redact_text

# (message pattern, why it can be ignored)
KNOWN_WARNINGS = [
    # Lightning 2.6 calls a torch pytree API that torch 2.13 deprecated; nothing of ours is involved.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", "Lightning's own use of a deprecated torch API"),
    # Lightning says this on any machine where SLURM is installed, even of a run meant for that machine
    # alone; a run on the cluster goes through srun (experiments/slurm/train.sbatch).
    (r"The `srun` command is available on your system but is not used", "a local run where SLURM is installed"),
]

# torch.distributed.tensor logs this when a gradient norm sharded over both mesh dimensions (FSDP2 x
# tensor parallel) is reduced: one all-reduce per dimension. Every rank receives the same all-reduced
# value, so the norms and losses agree across ranks (tests/test_sharded_parity.py compares them).
_DTENSOR_TWO_STEP_REDUCE = "While redistributing from (_NormPartial"
# Lightning's lines about our own choices rather than the run: its advertisement for a cloud logger,
# and its note that our model summary (project.training.callbacks.summary) replaces its own.
_LIGHTNING_CHATTER = ("💡", "Trainer already configured with model summary callbacks")


# What libraries log while they are imported, by logger: (a pattern the message starts with, why it can be ignored).
IMPORT_NOISE = {
    "torchao": (
        r"Failed to load \S*_C_(mxfp8|cutlass)\w*\.",
        "torchao's optional CUDA kernels (_C_mxfp8.so, _C_cutlass_90a.so), which a machine without CUDA's libraries, "
        "or with another CUDA, cannot load; float8 training does not use them",
    ),
    "torch.utils._pytree": (
        r"<enum ",
        "torchao registers its enums with register_constant, which torch deprecated for Enum subclasses",
    ),
}
PROJECT_PACKAGE = Path(__file__).resolve().parents[1]


def silence_known_noise() -> None:
    """Filters for warnings and log lines that every run would print and no user can act on; the project's own
    warnings shown as one line each."""
    show_own_warnings_as_lines()
    silence_import_noise()
    for pattern, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
        lambda record: not record.getMessage().startswith(_DTENSOR_TWO_STEP_REDUCE)
    )
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not record.getMessage().startswith(_LIGHTNING_CHATTER)
    )
    logging.getLogger("litdata").setLevel(logging.WARNING)  # per-chunk INFO lines drown the progress bar
    # Imported after Hydra set up logging, Lightning's loggers pass their messages on to the root logger
    # as well as printing them with their own handler: print them once, plainly, as Lightning does alone.
    lightning = logging.getLogger("lightning")
    lightning.propagate = False
    for handler in lightning.handlers:
        handler.setFormatter(logging.Formatter("%(message)s"))


def silence_import_noise() -> None:
    """Filters for what libraries log as they are imported (IMPORT_NOISE), set before they are: torchao logs its
    kernels at its import, which transformers makes wherever torchao is installed."""
    for name, (start, _why) in IMPORT_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _MessageStart) and f.start.pattern == start for f in logger.filters):
            logger.addFilter(_MessageStart(start))


class _MessageStart(logging.Filter):
    """Drops the log records whose message starts with a match of `start` (a regular expression)."""

    def __init__(self, start: str):
        super().__init__()
        self.start = re.compile(start)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.start.match(record.getMessage())


def show_own_warnings_as_lines() -> None:
    """From now on, a warning raised in the project's own code (rank_zero_warn, warnings.warn under project/) prints
    as `warning: <message>`, one line without Python's source path and code line, written as tqdm writes above its
    progress bars (a bar being drawn is taken down and drawn again under the line); every other warning as before."""
    if warnings.showwarning is not _show_warning:
        global _shown_before
        _shown_before = warnings.showwarning
        warnings.showwarning = _show_warning


_shown_before = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # warnings.showwarning's
    # Ours: a UserWarning (rank_zero_warn's) raised in the project; a library's deprecation attributed to a project
    # line by its stacklevel keeps Python's form, category and place.
    if not (_is_ours(filename) and issubclass(category, UserWarning)):
        _shown_before(message, category, filename, lineno, file, line)
        return
    from tqdm import tqdm

    stream = file if file is not None else sys.stderr
    if stream is None:  # pythonw: no console to write to
        return
    try:
        tqdm.write(f"warning: {message}", file=stream)
    except OSError:  # as Python's own: a warning about a closed console is lost
        pass


def _is_ours(filename: str) -> bool:
    try:
        return Path(filename).resolve().is_relative_to(PROJECT_PACKAGE)
    except (OSError, ValueError):
        return False


_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_BAR = re.compile(r"\|\s*(\d+)/(\d+|\?) \[")  # tqdm's "| 10/12 [" counter


def _worth_keeping(line: str) -> bool:
    """Progress bars are kept in the log only when full: their intermediate drawings say nothing
    that metrics.csv does not."""
    bar = _BAR.search(line)
    return bool(line.strip()) and (bar is None or bar.group(1) == bar.group(2))


class _Tee(io.TextIOBase):
    """Writes through to the console stream and appends finished lines to a log file. A progress bar
    redraws its line with carriage returns; the log keeps only the last drawing, without escapes."""

    def __init__(self, console: TextIO, log: TextIO):
        self.console, self.log, self._line = console, log, ""

    def write(self, text: str) -> int:
        self.console.write(text)
        *lines, self._line = (self._line + text).split("\n")
        for line in lines:
            line = _ESCAPE.sub("", line.rsplit("\r", 1)[-1])
            if _worth_keeping(line):
                self.log.write(line + "\n")
        self._line = self._line.rsplit("\r", 1)[-1]  # a bar that keeps redrawing must not grow the buffer
        return len(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()

    def isatty(self) -> bool:  # progress bars and rich ask this to decide how to draw
        return self.console.isatty()

    def fileno(self) -> int:
        return self.console.fileno()

    @property
    def encoding(self) -> str:
        return self.console.encoding


def launch_rank(num_nodes: int = 1) -> int:
    """This process's global rank as its launcher set it, before any process group exists: horovodrun's
    HOROVOD_RANK (Open MPI's under mpirun), torchrun's RANK, SLURM's SLURM_PROCID, or, from Lightning's own
    launcher, NODE_RANK and LOCAL_RANK. Horovod's first: its processes inherit a batch job's SLURM_PROCID."""
    for variable in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "RANK", "SLURM_PROCID"):
        if variable in os.environ:
            return int(os.environ[variable])
    local, node = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("NODE_RANK", 0))
    per_node = int(os.environ.get("WORLD_SIZE", num_nodes)) // max(1, num_nodes)
    return node * per_node + local


_current_log: TextIO | None = None  # the console log keep_console writes, while it does


def current_log() -> TextIO | None:
    """The file this process's console is copied into (project.runtime.stacks writes stacks there), or None."""
    return _current_log


def keep_console(run_dir: Path, rank: int, secrets: set[str] = frozenset()) -> Callable[[], None]:
    """From now on, copy this process's console into the run directory (appending: a resumed run
    continues the same log). Rank 0: stdout and stderr in train.log; other ranks: stderr in
    train.rank<N>.log. Logging handlers that already hold the console streams are pointed at the copies.
    Returns what puts the console back as it was (a run that ended; the process may train again)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    name = "train.log" if rank == 0 else f"train.rank{rank}.log"
    global _current_log
    log = _current_log = open(run_dir / name, "a", encoding="utf-8", buffering=1)
    command = redact_text(" ".join(sys.argv[1:]), secrets)
    log.write(f"== {datetime.datetime.now().isoformat(timespec='seconds')} python -m project.train {command}\n")
    streams = ("stdout", "stderr") if rank == 0 else ("stderr",)
    replaced = {}
    for stream in streams:
        console = getattr(sys, stream)
        replaced[id(console)] = tee = _Tee(console, log)
        setattr(sys, stream, tee)
    loggers = [
        logging.getLogger(),
        *(logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)),
    ]
    handlers = [
        (handler, handler.stream)
        for logger in loggers
        for handler in logger.handlers
        if type(handler) is logging.StreamHandler and id(handler.stream) in replaced
    ]
    for handler, stream in handlers:
        handler.setStream(replaced[id(stream)])
    atexit.register(log.flush)

    def restore() -> None:
        global _current_log
        _current_log = None
        for stream, tee in zip(streams, replaced.values()):
            if getattr(sys, stream) is tee:
                setattr(sys, stream, tee.console)
        for handler, stream in handlers:
            handler.setStream(stream)
        atexit.unregister(log.flush)
        log.close()

    return restore
