"""tools.report: a table and plots from run directories, sweep folders and wandb's records of runs."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, read_metrics, run_module, run_train

from tools import report, report_wandb

LAYOUT_COLUMNS = [
    "pipeline_parallel",
    "data_parallel",
    "tensor_parallel",
    "micro_batch_size",
    "accumulation",
    "pipeline_microbatches",
    "global_batch_size",
    "world_size",
]


def write_run(
    run_dir: Path,
    strategy: str,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    micro: int = 8,
    tokens_per_sec: tuple = (100.0, 1000.0, 1200.0, 1100.0),
    peaks: tuple = (300 * 2**20,),
    max_steps: int | None = None,
) -> Path:
    """A run directory as project.train leaves it, written by hand: metrics.csv with the layout logged at
    the first step, Hydra's record of the config choices, config.yaml, and a memory file per rank."""
    world = dp * tp * pp
    steps = len(tokens_per_sec)
    layout = {
        "pipeline_parallel": pp,
        "data_parallel": dp,
        "tensor_parallel": tp,
        "micro_batch_size": micro,
        "accumulation": 1,
        "pipeline_microbatches": 1,
        "global_batch_size": 8,
        "world_size": world,
    }
    rows = [{"step": 0, **{f"layout/{k}": v for k, v in layout.items()}}]
    rows += [
        {"step": s, "train/loss": 6.0 - 0.1 * s, "train/tokens_per_sec": t, "memory/max_peak_bytes": max(peaks)}
        for s, t in enumerate(tokens_per_sec)
    ]
    rows.append({"step": steps - 1, "val/loss": 5.5})
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.csv", "w", newline="") as file:
        names = [
            "step",
            *(f"layout/{k}" for k in LAYOUT_COLUMNS),
            "train/loss",
            "train/tokens_per_sec",
            "memory/max_peak_bytes",
            "val/loss",
        ]
        writer = csv.DictWriter(file, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)
    (run_dir / ".hydra").mkdir()
    choices = {"hydra": {"runtime": {"choices": {"model": "debug", "strategy": strategy}}}}
    (run_dir / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(choices))
    trainer = {"devices": world, "num_nodes": 1, "max_steps": max_steps or steps}
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"trainer": trainer}))
    (run_dir / "memory").mkdir()
    for rank, peak in enumerate(peaks):
        record = {"global_rank": rank, "world_size": world, "step": steps, "peak_bytes": peak}
        (run_dir / "memory" / f"rank{rank}.json").write_text(json.dumps(record))
    return run_dir


