"""What every benchmark shares: `main`, the main of each (its settings, a scratch folder, its rows as they come,
new dated result files, never an edit of one written before), a measurement in a fresh process, and the model
presets of conf/model.

A benchmark is a module with a `Benchmark` and `if __name__ == "__main__": main(BENCHMARK)`; the few whose results
are not one table of rows (the pipeline's bubble, the data path, the platform's step, the context-parallel plot)
write theirs with `write_report` themselves.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from project.runtime.errors import exit_on_config_error

ROOT = Path(__file__).resolve().parents[1]


def result_stem(out: Path, suffix: str = "") -> Path:
    """`out/<YYYY-MM-DD>-<short hostname><suffix>`: where a benchmark run on this machine today writes its files."""
    host = platform.node().split(".")[0] or "host"
    return out / f"{datetime.date.today().isoformat()}-{host}{suffix}"


def free_stem(stem: Path, extensions: list[str]) -> Path:
    """`stem`, else `stem-2`, `stem-3`, ...: the first for which no file with any of `extensions` exists."""
    candidate, n = stem, 1
    while any(candidate.with_name(candidate.name + ext).exists() for ext in extensions):
        n += 1
        candidate = stem.with_name(f"{stem.name}-{n}")
    return candidate


def write_report(stem: Path, report: dict, markdown: str) -> Path:
    """`<stem>.json` (the report) and `<stem>.md` (its table) at the first stem no file takes (free_stem), its
    folder made; returns that stem. Never overwrites a result, even one written since the stem was chosen."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem = free_stem(stem, [".json", ".md"])
    for ext, text in ((".json", json.dumps(report, indent=2) + "\n"), (".md", markdown)):
        with stem.with_name(stem.name + ext).open("x") as f:
            f.write(text)
    return stem


def new_report(module: str, argv: list[str], **fields: object) -> dict:
    """A benchmark's record: when, where, the command that wrote it, its settings, and its rows to come."""
    command = " ".join([f"python -m {module}", *argv])
    return {
        "date": datetime.date.today().isoformat(),
        "host": platform.node(),
        "command": command,
        **fields,
        "rows": [],
    }


def add_row(report: dict, row: dict) -> None:
    """A measurement into the report, and onto the console as it comes."""
    report["rows"].append(row)
    print(json.dumps(row), flush=True)


def fresh_process(script: str, argv: list[str], what: str) -> list[str]:
    """Run `script` (python -c) with `argv` in a process of its own, 2 threads, and return the words it printed.
    Large allocations are mapped apart (glibc's MALLOC_MMAP_THRESHOLD_), so that a freed tensor leaves the resident
    set and the process's peak resident memory follows what lived at once."""
    result = subprocess.run(
        [sys.executable, "-c", script, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "2", "MALLOC_MMAP_THRESHOLD_": "1048576"},
    )
    if result.returncode:
        raise RuntimeError(f"{what} failed:\n{result.stderr.strip()[-3000:]}")
    return result.stdout.split()


def free_port() -> int:
    """A TCP port on this host that nothing listens on now: the rendezvous of a benchmark's own process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# For the scripts fresh_process runs: the resident bytes now, and the peak so far.
RESIDENT = """
import resource
def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
def peak_resident_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""


def publish(out: Path, suffix: str, report: dict, markdown: str) -> None:
    """Write the report's new files (`<date>-<host><suffix>.{json,md}` in `out`) and show its table."""
    stem = write_report(result_stem(out, suffix), report, markdown)
    print(markdown)
    print(f"wrote {stem}.json and .md")


def preset_path(name: str) -> Path:
    return ROOT / "conf" / "model" / f"{name}.yaml"


def load_preset(name: str, vocab_size: int):
    from project.model.config import LlamaConfig

    fields = yaml.safe_load(preset_path(name).read_text())
    if not isinstance(fields["vocab_size"], int):  # the small presets follow data.vocab_size
        fields["vocab_size"] = vocab_size
    return LlamaConfig(**fields)


def out_folder(value: str) -> Path:
    """The folder `out=` names: relative to the repository, an absolute path as it is."""
    out = Path(value)
    return out if out.is_absolute() else ROOT / out


@dataclass(frozen=True)
class Benchmark:
    """One measurement of `make bench`, as `main` needs it."""

    module: str  # what `python -m` runs: its report's command
    suffix: str | Callable[[dict], str]  # of its files, <date>-<host><suffix>.{json,md}: fixed, or of the settings
    parse: Callable[[list[str]], dict]  # the settings from key=value words, `out` among them; ConfigError if bad
    rows: Callable[[dict, Path], Iterable[dict]]  # the measurements, given the settings and a scratch folder
    table: Callable[[dict], str]  # the report as Markdown
    header: Callable[[dict], dict] = field(default=lambda settings: {})  # what the report records of the settings


def main(benchmark: Benchmark, argv: list[str] | None = None) -> None:
    """A benchmark's main: a bad setting is one `error:` paragraph (exit 2) before anything runs; each row is shown
    as it is measured; the report is written to new files in `out` and its table shown."""
    argv = sys.argv[1:] if argv is None else argv
    with exit_on_config_error():
        settings = benchmark.parse(argv)
        report = new_report(benchmark.module, argv, **benchmark.header(settings))
        with tempfile.TemporaryDirectory(prefix=f"bench-{benchmark.module.rpartition('.')[2]}-") as scratch:
            for row in benchmark.rows(settings, Path(scratch)):
                add_row(report, row)
        suffix = benchmark.suffix if isinstance(benchmark.suffix, str) else benchmark.suffix(settings)
        publish(settings["out"], suffix, report, benchmark.table(report))
