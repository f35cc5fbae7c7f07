"""`make train` resumes its own latest run when that run stopped before the end, so that the sample after it is
reached; otherwise it starts a new run. The Makefile decides from the run's files: a checkpoint, and no closing
`done:` line in its train.log (which a finished run writes: checked on a real run below)."""

import re
import shutil
import subprocess

import pytest
from conftest import ROOT


def make_train(repo, *args: str) -> list[str]:
    """The train commands `make train` would run (make -n), with `echo` standing in for Python."""
    shown = subprocess.run(
        ["make", "-n", "train", "PY=echo", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout
    return [line for line in shown.splitlines() if "project.train" in line or "project.generate" in line]


@pytest.fixture
def repo(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def run_dir(repo, name: str, checkpoint: bool, finished: bool):
    folder = repo / "outputs" / "runs" / name
    (folder / "checkpoints").mkdir(parents=True)
    if checkpoint:
        (folder / "checkpoints" / "last.ckpt").write_bytes(b"")
    (folder / "train.log").write_text(
        "run dir: ...\n" + ("done: train/loss=4.2000; checkpoints in ...\n" if finished else "")
    )


def test_make_train_starts_a_new_run_without_an_unfinished_one(repo):
    train, generate = make_train(repo)
    assert re.search(r"hydra.run.dir=outputs/runs/train-shakespeare-\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d\s*$", train)
    assert "ckpt_path=last" not in train
    run_dir(repo, "train-shakespeare-2026-01-01_00-00-00", checkpoint=True, finished=True)  # finished
    run_dir(repo, "train-shakespeare-2026-01-02_00-00-00", checkpoint=False, finished=False)  # stopped before a save
    train, _ = make_train(repo)
    assert "ckpt_path=last" not in train and "2026-01-0" not in train


def test_make_train_resumes_its_latest_run_when_it_stopped_before_the_end(repo):
    run_dir(repo, "train-shakespeare-2026-01-01_00-00-00", checkpoint=True, finished=False)  # older: left alone
    run_dir(repo, "train-shakespeare-2026-01-02_00-00-00", checkpoint=True, finished=False)
    run_dir(repo, "train-debug-2026-01-03_00-00-00", checkpoint=True, finished=False)  # another experiment's
    latest = "outputs/runs/train-shakespeare-2026-01-02_00-00-00"
    train, generate = make_train(repo)
    assert train.endswith(f"hydra.run.dir={latest} ckpt_path=last")
    assert f"ckpt_path={latest}/checkpoints/last.ckpt" in generate
    # A folder of the user's choice is a new run there.
    train, _ = make_train(repo, "RUN_DIR=outputs/runs/mine")
    assert train.rstrip().endswith("hydra.run.dir=outputs/runs/mine")


def test_a_finished_run_ends_its_log_with_the_line_make_train_looks_for(single_reference):
    lines = (single_reference / "train.log").read_text().splitlines()
    assert any(line.startswith("done: ") for line in lines)
