"""Run the points of a wandb sweep spec on this machine, one after another, with no wandb server:

    python -m project.sweep spec=experiments/sweeps/NAME.yaml [count=N] [sweep_seed=S] [dry_run=true]
                            [sweep_dir=DIR] [key=value ...]

A spec is wandb sweep YAML: `wandb sweep SPEC` then `wandb agent ID` runs the same points through wandb's
server. Each point's command is the spec's `command` with wandb's macros expanded as its agent expands
them (`agent_command`; tests/test_sweep.py holds it to wandb's own code), so a point runs here as it
would under an agent, but for two things: `${interpreter}` is this Python (an agent runs `python` from
PATH), and `hydra.run.dir` is the point's own folder, `<sweep_dir>/<point>/`. The sweep folder (default
`outputs/sweeps/<spec name>-<date>_<time>/`; a folder holding a sweep already is refused) also gets
`spec.yaml` and `points.jsonl`, one line per finished point (parameters as it ran them, command, exit
status, seconds, final metrics, error), for a report to read. `dry_run=true` prints the command lines an agent would run
and runs nothing.

The sweep's console gets a line as each point starts and one as it ends (status, seconds, final metrics or
error): a point's own console, progress bars and all, is in its run folder's train.log, where project.train
keeps it, so six points' bars would only bury which point is where. A point refused before it trained leaves no
train.log; the error it printed is its end line, and is recorded.

Extra `key=value` arguments are training overrides for every point: one whose key the command or a
constant parameter sets already replaces it (`experiment=debug`, `logger=csv`, `trainer.devices=2`), the
others are appended; a point's recorded parameters are the values it ran with, overrides included. A
key the spec varies is refused, and so is `hydra.run.dir` (use `sweep_dir=`), an override Hydra's
grammar refuses, and one listing several values (`a=1,2`: make it a parameter). The draw's seed is
`sweep_seed=`, since `seed=` is project.train's own setting, passed on like any override. (Not a Hydra
main, like benchmarks.model_step: the runner's options and the overrides share one command line; the overrides
are parsed here with Hydra's own parser, and what they set is checked by each point's own Hydra.)

Methods. `grid`: every combination, in the order of wandb's sweep engine (parameters sorted by name, the
last varying fastest); `count=N` runs the first N, as `wandb agent --count N` would. `random`: `count`
points (default: the spec's `run_cap`), drawn from the parameters' distributions with a seeded generator.
`bayes`: `count` points (default: `run_cap`) from Optuna's TPE sampler, seeded by `sweep_seed`: a third of
them (3 to 10) drawn at random, each later one chosen from the metrics of the points before it
(tools.sweep_search). wandb's controller fits a Gaussian process instead (its `sweeps` package,
which pins numpy<2 and pulls in scipy and scikit-learn, none of which may enter the training environment): the
same spec, another model of the results, so other points. What this runner does that `wandb agent` does not:
it needs no wandb server or account, and the same seed gives the same start-up points (and the same later
points for the same results).

A point that fails (exit status != 0) is reported and the next one runs: an invalid layout is refused by
project.train's settings check within a second, so a grid may map where layouts fail. At the end a table
lists every point. The exit status is 1 only when every point failed (nothing ran: most likely the spec
or the overrides, not the layouts), 2 for a bad spec or argument, 130 when interrupted.
"""

from __future__ import annotations

import csv
import datetime
import itertools
import json
import math
import os
import platform
import random
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from project.runtime.arguments import parse_options
from project.runtime.errors import ConfigError, exit_on_config_error
from tools.sweep_search import FixedPoints, Search, TreeParzenSearch, asked, startup_points

ARGS_MACRO = "${args_no_hyphens}"
METHODS = ("grid", "random", "bayes")


def bayes_note(count: int) -> str:
    return (
        f"note: method bayes runs here as Optuna's TPE search: the first {startup_points(count)} of {count} points "
        "are random draws, each later one is chosen from the results of the points before it (`wandb sweep` + "
        "`wandb agent` run wandb's own Bayesian search, a Gaussian process)."
    )


# wandb's create_sweep_command: `${envvar:NAME}` anywhere in an element, replaced by the variable's value.
ENVVAR = re.compile(r"\$\{envvar\:([A-Z0-9_]*)\}")
TAIL_BYTES = 20_000  # of each point's stderr, kept for the error it ends with


