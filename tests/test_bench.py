"""`python -m project.bench` and `project.bench_platform` write new result files and never edit one already there."""

import json
import statistics
from pathlib import Path

import pytest

from conftest import run_module

TINY = ["presets=debug", "steps=2", "batch=2", "seq_len=16", "error_latency=false"]


def run_bench(out: Path, *extra: str):
    result = run_module("project.bench", [*TINY, f"out={out}", *extra], timeout=120)
    assert result.returncode == 0, f"bench failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_bench_writes_new_files_and_never_overwrites(tmp_path):
    run_bench(tmp_path)
    first = sorted(tmp_path.iterdir())
    assert [p.suffix for p in first] == [".json", ".md"]
    report = json.loads(first[0].read_text())
    assert report["command"].endswith(" ".join([*TINY, f"out={tmp_path}"]))
    assert report["machine"]["cpu_count"] >= 1 and report["threads"] >= 1 and report["torch"]
    [preset] = report["presets"]
    assert (preset["model"], preset["batch"], preset["seq_len"], preset["steps"], preset["vocab_size"]) == ("debug", 2, 16, 2, 512)
    assert preset["tokens_per_sec"] > 0 and preset["model_tflops"] > 0
    assert "config_error_latency" not in report
    assert "| debug |" in first[1].read_text()
    before = {p: p.read_bytes() for p in first}

    run_bench(tmp_path)
    second = sorted(set(tmp_path.iterdir()) - set(first))
    assert [p.name for p in second] == [first[0].stem + "-2.json", first[0].stem + "-2.md"]
    assert {p: p.read_bytes() for p in first} == before
    assert json.loads(second[0].read_text())["presets"][0]["tokens_per_sec"] > 0


def test_unknown_preset_is_a_config_error(tmp_path):
    result = run_module("project.bench", ["presets=debug,no_such_model", f"out={tmp_path}"], timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "no_such_model" in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_platform_bench_times_project_train_beside_a_hand_loop_and_writes_both_commands(tmp_path):
    result = run_module("project.bench_platform", ["presets=debug", "steps=2", "warmup=1", "repeats=2", "threads=1", f"out={tmp_path}"], timeout=600)
    assert result.returncode == 0, f"bench failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    [report_file] = tmp_path.glob("*-platform.json")
    report = json.loads(report_file.read_text())
    [row] = report["rows"]
    assert (row["preset"], row["steps"], row["warmup"], row["threads"]) == ("debug", 2, 1, 1)
    assert len(row["runs"]["project_train"]) == len(row["runs"]["hand_loop"]) == 2
    assert row["project_train_tokens_per_sec"] == pytest.approx(statistics.median(row["runs"]["project_train"]), rel=1e-3)
    assert row["ratio"] == pytest.approx(row["project_train_tokens_per_sec"] / row["hand_loop_tokens_per_sec"], rel=1e-2)
    assert "project.train" in row["commands"]["project_train"] and "--hand-loop debug" in row["commands"]["hand_loop"]
    assert "| debug | 8 x 256 | 2 |" in report_file.with_suffix(".md").read_text()
    start = report["startup"]  # the debug experiment's first step, split at `import lightning`
    assert len(start["runs"]["seconds_to_first_step"]) == 2 and start["seconds_to_first_step"] > start["import_lightning_seconds"] > 0
    assert start["rest_seconds"] == pytest.approx(start["seconds_to_first_step"] - start["import_lightning_seconds"], abs=0.011)
    assert start["peak_rss_mib"] > 100 and "import lightning" in report_file.with_suffix(".md").read_text()


def test_platform_bench_refuses_an_unknown_preset_before_running_anything(tmp_path):
    result = run_module("project.bench_platform", ["presets=no_such_model", f"out={tmp_path}"], timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "no_such_model" in result.stderr
    assert not list(tmp_path.iterdir())
