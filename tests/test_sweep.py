"""Sweep specs and the offline sweep runner (tools.sweep); Hydra multirun with multi-process strategies."""

import json
import math
import re
import shlex
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, read_metrics, run_module, train_overrides
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_quiet_runs import unexpected_warnings

from project.config.checks import preflight
from project.runtime.errors import ConfigError
from tools import sweep, sweep_search

SPECS = sorted((ROOT / "experiments" / "sweeps").glob("*.yaml"))
SOURCES = "\n".join(p.read_text() for p in (ROOT / "project").rglob("*.py") if p.name != "sweep.py")


def data_overrides(shards: Path) -> list[str]:
    """The tiny shards and quiet output; the runner names each point's run directory itself."""
    return [arg for arg in train_overrides(shards, Path("unused")) if arg.startswith(("data.", "trainer."))]


def write_spec(directory: Path, parameters: dict, method: str = "grid", command: list | None = None, **extra) -> Path:
    spec = {
        "program": "project/train.py",
        "method": method,
        "parameters": parameters,
        "command": command
        or [
            "${env}",
            "${interpreter}",
            "-m",
            "project.train",
            "experiment=debug",
            "logger=wandb",
            "${args_no_hyphens}",
        ],
        **extra,
    }
    path = directory / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def points_of(spec: sweep.Spec) -> list[dict]:
    """A grid's every point; four draws of a random spec, a bayes spec's random start-up points of four."""
    return sweep.sweep_points(spec, count=None if spec.method == "grid" else 4)


def test_the_sweep_specs_cover_layouts_degrees_schedules_micro_batches_checkpointing_and_learning_rate():
    varied = {name for path in SPECS for name in sweep.load_spec(path).varied}
    assert {"strategy", "strategy.tensor_parallel_size", "strategy.data_parallel_size", "strategy.schedule"} <= varied
    assert {"micro_batch_size", "strategy.n_microbatches", "strategy.activation_checkpointing", "optim.lr"} <= varied
    strategies = {point.get("strategy") for path in SPECS for point in points_of(sweep.load_spec(path))}
    assert {"ddp", "fsdp", "fsdp2", "tp", "tp_fsdp", "pipeline"} <= strategies


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_spec_parses_and_hands_its_parameters_to_hydra_as_key_value(path):
    raw = yaml.safe_load(path.read_text())
    assert "${args_no_hyphens}" in raw["command"] and "${args}" not in raw["command"]
    assert (ROOT / raw["program"]).is_file()  # wandb's command-line agent needs it, even for `-m project.train`
    assert raw["project"] == yaml.safe_load((ROOT / "conf" / "logger" / "wandb.yaml").read_text())["wandb"]["project"]
    assert f'"{raw["metric"]["name"]}"' in SOURCES  # a metric the training logs, by that name
    spec = sweep.load_spec(path)  # the runner's own checks: no null values, no nested parameters, grid-able values
    assert spec.method in ("grid", "bayes") and spec.varied


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_point_of_every_spec_composes_and_passes_the_settings_check(path, monkeypatch):
    """Each point's overrides, exactly as the agent passes them, compose into the training config (so every
    parameter name is a key Hydra accepts), and name a layout the settings check accepts on its devices."""
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep0")
    monkeypatch.setenv("WANDB_RUN_ID", "run0")
    spec = sweep.load_spec(path)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for point in points_of(spec):
            argv = sweep.agent_command(spec.command, point, spec.program)
            overrides = argv[argv.index("project.train") + 1 :]
            cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
            for name, value in point.items():  # each value arrived as the type it has in the spec (True, not "True")
                assert (cfg.hydra.runtime.choices[name] if name == "strategy" else OmegaConf.select(cfg, name)) == value
            layout = preflight(cfg)
            assert layout is not None and layout.shape.world_size == cfg.trainer.devices, point
            assert cfg.hydra.run.dir.endswith("sweeps/sweep0/run0")  # one folder per agent run