@dataclass(frozen=True)
class Spec:
    path: Path
    method: str
    command: list[str]
    program: str
    parameters: dict[str, dict]  # sorted by name, as wandb's sweep engine orders them
    run_cap: int | None = None
    metric: str | None = None  # the spec's metric name: what wandb ranks runs by
    goal: str = "minimize"  # the metric's goal: minimize or maximize

    @property
    def reported(self) -> list[str]:
        """The metrics the summary gives of each point: the final val/loss, and the spec's own."""
        return list(dict.fromkeys(["val/loss", *([self.metric] if self.metric else [])]))

    @property
    def varied(self) -> list[str]:
        """The parameters that can take more than one value; the others are constants."""
        return [
            name
            for name, config in self.parameters.items()
            if distribution(name, config) != "constant" and len(config.get("values", ())) != 1
        ]


@dataclass
class PointResult:
    index: int
    parameters: dict[str, Any]
    command: list[str]
    run_dir: Path
    status: int = -1
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""


# ---------------------------------------------------------------- the spec and its points


def distribution(name: str, config: dict) -> str:
    """The distribution a parameter config names, or the one wandb infers from its keys."""
    if not isinstance(config, dict):
        raise ConfigError(
            f"parameter {name}: expected a mapping such as {{values: [...]}} or {{value: ...}}, got {config!r}."
        )
    if "parameters" in config:
        raise ConfigError(
            f"parameter {name} nests parameters: wandb would pass them as one dict ({name}={{...}}), which Hydra "
            f"cannot take as an override. Name each setting with dots instead, e.g. {name}.KEY: {{values: [...]}}."
        )
    if "distribution" in config:
        return config["distribution"]
    if "value" in config:
        return "constant"
    if "values" in config:
        return "categorical_w_probabilities" if "probabilities" in config else "categorical"
    if "min" in config and "max" in config:
        return "int_uniform" if all(isinstance(config[k], int) for k in ("min", "max")) else "uniform"
    raise ConfigError(
        f"parameter {name}: give value, values, or min and max (with a distribution), not {sorted(config)}."
    )


def _quantized(q: float | int) -> Callable[[float], float | int]:
    return lambda x: (int if isinstance(q, int) else float)(round(x / q) * q)


def sampler(name: str, config: dict) -> Callable[[random.Random], Any]:
    """A function drawing one value of the parameter, with the distributions of wandb's sweep engine."""
    kind = distribution(name, config)
    lo, hi = config.get("min"), config.get("max")
    mu, sigma = config.get("mu", 0.0), config.get("sigma", 1.0)
    quantize = _quantized(config.get("q", 1.0))
    samplers: dict[str, Callable[[random.Random], Any]] = {
        "constant": lambda rng: config["value"],
        "categorical": lambda rng: rng.choice(config["values"]),
        "categorical_w_probabilities": lambda rng: rng.choices(config["values"], weights=config["probabilities"])[0],
        "int_uniform": lambda rng: rng.randint(lo, hi),
        "uniform": lambda rng: rng.uniform(lo, hi),
        "q_uniform": lambda rng: quantize(rng.uniform(lo, hi)),
        "log_uniform": lambda rng: math.exp(rng.uniform(lo, hi)),  # min and max are exponents (wandb's v1)
        "log_uniform_values": lambda rng: math.exp(rng.uniform(math.log(lo), math.log(hi))),
        "q_log_uniform": lambda rng: quantize(math.exp(rng.uniform(lo, hi))),
        "q_log_uniform_values": lambda rng: quantize(math.exp(rng.uniform(math.log(lo), math.log(hi)))),
        "inv_log_uniform": lambda rng: math.exp(-rng.uniform(lo, hi)),
        # The engine draws 1/x of a log-uniform value on [1/max, 1/min]: log-uniform on [min, max] again.
        "inv_log_uniform_values": lambda rng: math.exp(rng.uniform(math.log(lo), math.log(hi))),
        "normal": lambda rng: rng.gauss(mu, sigma),
        "q_normal": lambda rng: quantize(rng.gauss(mu, sigma)),
        "log_normal": lambda rng: rng.lognormvariate(mu, sigma),
        "q_log_normal": lambda rng: quantize(rng.lognormvariate(mu, sigma)),
        "beta": lambda rng: rng.betavariate(config.get("a", 1.0), config.get("b", 1.0)),
        "q_beta": lambda rng: quantize(rng.betavariate(config.get("a", 1.0), config.get("b", 1.0))),
    }
    if kind not in samplers:
        raise ConfigError(f"parameter {name}: unknown distribution {kind!r}; choose one of {sorted(samplers)}.")
    needs = {"min", "max"} if "uniform" in kind else set()
    if needs - set(config):
        raise ConfigError(f"parameter {name}: distribution {kind} needs min and max.")
    return samplers[kind]