def write_sweep(sweep_dir: Path, points: list[tuple[dict, int, str]]) -> Path:
    """points.jsonl as tools.sweep writes it: (parameters, exit status, error) per point, in order; each
    point of a spec for 4 devices, run with the override trainer.devices=2, which replaced the spec's constant
    in the command and in the recorded parameters."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / "points.jsonl", "w") as file:
        for index, (parameters, status, error) in enumerate(points):
            parameters = {**parameters, "trainer.devices": 2}
            command = [
                "python",
                "-m",
                "project.train",
                "experiment=debug",
                "trainer.devices=2",
                *(f"{k}={v}" for k, v in parameters.items() if k != "trainer.devices"),
            ]
            record = {
                "point": index,
                "parameters": parameters,
                "command": command,
                "run_dir": str(sweep_dir / str(index)),
                "status": status,
                "seconds": 1.0,
                "metrics": {},
                "error": error,
            }
            file.write(json.dumps(record) + "\n")
    return sweep_dir


def table_rows(report_md: Path) -> list[dict[str, str]]:
    """The report's table as {column: cell} per row, in the report's order."""
    lines = [line for line in report_md.read_text().splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split(" | ")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split(" | ")))) for line in lines[1:]]


def make_report(tmp_path: Path, *paths: Path, name: str = "r") -> list[dict[str, str]]:
    assert report.main([*map(str, paths), f"out={tmp_path / 'reports' / name}"]) == 0
    return table_rows(tmp_path / "reports" / name / "report.md")


def test_a_sweep_folder_reports_every_point_with_a_failed_point_s_error_as_its_status(tmp_path):
    sweep_dir = write_sweep(
        tmp_path / "layouts-x",
        [
            ({"strategy": "ddp"}, 0, ""),
            (
                {"strategy": "tp"},
                2,
                "error: strategy.tensor_parallel_size=4 does not divide the 2 devices: choose a divisor.",
            ),
        ],
    )
    write_run(sweep_dir / "0", "ddp", dp=2, micro=4, peaks=(300 * 2**20, 310 * 2**20))
    ok, failed = make_report(tmp_path, sweep_dir)
    assert ok["layout"] == "`debug_dp2-tp1-pp1_mb4_ddp`" and ok["run"] == "layouts-x/0" and ok["status"] == "ok"
    assert ok["devices"] == "2" and ok["peak memory per rank"] == "310 MiB"  # the highest rank's peak
    assert ok["train/loss"] == "5.7000" and ok["val/loss"] == "5.5000" and ok["MFU"] == "-"
    assert failed["run"] == "layouts-x/1" and failed["devices"] == "2"  # from its command: it left no run directory
    assert failed["layout"] == "strategy=tp"  # what sets it apart from the other points
    assert (
        failed["status"]
        == "failed (2): error: strategy.tensor_parallel_size=4 does not divide the 2 devices: choose a divisor."
    )
    assert failed["tokens/s per device"] == "-"


def test_a_failed_point_alone_is_named_by_all_its_parameters_as_it_ran_them(tmp_path):
    sweep_dir = write_sweep(tmp_path / "one-point", [({"strategy": "tp"}, 1, "")])
    (failed,) = make_report(tmp_path, sweep_dir)
    assert failed["layout"] == "strategy=tp trainer.devices=2"  # the runner's override, not the spec's constant 4
    assert failed["status"] == "failed (1): no error printed"


def test_runs_rank_by_median_tokens_per_second_per_device_after_the_first_window(tmp_path):
    # Two devices at 1100 tokens/s together (the first window, 100000, left out): 550 per device. One device at
    # 700 tokens/s ranks above them, and a run that logged no throughput comes last.
    two = write_run(tmp_path / "two", "ddp", dp=2, micro=4, tokens_per_sec=(100000.0, 1000.0, 1200.0, 1100.0))
    one = write_run(tmp_path / "one", "single", tokens_per_sec=(50.0, 700.0, 700.0))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text(yaml.safe_dump({"trainer": {"devices": 1, "max_steps": 5}}))
    rows = make_report(tmp_path, bare, two, one)
    assert [row["run"] for row in rows] == ["one", "two", "bare"]
    assert [row["tokens/s per device"] for row in rows] == ["700", "550", "-"]
    assert rows[2]["status"] == "no metrics"
    assert [row["#"] for row in rows] == ["1", "2", "3"]


def test_a_run_resumed_under_another_layout_is_reported_under_every_layout_at_its_last_speed(tmp_path):
    run = write_run(tmp_path / "moved", "ddp", dp=2, micro=4, tokens_per_sec=(10.0, 2000.0, 2000.0, 2000.0))
    # Resumed at step 4 on one device: the layout logged again there, then slower steps.
    resumed = [
        {
            "step": 4,
            "layout/pipeline_parallel": 1,
            "layout/data_parallel": 1,
            "layout/tensor_parallel": 1,
            "layout/micro_batch_size": 8,
            "layout/accumulation": 1,
            "layout/pipeline_microbatches": 1,
            "layout/global_batch_size": 8,
            "layout/world_size": 1,
        }
    ]
    resumed += [
        {"step": s, "train/loss": 5.0, "train/tokens_per_sec": t} for s, t in ((4, 5.0), (5, 300.0), (6, 300.0))
    ]
    with open(run / "metrics.csv", newline="") as file:
        names = csv.DictReader(file).fieldnames
    with open(run / "metrics.csv", "a", newline="") as file:
        csv.DictWriter(file, fieldnames=names).writerows(resumed)
    (run / ".hydra" / "hydra.yaml").write_text(
        yaml.safe_dump({"hydra": {"runtime": {"choices": {"model": "debug", "strategy": "single"}}}})
    )
    (row,) = make_report(tmp_path, run)
    # Without training's record of each start (an older run) the first start's strategy is unknown.
    assert row["layout"] == "`debug_dp2-tp1-pp1_mb4_? → debug_dp1-tp1-pp1_mb8_single`" and row["devices"] == "1"
    assert row["tokens/s per device"] == "300"  # the resumed start-up window (5) left out, and nothing before it
    # With it, as training writes it (a rollback's restart in the same layout is no new layout).
    starts = [(0, "debug_dp2-tp1-pp1_mb4_ddp"), (2, "debug_dp2-tp1-pp1_mb4_ddp"), (4, "debug_dp1-tp1-pp1_mb8_single")]
    lines = [json.dumps({"step": step, "layout": name}) for step, name in starts]
    (run / report.LAYOUTS_FILE).write_text("\n".join(lines) + "\n")
    (row,) = make_report(tmp_path, run, name="recorded")
    assert row["layout"] == "`debug_dp2-tp1-pp1_mb4_ddp → debug_dp1-tp1-pp1_mb8_single`"


def test_a_run_that_stopped_early_says_where(tmp_path):
    run = write_run(tmp_path / "cut", "single", max_steps=30)
    (row,) = make_report(tmp_path, run)
    assert row["status"] == "stopped at step 4 of 30"


def test_a_run_with_per_layer_numerics_gets_a_heat_map_per_statistic(tmp_path):
    run = write_run(tmp_path / "run", "single")
    with open(run / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    layers = ["embedding", "block0", "block1", "block10", "block2", "head"]  # in the columns' (alphabetical) order
    names = [f"numerics/{layer}/{stat}" for layer in layers for stat in ("update_ratio", "grad_norm")]
    rows += [{"step": step, **{name: 0.01 * (i + 1) * (step + 1) for i, name in enumerate(names)}} for step in (1, 3)]
    with open(run / "metrics.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[*rows[0].keys(), *names])
        writer.writeheader()
        writer.writerows(rows)
    make_report(tmp_path, run, name="numerics")
    folder = tmp_path / "reports" / "numerics"
    text = (folder / "report.md").read_text()
    for stat in ("update_ratio", "grad_norm"):
        svg = (folder / f"numerics-0-{stat}.svg").read_text()
        assert f"](numerics-0-{stat}.svg)" in text
        assert svg.count('class="cell"') == 2 * len(layers)  # a layer per row, a step per column
        # Rows in the model's order: the embedding, the blocks by number, the head.
        shown = [line.split(">")[1].split("<")[0] for line in svg.splitlines() if 'text-anchor="end"' in line]
        assert shown == ["embedding", "block0", "block1", "block2", "block10", "head"]
    assert not (folder / "numerics-0-output_rms.svg").exists()  # not logged


def test_every_eval_metric_is_plotted_against_the_tokens_trained_on(tmp_path):
    run = write_run(tmp_path / "run", "single")
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "global_batch_size": 8, "data": {"seq_len": 32}}))
    with open(run / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    names = ["eval/heldout/loss", "eval/heldout/bits_per_byte", "eval/seconds"]
    rows += [{"step": step, **dict.fromkeys(names, 2.0 - step / 10)} for step in (1, 3)]
    with open(run / "metrics.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[*rows[0].keys(), *names])
        writer.writeheader()
        writer.writerows(rows)
    summary = report.collect([str(run)])[0]
    # After steps 2 and 4 (0-based rows 1 and 3) of 8 sequences of 32 tokens; the evaluation's seconds are no curve.
    assert summary.evals == {name: [(512, 1.9), (1024, 1.7)] for name in names[:2]}
    make_report(tmp_path, run, name="evals")
    folder = tmp_path / "reports" / "evals"
    text = (folder / "report.md").read_text()
    for index in (0, 1):
        assert f"](eval-{index}.svg)" in text and (folder / f"eval-{index}.svg").stat().st_size > 1000
    assert not (folder / "eval-2.svg").exists()


def test_the_report_links_its_plots_and_writes_them(tmp_path):
    run = write_run(tmp_path / "run", "single")
    make_report(tmp_path, run, name="plots")
    folder = tmp_path / "reports" / "plots"
    text = (folder / "report.md").read_text()
    for plot in ("throughput.svg", "memory.svg", "loss.svg"):
        assert f"]({plot})" in text and (folder / plot).stat().st_size > 1000, plot


def test_by_default_a_report_is_written_under_outputs_and_nothing_else_is_created(tmp_path, monkeypatch):
    run = write_run(tmp_path / "runs" / "r0", "single")
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("PROJECT_ROOT", str(root))
    monkeypatch.chdir(root)
    assert report.main([str(run), "name=two-runs"]) == 0
    assert report.main([str(run)]) == 0  # the default name: <date>-<first folder's name>
    written = sorted(str(p.relative_to(root)) for p in root.rglob("report.md"))
    dated = report.default_name([str(run)])
    assert written == sorted(["outputs/reports/two-runs/report.md", f"outputs/reports/{dated}/report.md"])
    assert [p.name for p in root.iterdir()] == ["outputs"]


def test_out_is_the_report_folder_itself_and_its_name_titles_the_report(tmp_path):
    run = write_run(tmp_path / "run", "single")
    folder = tmp_path / "experiments" / "reports" / "2026-11-23-cpu-layouts"
    assert report.main([str(run), f"out={folder}"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["loss.svg", "memory.svg", "report.md", "throughput.svg"]
    assert (folder / "report.md").read_text().startswith("# Report 2026-11-23-cpu-layouts\n")
    assert report.main([str(run), f"out={folder}", "name=layouts"]) == 0
    assert (folder / "report.md").read_text().startswith("# Report layouts\n")


def test_a_report_made_again_in_its_folder_leaves_no_plot_of_the_one_it_replaces(tmp_path):
    run = write_run(tmp_path / "run", "single")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text(yaml.safe_dump({"trainer": {"devices": 1, "max_steps": 5}}))
    make_report(tmp_path, run, name="again")
    make_report(tmp_path, bare, name="again")
    assert sorted(p.name for p in (tmp_path / "reports" / "again").iterdir()) == ["report.md"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["{tmp}/missing"], "does not exist"),
        (["{tmp}"], "is neither a run directory nor a sweep folder"),
        ([], "give one or more run directories"),
        (["{tmp}", "colour=red"], "unknown argument 'colour=red'"),
        (["{tmp}", "name=a/b"], "name=a/b: give a folder name"),
        (["wandb:llama-pretrain"], "give wandb:ENTITY/PROJECT or wandb:ENTITY/PROJECT/SWEEP_ID"),
    ],
    ids=["missing", "not-a-run", "nothing", "unknown-option", "bad-name", "wandb-without-entity"],
)
def test_bad_arguments_are_one_error_paragraph_and_exit_status_2(tmp_path, capsys, args, says):
    with pytest.raises(SystemExit) as exit_:
        report.main([arg.format(tmp=tmp_path) for arg in args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and "Traceback" not in err
    assert not (tmp_path / "reports").exists()


def test_a_dry_runs_folder_among_the_runs_is_skipped_with_a_note(tmp_path, capsys):
    runs = tmp_path / "outputs" / "runs"
    write_run(runs / "a", "single")
    write_run(runs / "b", "ddp", dp=2, micro=4)
    (runs / "plan-check").mkdir()
    (runs / "plan-check" / "dry_run.json").write_text('{"ranks": []}\n')  # all a dry run leaves (test_dry_run.py)
    capsys.readouterr()
    rows = make_report(tmp_path, *sorted(runs.iterdir()))  # outputs/runs/*
    assert sorted(row["run"] for row in rows) == ["a", "b"]
    notes = [line for line in capsys.readouterr().err.splitlines() if line]
    assert notes == [f"note: skipped {runs / 'plan-check'}: a dry run's folder (dry_run.json), nothing trained there."]
    with pytest.raises(SystemExit) as exit_:
        report.main([str(runs / "plan-check"), f"out={tmp_path / 'only'}"])
    assert exit_.value.code == 2 and "only dry runs' folders" in capsys.readouterr().err


def test_the_command_line_refuses_a_path_that_is_no_run_with_exit_status_2(tmp_path):
    result = run_module("project.report", [str(tmp_path), f"out={tmp_path / 'reports'}"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_report_of_a_single_device_and_a_ddp_run_reads_their_layouts_devices_and_losses(tiny_shards, tmp_path):
    short = ["trainer.max_steps=4", "val_every_n_steps=2"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    run_train(tiny_shards, single, *short)
    run_train(tiny_shards, ddp, *short, "strategy=ddp", "trainer.devices=2")
    rows = {row["run"]: row for row in make_report(tmp_path, single, ddp, name="real")}
    # experiment=debug: a global batch of 8, the whole of it per replica unless micro_batch_size is set.
    assert rows["single"]["layout"] == "`debug_dp1-tp1-pp1_mb8_single`" and rows["single"]["devices"] == "1"
    assert rows["ddp"]["layout"] == "`debug_dp2-tp1-pp1_mb4_ddp`" and rows["ddp"]["devices"] == "2"
    # Training's record of each start's layout (under the name the report reads), which names a resumed run's
    # earlier layouts.
    assert report.recorded_layouts(ddp) == ["debug_dp2-tp1-pp1_mb4_ddp"]
    for run_dir in (single, ddp):
        row = rows[run_dir.name]
        train_loss, val_loss = read_metrics(run_dir, "train/loss"), read_metrics(run_dir, "val/loss")
        assert (
            row["train/loss"] == f"{train_loss[max(train_loss)]:.4f}"
            and row["val/loss"] == f"{val_loss[max(val_loss)]:.4f}"
        )
        assert (
            row["status"] == "ok" and row["tokens/s per device"] != "-" and row["peak memory per rank"].endswith("MiB")
        )
    folder = tmp_path / "reports" / "real"
    for plot in ("throughput.svg", "memory.svg", "loss.svg"):
        assert (folder / plot).stat().st_size > 0 and f"]({plot})" in (folder / "report.md").read_text()


# ---------------------------------------------------------------- runs as wandb recorded them


class StandInRun:
    """A stand-in for wandb.apis.public.Run (there is no wandb server here): the attributes tools.report
    reads, with the same names and shapes: id, tags, config (the run's config, values unwrapped as
    Run.config gives them) and scan_history() (history rows, each a dict with Lightning's trainer/global_step)."""

    def __init__(self, id: str, tags: list[str], config: dict, history: list[dict]):
        self.id, self.name, self.tags, self.config, self.state = id, "layout name", tags, config, "finished"
        self._history = history

    def scan_history(self):
        return iter(self._history)


class StandInApi:
    """A stand-in for wandb.Api: runs(path) and sweep(path).runs, as wandb's public API names them, serving
    fixed runs and recording what was asked."""

    def __init__(self, runs: list, error: Exception | None = None):
        self._runs, self._error, self.asked = runs, error, []

    def runs(self, path: str):
        self.asked.append(f"runs {path}")
        if self._error:
            raise self._error
        return self._runs

    def sweep(self, path: str):
        self.asked.append(f"sweep {path}")
        return type("Sweep", (), {"runs": self._runs})()


def as_wandb_run(run_dir: Path, id: str) -> StandInRun:
    """What wandb's server holds of a run that logged `run_dir`'s metrics.csv through Lightning's WandbLogger:
    the same values per row, with the step as trainer/global_step; its config and the tags training gives."""
    history = []
    for row in report.read_rows(run_dir / "metrics.csv"):
        item = {name: float(value) for name, value in row.items() if value and name != "step"}
        history.append({**item, "trainer/global_step": int(row["step"]), "_step": len(history)})
    choices = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"]["choices"]
    devices = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["devices"]
    tags = [choices["strategy"], choices["model"], f"{devices}-devices"]
    return StandInRun(id, tags, yaml.safe_load((run_dir / "config.yaml").read_text()), history)


@pytest.mark.parametrize(
    "source, asked",
    [
        ("wandb:team/llama-pretrain", "runs team/llama-pretrain"),
        ("wandb:team/llama-pretrain/sw33p", "sweep team/llama-pretrain/sw33p"),
    ],
    ids=["project", "sweep"],
)
def test_runs_on_wandbs_server_are_reported_as_their_metrics_csv_would_be(tmp_path, monkeypatch, source, asked):
    ddp = write_run(tmp_path / "ddp", "ddp", dp=2, micro=4, tokens_per_sec=(10.0, 1000.0, 1200.0, 1100.0))
    single = write_run(tmp_path / "single", "single", tokens_per_sec=(50.0, 700.0, 700.0), max_steps=30)
    api = StandInApi([as_wandb_run(ddp, "r1"), as_wandb_run(single, "r2")])
    monkeypatch.setattr(report_wandb, "connect", lambda source: api)
    from_wandb = make_report(tmp_path, source, name="wandb")
    from_csv = make_report(tmp_path, single, ddp, name="csv")
    assert api.asked == [asked]
    assert [row["run"] for row in from_wandb] == ["llama-pretrain/r2", "llama-pretrain/r1"]
    for row, reference in zip(from_wandb, from_csv):
        assert {**row, "run": reference["run"]} == reference
    assert (
        from_wandb[1]["layout"] == "`debug_dp2-tp1-pp1_mb4_ddp`"
        and from_wandb[0]["status"] == "stopped at step 3 of 30"
    )


def test_wandbs_server_refusing_the_runs_is_one_error_paragraph(tmp_path, monkeypatch, capsys):
    from wandb.errors import CommError

    monkeypatch.setattr(
        report_wandb, "connect", lambda source: StandInApi([], CommError("Could not find project nope"))
    )
    with pytest.raises(SystemExit) as exit_:
        report.main(["wandb:team/nope", f"out={tmp_path / 'reports'}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: wandb:team/nope: wandb's server did not give the runs")
    assert "Could not find project nope" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("mode", ["not-logged-in", "offline"])
def test_a_wandb_source_without_a_login_or_offline_says_how_to_log_in_or_use_local_folders(tmp_path, mode):
    """wandb's own login check, in a fresh process with no API key and no netrc: never a prompt, never the network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        HOME=str(tmp_path), NETRC=str(tmp_path / "netrc"), **({"WANDB_MODE": "offline"} if mode == "offline" else {})
    )
    result = subprocess.run(
        [sys.executable, "-m", "project.report", "wandb:team/llama-pretrain", f"out={tmp_path / 'reports'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert (
        len(error) == 1 and error[0].startswith("error: wandb:team/llama-pretrain: ") and "offline-run-*" in error[0]
    ), result.stderr
    fix = "unset WANDB_MODE" if mode == "offline" else "log in with `wandb login`"
    assert fix in error[0]
    assert not (tmp_path / "reports").exists()


@pytest.mark.slow
def test_a_run_logged_to_wandb_offline_is_reported_from_its_transaction_log_as_from_its_metrics_csv(
    tiny_shards, tmp_path
):
    run_dir = tmp_path / "run"
    run_train(tiny_shards, run_dir, "logger=wandb", "trainer.max_steps=4", "val_every_n_steps=2")
    (from_csv,) = make_report(tmp_path, run_dir, name="csv")
    train_loss, val_loss = read_metrics(run_dir, "train/loss"), read_metrics(run_dir, "val/loss")
    rates = read_metrics(run_dir, "train/tokens_per_sec")
    # The first logged window left out (by step, not the slowest: under load a later window can be slower).
    tokens_per_sec = sorted(rates[step] for step in sorted(rates)[1:])
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    alone = shutil.copytree(folder, tmp_path / "elsewhere" / folder.name)  # no run directory, no Hydra record around it
    (run_dir / "metrics.csv").rename(run_dir / "metrics.csv.moved")
    in_run_dir, from_folder = make_report(tmp_path, run_dir, alone, name="wandb")
    assert in_run_dir == from_csv  # every column, the rank memory file's peak included
    assert (
        from_csv["layout"] == "`debug_dp1-tp1-pp1_mb8_single`"
        and from_csv["devices"] == "1"
        and from_csv["status"] == "ok"
    )
    assert (
        from_csv["tokens/s per device"] == f"{tokens_per_sec[len(tokens_per_sec) // 2]:,.0f}"
    )  # an odd count: the middle
    assert (
        from_csv["train/loss"] == f"{train_loss[max(train_loss)]:.4f}"
        and from_csv["val/loss"] == f"{val_loss[max(val_loss)]:.4f}"
    )
    assert from_folder["run"] == folder.name and from_folder["peak memory per rank"].endswith("MiB")
    for column in ("layout", "devices", "tokens/s per device", "train/loss", "val/loss", "status"):
        assert from_folder[column] == from_csv[column], column


def test_a_run_resumed_in_its_directory_is_read_from_every_start_s_wandb_folder_its_replayed_steps_once(tmp_path):
    """Two starts of one wandb run, written offline by wandb itself as a resumed training run writes them: the
    second start logs again the steps since the checkpoint (2), which replace the first start's."""
    script = """
import sys, wandb
first, last, loss = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
run = wandb.init(id="r3sum3d", resume="allow", project="p", dir=sys.argv[4], mode="offline")
for step in range(first, last + 1):
    run.log({"train/loss": loss - step, "trainer/global_step": step})
run.finish()
"""
    env = {**os.environ, "WANDB_MODE": "offline", "HOME": str(tmp_path)}
    for first, last, loss in ((0, 2, 10.0), (2, 4, 20.0)):  # the second start at the checkpoint of step 2
        subprocess.run([sys.executable, "-c", script, str(first), str(last), str(loss), str(tmp_path)], env=env,
                       check=True, capture_output=True, timeout=120)  # fmt: skip
    folders = report_wandb.run_folders(tmp_path)
    assert len(folders) == 2
    rows = report_wandb.read_folders(folders, "resumed").rows
    assert [(row["step"], row["train/loss"]) for row in rows] == [(0, 10.0), (1, 9.0), (2, 18.0), (3, 17.0), (4, 16.0)]


def test_a_layout_that_splits_sequences_and_experts_is_named_with_both_degrees():
    """The report names a start by its logged layout as training named its run: context and expert degrees
    included where logged (a run from before they were logged has neither)."""
    facts = {"pipeline_parallel": 1, "data_parallel": 2, "tensor_parallel": 1, "micro_batch_size": 2}
    facts |= {"global_batch_size": 8, "pipeline_microbatches": 1, "context_parallel": 2, "expert_parallel": 4}
    rows = [{"step": 0, **{f"layout/{k}": v for k, v in facts.items()}}]
    assert report.logged_layouts(rows, {"model": "moe_debug", "strategy": "fsdp2"}) == [
        "moe_debug_dp2-tp1-pp1-cp2-ep4_mb2_fsdp2"
    ]
    before = {k: v for k, v in facts.items() if k not in ("context_parallel", "expert_parallel")}
    older = [{"step": 0, **{f"layout/{k}": v for k, v in before.items()}}]
    assert report.logged_layouts(older, {"model": "debug", "strategy": "ddp"}) == ["debug_dp2-tp1-pp1_mb2_ddp"]