def test_grid_points_come_in_wandbs_order_and_count_takes_the_first():
    spec = sweep.Spec(
        Path("x.yaml"), "grid", [], "p", {"a": {"values": ["x", "y"]}, "b": {"min": 1, "max": 2}, "c": {"value": 0}}
    )
    assert sweep.sweep_points(spec) == [
        {"a": "x", "b": 1, "c": 0}, {"a": "x", "b": 2, "c": 0}, {"a": "y", "b": 1, "c": 0}, {"a": "y", "b": 2, "c": 0},
    ]  # fmt: skip
    assert sweep.sweep_points(spec, count=3) == sweep.sweep_points(spec)[:3]


def test_random_draws_and_bayes_start_up_points_are_seeded_draws_within_the_distributions(tmp_path):
    parameters = {
        "optim.lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2},
        "micro_batch_size": {"min": 1, "max": 4},
        "strategy": {"values": ["ddp", "fsdp2"]},
    }
    for method, drawn in (("random", 50), ("bayes", 10)):  # bayes: its 10 random start-up points of 50
        spec = sweep.load_spec(
            write_spec(tmp_path, parameters, method=method, metric={"name": "val/loss", "goal": "minimize"})
        )
        points = sweep.sweep_points(spec, count=50, seed=1)
        assert len(points) == drawn
        assert points == sweep.sweep_points(spec, count=50, seed=1) != sweep.sweep_points(spec, count=50, seed=2)
        assert all(1e-4 <= p["optim.lr"] <= 1e-2 and p["micro_batch_size"] in (1, 2, 3, 4) for p in points)
        lrs = sorted(p["optim.lr"] for p in points)
        assert lrs[0] < 1e-3 < lrs[-1]  # spread over the decades, as a log-uniform draw is
        assert {p["strategy"] for p in points} == {"ddp", "fsdp2"}


# A point's program standing in for project.train: its val/loss is least at optim.lr=10**-2.5, and it fails (exit
# status 1, no metrics) above 0.05.
LOSS_OF_LR = """
import math, pathlib, sys
args = dict(arg.split("=", 1) for arg in sys.argv[1:])
lr, run = float(args["optim.lr"]), pathlib.Path(args["hydra.run.dir"])
run.mkdir(parents=True, exist_ok=True)
if lr > 0.05:
    sys.exit("error: optim.lr too high")
(run / "metrics.csv").write_text(f"step,val/loss\\n0,{(math.log10(lr) + 2.5) ** 2}\\n")
"""


POINTS = 30


def learning_rate_spec(directory: Path, source: str, method: str = "bayes", metric: str = "val/loss",
                       highest: float = 1e-2) -> Path:  # fmt: skip
    """A spec of `method` over optim.lr, its points run by the program `source` (LOSS_OF_LR or a variant)."""
    program = directory / "program.py"
    program.write_text(source)
    return write_spec(
        directory,
        {"optim.lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": highest}},
        method=method,
        command=["${interpreter}", "${program}", "${args_no_hyphens}"],
        program=str(program),
        metric={"name": metric, "goal": "minimize"},
    )


def learning_rate_sweep(tmp_path: Path, method: str, name: str, *options: str) -> list[dict]:
    (tmp_path / method).mkdir(exist_ok=True)
    spec = learning_rate_spec(tmp_path / method, LOSS_OF_LR, method, highest=1e-1)
    assert sweep.main([f"spec={spec}", f"count={POINTS}", f"sweep_dir={tmp_path / name}", *options]) == 0
    return [json.loads(line) for line in (tmp_path / name / "points.jsonl").read_text().splitlines()]