def grid_values(name: str, config: dict) -> list:
    """The values a grid takes for one parameter (wandb's grid: categorical, constant, int_uniform, q_uniform)."""
    kind = distribution(name, config)
    if kind == "constant":
        return [config["value"]]
    if kind == "categorical":
        return list(config["values"])
    if kind == "int_uniform":
        return list(range(config["min"], config["max"] + 1))
    if kind == "q_uniform":  # numpy.arange(min, max, q), as wandb's engine: max itself excluded
        q, steps = config.get("q", 1.0), math.ceil((config["max"] - config["min"]) / config.get("q", 1.0))
        return [config["min"] + i * q for i in range(steps)]
    raise ConfigError(
        f"parameter {name}: a grid needs values, a constant, int_uniform or q_uniform, not {kind}; "
        "list the values, or use method: random."
    )


def check_value(name: str, value: Any) -> None:
    """wandb formats parameters with Python's str(): null would reach Hydra as the string "None"."""
    if value is None:
        raise ConfigError(
            f'parameter {name}: null would reach Hydra as the string "None"; write "null" (quoted) for null.'
        )


def load_spec(path: str | Path) -> Spec:
    """Read and check a sweep spec: what wandb needs to run it, and what Hydra needs to read its points."""
    path = Path(path)
    if not path.is_file():
        specs = sorted(str(p) for p in Path("experiments/sweeps").glob("*.yaml"))
        raise ConfigError(f"spec={path}: no such file. Specs: {specs or 'none found in experiments/sweeps/'}.")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"spec={path} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"spec={path}: expected a wandb sweep mapping (method, program, command, parameters).")
    method = raw.get("method")
    if method not in METHODS:
        raise ConfigError(f"spec={path}: method={method!r}; choose one of {list(METHODS)}.")
    command = raw.get("command")
    if not isinstance(command, list) or ARGS_MACRO not in command:
        raise ConfigError(
            f"spec={path}: its command must hand the parameters to Hydra as key=value with the element {ARGS_MACRO} "
            "(wandb's default, ${args}, passes --key=value, which Hydra refuses), e.g. "
            "[${env}, ${interpreter}, -m, project.train, experiment=NAME, " + ARGS_MACRO + "]."
        )
    if "${args_json_file}" in command:
        raise ConfigError(f"spec={path}: ${{args_json_file}} is not supported: project.train reads {ARGS_MACRO}.")
    if not raw.get("program"):
        raise ConfigError(
            f"spec={path}: set program (e.g. project/train.py): wandb's command-line agent fails without it, "
            "even where the command runs a module (-m)."
        )
    parameters = raw.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise ConfigError(f"spec={path}: parameters must map each override key to its values.")
    parameters = {str(name): parameters[name] for name in sorted(parameters, key=str)}
    for name, config in parameters.items():
        sampler(name, config)  # refuses unknown distributions and missing bounds
        for value in config.get("values", [config["value"]] if "value" in config else []):
            check_value(name, value)
        if method == "grid":
            grid_values(name, config)
    metric = raw.get("metric") or {}
    if method == "bayes" and not metric.get("name"):
        raise ConfigError(f"spec={path}: method bayes needs metric: {{name: val/loss, goal: minimize}}.")
    goal = metric.get("goal", "minimize")
    if goal not in ("minimize", "maximize"):
        raise ConfigError(f"spec={path}: metric goal={goal!r}; choose minimize or maximize.")
    if method == "bayes":
        for name, config in parameters.items():
            if distribution(name, config) != "constant" and len(config.get("values", ())) != 1:
                asked(name, config, distribution(name, config))  # refuses what TPE cannot search
    return Spec(
        path,
        method,
        [str(c) for c in command],
        str(raw["program"]),
        parameters,
        raw.get("run_cap"),
        metric.get("name"),
        goal,
    )


def point_count(spec: Spec, count: int | None) -> int:
    """How many points a random or bayes spec runs: `count`, else its run_cap."""
    count = count if count is not None else spec.run_cap
    if count is None:
        raise ConfigError(
            f"spec={spec.path}: method {spec.method} draws points until it is stopped; give count=N (or run_cap in the "
            "spec)."
        )
    return count


def sweep_search(spec: Spec, count: int | None = None, seed: int = 0) -> Search:
    """The points to run, one at a time: a grid's combinations (the first `count`), `count` seeded random draws, or
    `count` points of Optuna's TPE, each chosen as the one before it ends (tools.sweep_search)."""
    if spec.method == "grid":
        names = list(spec.parameters)
        grid = [
            dict(zip(names, values))
            for values in itertools.product(*(grid_values(n, c) for n, c in spec.parameters.items()))
        ]
        return FixedPoints(grid[:count] if count is not None else grid)
    count = point_count(spec, count)
    if spec.method == "bayes":
        kinds = {name: (config, distribution(name, config)) for name, config in spec.parameters.items()}
        return TreeParzenSearch(kinds, spec.goal == "maximize", count, seed)
    rng = random.Random(seed)
    draws = {name: sampler(name, config) for name, config in spec.parameters.items()}
    return FixedPoints([{name: draw(rng) for name, draw in draws.items()} for _ in range(count)])


def sweep_points(spec: Spec, count: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The points known before any runs: a grid's or random draws' every point; of a bayes spec, its random
    start-up points (the later ones depend on their results)."""
    search = sweep_search(spec, count, seed)
    if isinstance(search, FixedPoints):
        return search.chosen
    return list(itertools.islice(search.points(), startup_points(search.count)))


# ---------------------------------------------------------------- command lines, as wandb's agent writes them


def agent_command(
    command: list[str], args: dict[str, Any], program: str, interpreter: str = "python", environ: dict | None = None
) -> list[str]:
    """The argv wandb's agent (wandb_agent.Agent._command_run, wandb 0.31) runs for one point with `args`.

    Elements that are exactly a macro expand to a list (an unknown macro to nothing); `${envvar:NAME}`
    inside any element becomes that variable's value, or NAME where it is unset. Values are formatted with
    Python's str(), so True reaches Hydra as `True` (a bool to Hydra too) and floats in Python's notation."""
    environ = os.environ if environ is None else environ
    flags = [f"{name}={value}" for name, value in args.items()]
    macros: dict[str, Any] = {
        "args": ["--" + flag for flag in flags],
        "args_no_equals": [part for name, value in args.items() for part in (f"--{name}", str(value))],
        "args_no_hyphens": flags,
        "args_no_boolean_flags": [
            f"--{name}" if isinstance(value, bool) else f"--{name}={value}"
            for name, value in args.items()
            if not isinstance(value, bool) or value
        ],
        "args_json": [json.dumps(dict(args))],
        "args_dict": dict(args),  # wandb adds a dict to the list, that is, its keys
        "args_append_hydra": ["+" + flag for flag in flags],
        "args_override_hydra": ["++" + flag for flag in flags],
        "interpreter": [interpreter],
        "program": [program],
    }
    if platform.system() != "Windows":
        macros["env"] = ["/usr/bin/env"]
    argv: list[str] = []
    for element in command:
        element = ENVVAR.sub(lambda m: environ.get(m.group(1), m.group(1)), str(element))
        if element.startswith("${") and element.endswith("}"):
            argv += macros.get(element[2:-1]) or []
        else:
            argv.append(element)
    return argv


def override_key(arg: str) -> str | None:
    """`a.b` for `a.b=1`, `+a.b=1` or `++a.b=1`; None for what is not a Hydra override (`-m`, a path)."""
    if arg.startswith("-") or "=" not in arg:
        return None
    return arg.split("=", 1)[0].lstrip("+~")


def with_overrides(argv: list[str], overrides: list[str]) -> list[str]:
    """`argv` with each override in place of the argument that sets the same key, or appended."""
    argv = list(argv)
    for override in overrides:
        key = override_key(override)
        same = [i for i, arg in enumerate(argv) if key is not None and override_key(arg) == key]
        if same:
            argv[same[0]] = override
            argv = [arg for i, arg in enumerate(argv) if i not in same[1:]]
        else:
            argv.append(override)
    return argv


DELETED = object()  # the value of a `~key=value` override: the key is gone


def override_values(overrides: list[str]) -> dict[str, Any]:
    """{key: value} of the overrides, each value as the points' Hydra reads it (`trainer.devices=2`: 2,
    `optim.lr=1e-3`: 0.001), DELETED for `~key=...`; one Hydra cannot read is refused before any point runs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # here: a spec error needs no Hydra
    from hydra.errors import OverrideParseException

    parser, values = OverridesParser.create(), {}
    for arg in overrides:
        try:
            (override,) = parser.parse_overrides([arg])
        except OverrideParseException as error:
            raise ConfigError(f"{arg}: Hydra cannot read this override: {str(error).splitlines()[0]}.") from None
        if override.is_sweep_override():  # each point's Hydra would refuse it without --multirun
            raise ConfigError(
                f"{arg}: one value per override; to run several, make {override_key(arg)} a parameter of the spec."
            )
        values[override_key(arg)] = DELETED if override.is_delete() else override.value()
    return values