def test_bayes_chooses_its_later_points_from_the_results_before_them_with_optunas_tpe(tmp_path, capsys):
    """After its 10 random start-up points, more of TPE's points fall near the best learning rate than random draws
    of the same spec do; a failed point counts as the worst so far and the sweep goes on; the dry run prints the
    start-up points the sweep then runs first; the same seed gives the same points."""

    def near(points: list[dict]) -> float:  # the share within half a decade of the best learning rate
        return sum(abs(math.log10(p["parameters"]["optim.lr"]) + 2.5) < 0.5 for p in points) / len(points)

    bayes = learning_rate_sweep(tmp_path, "bayes", "bayes")
    drawn = learning_rate_sweep(tmp_path, "random", "random")
    startup = sweep_search.startup_points(POINTS)
    assert startup == 10 and len(bayes) == len(drawn) == POINTS
    assert near(bayes[startup:]) > 1.5 * near(drawn[startup:]), (near(bayes[startup:]), near(drawn[startup:]))
    failed = [p for p in bayes + drawn if p["status"] != 0]
    assert failed and all(p["parameters"]["optim.lr"] > 0.05 and not p["metrics"] for p in failed)
    assert "Optuna's TPE search: the first 10 of 30 points are random draws" in capsys.readouterr().out

    spec = tmp_path / "bayes" / "spec.yaml"
    assert sweep.main([f"spec={spec}", f"count={POINTS}", "dry_run=true"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if "optim.lr=" in line]
    assert [float(line.split("optim.lr=")[1].split()[0]) for line in printed] == [
        p["parameters"]["optim.lr"] for p in bayes[:startup]
    ]
    again = learning_rate_sweep(tmp_path, "bayes", "bayes-again")
    assert [p["parameters"] for p in again] == [p["parameters"] for p in bayes]


def test_a_bayes_point_that_ends_without_the_specs_metric_stops_the_sweep_in_one_paragraph(tmp_path, capsys):
    """A misspelled metric would leave TPE without results, drawing at random to the end: the first point that ends
    without it stops the sweep, naming the metrics it did log; its record is kept."""
    spec = learning_rate_spec(tmp_path, LOSS_OF_LR, metric="val/los")
    with pytest.raises(SystemExit) as exit_info:
        sweep.main([f"spec={spec}", "count=5", f"sweep_dir={tmp_path / 'sweep'}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert "point 0 ran to its end and logged no val/los (its metrics.csv has val/loss)" in err, err
    records = (tmp_path / "sweep" / "points.jsonl").read_text().splitlines()
    assert [list(json.loads(line)["metrics"]) for line in records] == [["val/loss"]]  # the summary's own column


def test_once_a_bayes_point_had_the_metric_a_later_one_without_it_counts_as_failed(tmp_path):
    """Points that end before their first validation, after one that logged its val/loss: the sweep goes on."""
    only_the_first = '(run / ("metrics.csv" if run.name == "0" else "other.csv"))'  # the others log elsewhere
    spec = learning_rate_spec(tmp_path, LOSS_OF_LR.replace('(run / "metrics.csv")', only_the_first))
    assert sweep.main([f"spec={spec}", "count=3", f"sweep_dir={tmp_path / 'sweep'}"]) == 0
    records = [json.loads(line) for line in (tmp_path / "sweep" / "points.jsonl").read_text().splitlines()]
    assert [list(r["metrics"]) for r in records] == [["val/loss"], [], []]


def test_bayes_refuses_a_distribution_or_bounds_tpe_cannot_search_in_one_paragraph(tmp_path):
    path = write_spec(tmp_path, {"optim.lr": {"distribution": "normal", "mu": 0.001, "sigma": 1e-4}}, method="bayes",
                      metric={"name": "val/loss", "goal": "minimize"}, run_cap=4)  # fmt: skip
    with pytest.raises(ConfigError, match=r"parameter optim.lr: method bayes .* not normal: .* or use method: random"):
        sweep.load_spec(path)
    path = write_spec(tmp_path, {"optim.lr": {"distribution": "log_uniform_values", "min": 0, "max": 1e-2}},
                      method="bayes", metric={"name": "val/loss", "goal": "minimize"}, run_cap=4)  # fmt: skip
    with pytest.raises(ConfigError, match=r"parameter optim.lr: method bayes cannot search .*'min': 0"):
        sweep.load_spec(path)


def wandb_agent_commands(raw: dict, points: list[dict], tmp_path: Path, monkeypatch) -> list[list[str]]:
    """What wandb's own agent code (Agent._command_run) would run for each point, its process start captured."""
    from wandb import wandb_agent

    started = []

    class Started:
        def __init__(self, command=None, **kwargs):
            started.append(command)

    monkeypatch.setattr(wandb_agent, "AgentProcess", Started)
    for name in ("WANDB_SWEEP_ID", "WANDB_RUN_ID", "WANDB_SWEEP_PARAM_PATH"):  # the agent sets them; restored after
        monkeypatch.setenv(name, "sweep0")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    agent = wandb_agent.Agent.__new__(wandb_agent.Agent)  # no server: only the method that builds the command
    agent._sweep_command, agent._function, agent._in_jupyter, agent._forward_signals = (
        list(raw["command"]),
        None,
        False,
        False,
    )
    agent._run_processes = {}
    for index, point in enumerate(points):
        agent._command_run(
            {"run_id": f"run{index}", "program": raw["program"], "args": {k: {"value": v} for k, v in point.items()}}
        )
    return started


def test_dry_run_prints_the_command_lines_wandbs_agent_runs(tmp_path, monkeypatch):
    command = ["${env}", "${interpreter}", "-m", "project.train", "experiment=debug",
               "data.dir=${envvar:SWEEP_TEST_DATA}", "${args_no_hyphens}", "${unknown_macro}"]  # fmt: skip
    parameters = {
        "strategy.activation_checkpointing": {"values": [False, True]},
        "optim.lr": {"values": [1e-4, 0.003]},
        "trainer.devices": {"value": 2},
    }
    path = write_spec(tmp_path, parameters, command=command)
    monkeypatch.setenv("SWEEP_TEST_DATA", "/data/shards")
    result = run_module("project.sweep", [f"spec={path}", "dry_run=true"])
    assert result.returncode == 0, result.stderr
    printed = [shlex.split(line) for line in result.stdout.splitlines() if not line.startswith("#")]
    points = sweep.sweep_points(sweep.load_spec(path))
    assert len(printed) == 4 and printed == wandb_agent_commands(
        yaml.safe_load(path.read_text()), points, tmp_path, monkeypatch
    )
    assert printed[0] == ["/usr/bin/env", "python", "-m", "project.train", "experiment=debug",
                          "data.dir=/data/shards", "optim.lr=0.0001", "strategy.activation_checkpointing=False",
                          "trainer.devices=2"]  # fmt: skip


def test_dry_run_of_a_bayes_spec_prints_its_random_start_up_points_and_says_the_rest_follow_from_results(tmp_path):
    path = write_spec(tmp_path, {"optim.lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2}},
                      method="bayes", metric={"name": "val/loss", "goal": "minimize"}, run_cap=12)  # fmt: skip
    result = run_module(
        "project.sweep", [f"spec={path}", "dry_run=true", "experiment=shakespeare", "trainer.max_steps=5"]
    )
    assert result.returncode == 0, result.stderr
    assert "Optuna's TPE search: the first 4 of 12 points are random draws" in result.stdout
    assert "4 bayes point(s) (the first 4 of 12: the others follow from their results)" in result.stdout
    lines = [shlex.split(line) for line in result.stdout.splitlines() if line.startswith("/usr/bin/env")]
    assert len(lines) == 4  # a third of run_cap
    for line in lines:  # the experiment the command names replaced, the other override appended
        assert "experiment=shakespeare" in line and "experiment=debug" not in line and line[-1] == "trainer.max_steps=5"


def test_extra_overrides_replace_what_the_command_or_a_constant_sets():
    argv = [
        "python",
        "-m",
        "project.train",
        "experiment=shakespeare",
        "logger=wandb",
        "trainer.devices=4",
        "optim.lr=0.1",
    ]
    assert sweep.with_overrides(argv, ["logger=csv", "trainer.devices=2", "+seed=3"]) == [
        "python", "-m", "project.train", "experiment=shakespeare", "logger=csv", "trainer.devices=2", "optim.lr=0.1",
        "+seed=3",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "parameters, spec_extra, argv, message",
    [
        (
            {"optim.lr": {"values": [1e-3]}},
            {"command": ["${env}", "${interpreter}", "-m", "project.train", "${args}"]},
            [],
            "${args_no_hyphens}",
        ),
        ({"strategy.virtual_stages": {"values": [None, 2]}}, {}, [], 'write "null"'),
        ({"optim": {"parameters": {"lr": {"values": [1e-3]}}}}, {}, [], "optim.KEY"),
        ({"optim.lr": {"values": [1e-3]}}, {"program": None}, [], "set program"),
        ({"optim.lr": {"min": 1e-4, "max": 1e-2}}, {"method": "random"}, [], "count=N"),
        ({"optim.lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2}}, {}, [], "a grid needs values"),
        ({"optim.lr": {"values": [1e-3, 3e-3]}}, {}, ["optim.lr=0.1"], "optim.lr is what"),
        ({"optim.lr": {"values": [1e-3]}}, {}, ["hydra.run.dir=x"], "sweep_dir=DIR"),
        ({"optim.lr": {"values": [1e-3]}}, {}, ["count=0"], "count=0"),
        ({"optim.lr": {"values": [1e-3]}}, {}, ["trainer.max_steps=5,10"], "one value per override"),
        ({"optim.lr": {"values": [1e-3]}}, {}, ["data.dir=[a"], "Hydra cannot read this override"),
    ],
    ids=[
        "hyphenated-args",
        "null",
        "nested",
        "no-program",
        "random-without-count",
        "grid-of-a-distribution",
        "override-of-a-varied-key",
        "run-dir",
        "count",
        "several-values",
        "unreadable-override",
    ],  # fmt: skip
)
def test_a_bad_spec_or_argument_is_one_error_paragraph_with_status_2(
    tmp_path, capsys, parameters, spec_extra, argv, message
):
    spec_extra = dict(spec_extra)
    method = spec_extra.pop("method", "grid")
    path = write_spec(tmp_path, parameters, method=method, **spec_extra)
    with pytest.raises(SystemExit) as exit_info:
        sweep.main([f"spec={path}", "dry_run=true", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and message in err and "Traceback" not in err


def test_each_point_is_recorded_with_the_values_it_ran_with_after_the_overrides(tmp_path, monkeypatch):
    """An override of a constant parameter replaces it in the point's command and in its record: a record's
    parameters are what Hydra composes from that point's own command, not the spec's values."""
    parameters = {
        "optim.lr": {"values": [1e-3, 3e-3]},
        "trainer.devices": {"value": 4},
        "trainer.max_steps": {"value": 100},
    }
    path = write_spec(tmp_path, parameters)
    monkeypatch.setattr(sweep, "run_point", lambda argv: (0, ""))  # nothing trains: the record is what is tested
    overrides = ["trainer.devices=2", "trainer.max_steps=5", "logger=csv"]
    assert sweep.main([f"spec={path}", f"sweep_dir={tmp_path / 'sweep'}", *overrides]) == 0
    records = [json.loads(line) for line in (tmp_path / "sweep" / "points.jsonl").read_text().splitlines()]
    assert [r["parameters"] for r in records] == [
        {"optim.lr": 0.001, "trainer.devices": 2, "trainer.max_steps": 5},
        {"optim.lr": 0.003, "trainer.devices": 2, "trainer.max_steps": 5},
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for record in records:
            argv = record["command"]
            cfg = compose(
                config_name="train", overrides=argv[argv.index("project.train") + 1 :], return_hydra_config=True
            )
            assert {name: OmegaConf.select(cfg, name) for name in record["parameters"]} == record["parameters"]


# A stand-in for project.train: progress bars on both streams, its own train.log and metrics.csv, or a refusal.
FAKE_POINT = """
import csv, pathlib, sys
args = dict(arg.split("=", 1) for arg in sys.argv[1:])
k = float(args["k"])
if k == 0:
    sys.exit(print("error: k=0 is refused", file=sys.stderr) or 2)
run_dir = pathlib.Path(args["hydra.run.dir"])
run_dir.mkdir(parents=True)
(run_dir / "train.log").write_text("the point's console")
for i in range(101):
    print(f"\\rEpoch 0: {i}%|#| {i}/100 [00:00<00:00]", end="", flush=True)
    print(f"\\rValidation: {i}/100", end="", file=sys.stderr, flush=True)
with open(run_dir / "metrics.csv", "w", newline="") as file:
    csv.writer(file).writerows([["step", "val/loss", "train/tokens_per_sec"], [9, 2.5, 1000 * k]])
"""


def test_the_sweep_console_has_a_line_as_each_point_starts_and_ends_and_a_table_of_plain_numbers(tmp_path, capfd):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_POINT)
    command = ["${interpreter}", str(script), "${args_no_hyphens}"]
    metric = {"name": "train/tokens_per_sec", "goal": "maximize"}
    path = write_spec(tmp_path, {"k": {"values": [26.0204, 6.625, 0]}}, command=command, metric=metric)
    assert sweep.main([f"spec={path}", f"sweep_dir={tmp_path / 'sweep'}"]) == 0
    out, err = capfd.readouterr()
    assert err == ""  # nothing of the points' consoles: their progress bars are theirs to keep
    points, table = out.split("\nsweep ")
    runs = (tmp_path / "sweep").absolute()
    assert [re.sub(r"after \d+\.\d s", "after S s", line) for line in points.splitlines()] == [
        f"point 0 (1/3) started: k=26.02; console: {runs / '0' / 'train.log'}",
        "point 0 ok after S s: val/loss 2.500, train/tokens_per_sec 26,020",
        f"point 1 (2/3) started: k=6.625; console: {runs / '1' / 'train.log'}",
        "point 1 ok after S s: val/loss 2.500, train/tokens_per_sec 6,625",
        f"point 2 (3/3) started: k=0; console: {runs / '2' / 'train.log'}",
        "point 2 failed (2) after S s: error: k=0 is refused",
    ]
    rows = [line.split() for line in table.splitlines()[3:6]]
    assert [(row[-3], row[-2]) for row in rows] == [("2.500", "26,020"), ("2.500", "6,625"), ("-", "-")]
    assert (runs / "0" / "train.log").read_text() == "the point's console"


def test_a_metric_column_has_one_format_from_losses_to_tokens_per_second():
    assert [sweep.metric_format([26020.4, 6625.0])(v) for v in (26020.4, 6625.0)] == ["26,020", "6,625"]
    assert [sweep.metric_format([26020.4, 900.6])(v) for v in (26020.4, 900.6)] == ["26,020", "901"]
    assert [sweep.metric_format([5.7561, 10.2])(v) for v in (5.7561, 10.2)] == ["5.76", "10.20"]
    assert [sweep.metric_format([0.0123, 0.0456])(v) for v in (0.0123, 0.0456)] == ["0.01230", "0.04560"]


def test_a_missing_spec_names_the_specs_there_are(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        sweep.main(["spec=experiments/sweeps/nope.yaml"])
    assert "experiments/sweeps/layouts.yaml" in capsys.readouterr().err


def test_a_sweep_folder_that_holds_a_sweep_is_never_reused(tmp_path, capsys):
    path = write_spec(tmp_path, {"optim.lr": {"values": [1e-3]}})
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "points.jsonl").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        sweep.main([f"spec={path}", f"sweep_dir={tmp_path / 'sweep'}"])
    assert exit_info.value.code == 2 and "holds a sweep already" in capsys.readouterr().err


def test_a_sweep_whose_every_point_is_refused_reports_each_and_exits_1(tiny_shards, tmp_path):
    """Refused settings fail a point within seconds; the runner goes on, and exits 1 only as nothing ran."""
    path = write_spec(tmp_path, {"micro_batch_size": {"values": [3, 5]}})
    args = [f"spec={path}", f"sweep_dir={tmp_path / 'sweep'}", "logger=csv", *data_overrides(tiny_shards)]
    result = run_module("project.sweep", args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "point 0 failed: error: micro_batch_size=3 does not divide the 8 sequences" in result.stdout
    assert "point 1 failed: error: micro_batch_size=5 does not divide" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "sweep" / "points.jsonl").read_text().splitlines()]
    assert [(r["point"], r["status"], r["parameters"]) for r in records] == [
        (0, 2, {"micro_batch_size": 3}),
        (1, 2, {"micro_batch_size": 5}),
    ]
    assert all(
        r["seconds"] < 10 and "logger=csv" in r["command"] and "logger=wandb" not in r["command"] for r in records
    )
    assert not (tmp_path / "sweep" / "0").exists()  # a refused run leaves no run directory
    assert (tmp_path / "sweep" / "spec.yaml").read_text() == path.read_text()


@pytest.mark.slow
def test_a_local_sweep_runs_every_point_and_reports_the_invalid_one_within_seconds(tiny_shards, tmp_path):
    parameters = {
        "global_batch_size": {"values": [8, 7]},
        "strategy": {"value": "ddp"},
        "trainer.devices": {"value": 2},
    }
    path = write_spec(tmp_path, parameters)
    overrides = [*data_overrides(tiny_shards), "trainer.max_steps=3", "val_every_n_steps=3", "logger=csv",
                 "trainer.enable_progress_bar=true"]  # fmt: skip
    result = run_module("project.sweep", [f"spec={path}", f"sweep_dir={tmp_path / 'sweep'}", *overrides])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    console = (tmp_path / "sweep" / "0" / "train.log").read_text()
    assert "run dir: " in console and "run dir: " not in result.stdout + result.stderr  # kept, not shown
    assert len(result.stdout[: result.stdout.index("\nsweep ")].splitlines()) == 4 and result.stderr == ""
    assert unexpected_warnings(console) == [] and unexpected_warnings(result.stdout) == []  # loader workers on
    records = [json.loads(line) for line in (tmp_path / "sweep" / "points.jsonl").read_text().splitlines()]
    assert [(r["parameters"]["global_batch_size"], r["status"]) for r in records] == [(8, 0), (7, 2)]
    assert records[0]["metrics"] == {"val/loss": list(read_metrics(tmp_path / "sweep" / "0", "val/loss").values())[-1]}
    assert records[1]["error"].startswith("error: global_batch_size=7 does not divide over 2 data-parallel ranks")
    assert records[1]["seconds"] < 10
    table = result.stdout[result.stdout.index("\nsweep ") :]
    assert "failed (2)" in table and " ok " in table and "global_batch_size" in table
    assert (tmp_path / "sweep" / "0" / "train.rank1.log").is_file() and not (tmp_path / "sweep" / "1").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "named_folder",
    [
        True,
        False,
    ],
    ids=["hydra.sweep.dir-given", "default-folder"],
)  # fmt: skip
def test_hydra_multirun_runs_each_multi_process_job_once_with_all_its_ranks_in_its_folder(
    tiny_shards, tmp_path, monkeypatch, named_folder
):
    monkeypatch.setenv("PROJECT_ROOT", str(tmp_path))  # outputs/multiruns/<date>_<time>/ under tmp_path
    args = [
        "-m",
        "experiment=debug",
        "strategy=ddp,fsdp2",
        "trainer.devices=2",
        "trainer.max_steps=3",
        *data_overrides(tiny_shards),
    ]
    named = [f"hydra.sweep.dir={tmp_path / 'outputs' / 'multiruns' / 'layouts'}"] if named_folder else []
    result = run_module("project.train", [*args, *named])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job_dirs = sorted({log.parent for log in (tmp_path / "outputs").rglob("train*.log")})
    assert len(job_dirs) == 2, job_dirs
    for job_dir in job_dirs:
        assert (
            (job_dir / "metrics.csv").is_file()
            and (job_dir / "train.log").is_file()
            and (job_dir / "train.rank1.log").is_file()
        )
        for log in ("train.log", "train.rank1.log"):  # each rank of each job started once
            assert sum(line.startswith("== ") for line in (job_dir / log).read_text().splitlines()) == 1
        assert sorted(read_metrics(job_dir, "train/loss")) == [0, 1, 2]  # no step logged twice
    strategies = [yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text()) for d in job_dirs]
    assert [[o for o in overrides if o.startswith("strategy=")] for overrides in strategies] == [
        ["strategy=ddp"],
        ["strategy=fsdp2"],
    ]