def ran_with(point: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A point's parameters as it ran: an override of one (a constant, trainer.devices=2 for the spec's 4)
    replaced it in the command, so it replaces it in the record too."""
    ran = {key: values.get(key, value) for key, value in point.items()}
    return {key: value for key, value in ran.items() if value is not DELETED}


def check_overrides(spec: Spec, overrides: list[str]) -> None:
    for override in overrides:
        key = override_key(override)
        if key is None:
            raise ConfigError(
                f"argument {override!r}: expected a training override key=value (Hydra's syntax, no leading -)."
            )
        if key in spec.varied:
            raise ConfigError(f"{override}: {key} is what {spec.path} varies; drop it, or sweep with another spec.")
        if key == "hydra.run.dir":
            raise ConfigError(
                f"{override}: each point runs in <sweep_dir>/<point>/; choose the sweep folder with sweep_dir=DIR."
            )
    override_values(overrides)


# ---------------------------------------------------------------- running points


def final_metrics(run_dir: Path, names: list[str]) -> dict[str, float]:
    """The last value of each metric in the run's metrics.csv (those it logged at all)."""
    found: dict[str, float] = {}
    try:
        with open(run_dir / "metrics.csv", newline="") as file:
            for row in csv.DictReader(file):
                found.update({name: float(row[name]) for name in names if row.get(name)})
    except (OSError, ValueError):
        pass
    return found


def logged_metrics(run_dir: Path) -> list[str]:
    """The metrics a run's metrics.csv has a column for (none where it wrote none)."""
    try:
        with open(run_dir / "metrics.csv", newline="") as file:
            return [name for name in next(csv.reader(file), []) if name not in ("step", "epoch")]
    except OSError:
        return []


def refuse_a_search_without_results(spec: Spec, results: list[PointResult], record: Path) -> None:
    """The last of `results` ran to its end without its bayes spec's metric, and no point before it had it: a
    misspelled name, or a metric the runs never log, and TPE, which draws at random until it has results, would
    search at random to the end. (Once a point had it, one without it, a run that ended before its first validation,
    counts as failed, as a failed point does.)"""
    result = results[-1]
    if spec.method != "bayes" or result.status != 0 or any(spec.metric in r.metrics for r in results):
        return
    logged = logged_metrics(result.run_dir)
    raise ConfigError(
        f"metric: {{name: {spec.metric}}}: point {result.index} ran to its end and logged no {spec.metric} (its "
        f"metrics.csv has {', '.join(logged) if logged else 'no metric'}), so method bayes would have no result to "
        "choose its next points from, and the sweep stops here. Name a metric the points log in the spec, or have "
        "them log it (a val/ metric needs a validation within the run: val_every_n_steps at most "
        f"trainer.max_steps). The point is recorded in {record}."
    )


def error_of(stderr_tail: str) -> str:
    """What a failed point said last: its `error: ...` paragraph where it printed one (a refused setting),
    else its last lines (a traceback's exception, Hydra's complaint)."""
    lines = [line for line in stderr_tail.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    chosen = lines[starts[-1] :] if starts else lines[-3:]
    return " ".join(line.strip() for line in chosen)[:600]


def run_point(argv: list[str]) -> tuple[int, str]:
    """Run one point, its console kept by the point itself (train.log), not shown here; its exit status and
    the tail of its stderr."""
    # No stdin: a point that asked for input (a login prompt) would wait on a question no one sees.
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tail = b""
    try:
        for chunk in iter(lambda: process.stderr.read1(1 << 16), b""):  # until every rank it started has closed it
            tail = (tail + chunk)[-TAIL_BYTES:]
    finally:
        status = process.wait()
    return status, tail.decode(errors="replace")


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def metric_format(values: list[float]) -> Callable[[float], str]:
    """One format for a column of a metric: whole numbers with thousands separators from 1,000 up
    (tokens/s), else the decimals that give its largest value 4 significant digits (losses, MFU), never
    an exponent beside plain numbers."""
    largest = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
    if largest >= 1000:
        return lambda v: f"{v:,.0f}"
    decimals = min(6, max(0, 3 - math.floor(math.log10(largest)))) if largest > 0 else 0
    return lambda v: f"{v:.{decimals}f}"


def summary_table(results: list[PointResult], varied: list[str], metrics: list[str]) -> str:
    header = ["point", "status", "seconds", *metrics, *varied]
    formats = {m: metric_format([r.metrics[m] for r in results if m in r.metrics]) for m in metrics}
    rows = [
        [
            str(r.index),
            "ok" if r.status == 0 else f"failed ({r.status})",
            f"{r.seconds:.1f}",
            *(formats[m](r.metrics[m]) if m in r.metrics else "-" for m in metrics),
            *(fmt(r.parameters[name]) for name in varied),
        ]
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def default_sweep_dir(spec: Spec) -> Path:
    """`outputs/sweeps/<spec name>-<date>_<time>` under $PROJECT_ROOT (as conf/paths), -2, -3 ... when taken."""
    base = Path(os.environ.get("PROJECT_ROOT", ".")) / "outputs" / "sweeps"
    stem = f"{spec.path.stem}-{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"
    candidate, n = base / stem, 1
    while candidate.exists():
        n += 1
        candidate = base / f"{stem}-{n}"
    return candidate


def start_line(result: PointResult, count: int, varied: list[str]) -> str:
    """What sets the point apart (all its parameters where none varies), and where its console goes."""
    names = [name for name in varied if name in result.parameters] or list(result.parameters)
    settings = " ".join(f"{name}={fmt(result.parameters[name])}" for name in names)
    console = result.run_dir / "train.log"
    return f"point {result.index} ({result.index + 1}/{count}) started: {settings}; console: {console}"


def end_line(result: PointResult) -> str:
    if result.status == 0:
        metrics = ", ".join(f"{name} {metric_format([value])(value)}" for name, value in result.metrics.items())
        return f"point {result.index} ok after {result.seconds:.1f} s" + (f": {metrics}" if metrics else "")
    log = result.run_dir / "train.log"
    where = f" (console: {log})" if log.is_file() else ""
    return f"point {result.index} failed ({result.status}) after {result.seconds:.1f} s: {result.error}{where}"


def run_sweep(spec: Spec, search: Search, overrides: list[str], sweep_dir: Path) -> list[PointResult]:
    """Run every point in turn, each in `sweep_dir/<index>/`, and tell the search its metric; a failure is recorded
    and the sweep goes on; bayes points that end without their metric, before any has had it, stop it
    (refuse_a_search_without_results)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "spec.yaml").write_text(spec.path.read_text())
    values = override_values(overrides)
    results: list[PointResult] = []
    for index, point in enumerate(search.points()):
        run_dir = (sweep_dir / str(index)).absolute()
        argv = agent_command(spec.command, point, spec.program, interpreter=sys.executable)
        argv = with_overrides(argv, [*overrides, f"hydra.run.dir={run_dir}"])
        result = PointResult(index, ran_with(point, values), argv, run_dir)
        print(start_line(result, search.count, spec.varied), flush=True)
        start = time.monotonic()
        result.status, tail = run_point(argv)
        result.seconds = time.monotonic() - start
        result.metrics = final_metrics(run_dir, spec.reported)
        if result.status != 0:
            result.error = error_of(tail)
        print(end_line(result), flush=True)
        search.tell(result.metrics.get(spec.metric) if result.status == 0 and spec.metric else None)
        results.append(result)
        record = {
            "point": index,
            "parameters": result.parameters,
            "command": argv,
            "run_dir": str(run_dir),
            "status": result.status,
            "seconds": round(result.seconds, 3),
            "metrics": result.metrics,
            "error": result.error,
        }
        with open(
            sweep_dir / "points.jsonl", "a"
        ) as file:  # written as each point ends: a stopped sweep keeps its record
            file.write(json.dumps(record) + "\n")
        refuse_a_search_without_results(spec, results, sweep_dir / "points.jsonl")
    return results


# ---------------------------------------------------------------- command line

OPTIONS = {"spec": None, "count": None, "sweep_seed": "0", "dry_run": "false", "sweep_dir": None}


def parse(argv: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """This command's own key=value options, and the training overrides (everything else)."""
    options, overrides = parse_options(argv, OPTIONS, rest=lambda arg: True)
    if not options["spec"]:
        raise ConfigError("give spec=experiments/sweeps/NAME.yaml: the wandb sweep spec whose points to run.")
    if options["count"] is not None and not (options["count"].isdigit() and int(options["count"]) > 0):
        raise ConfigError(f"count={options['count']}: expected a positive integer.")
    if not re.fullmatch(r"-?\d+", options["sweep_seed"]):
        raise ConfigError(f"sweep_seed={options['sweep_seed']}: expected an integer.")
    if options["dry_run"] not in ("true", "false"):
        raise ConfigError(f"dry_run={options['dry_run']}: choose true or false.")
    return options, overrides


@exit_on_config_error()
def main(argv: list[str] | None = None) -> int:
    options, overrides = parse(sys.argv[1:] if argv is None else argv)
    spec = load_spec(options["spec"])
    check_overrides(spec, overrides)
    count = int(options["count"]) if options["count"] else None
    search = sweep_search(spec, count, int(options["sweep_seed"]))
    if spec.method == "bayes":
        print(bayes_note(search.count), flush=True)
    if options["dry_run"] == "true":
        extra = f", with {' '.join(overrides)}" if overrides else ""
        points = sweep_points(spec, count, int(options["sweep_seed"]))
        later = f" (the first {len(points)} of {search.count}: the others follow from their results)"
        try:
            print(
                f"# {spec.path}: {len(points)} {spec.method} point(s){later if spec.method == 'bayes' else ''}, as "
                f"wandb's agent runs them{extra}"
            )
            for point in points:
                print(
                    shlex.join(with_overrides(agent_command(spec.command, point, spec.program), overrides)), flush=True
                )
        except BrokenPipeError:  # the reader stopped early (`| head`): not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    sweep_dir = Path(options["sweep_dir"]) if options["sweep_dir"] else default_sweep_dir(spec)
    if (sweep_dir / "points.jsonl").exists():  # its run directories would be continued, not replaced
        raise ConfigError(f"sweep_dir={sweep_dir} holds a sweep already (points.jsonl): choose a new folder.")
    try:
        results = run_sweep(spec, search, overrides, sweep_dir)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the finished points are in {sweep_dir / 'points.jsonl'}", file=sys.stderr)
        return 130
    print(f"\nsweep {spec.path} ({spec.method}, {len(results)} points) in {sweep_dir}:")
    print(summary_table(results, spec.varied, spec.reported))
    for result in results:
        if result.status != 0:
            log = result.run_dir / "train.log"
            where = f" (console: {log})" if log.is_file() else ""
            print(f"point {result.index} failed: {result.error}{where}")
    if spec.method == "bayes":
        print(bayes_note(search.count))
    return 1 if all(result.status != 0 for result in results) else 0
