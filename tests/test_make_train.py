"""`make train` trains in one run directory per experiment with `ckpt_path=auto`: a first start trains, a run stopped
before the end resumes, a finished one is not trained again (project.train decides; the Makefile keeps no logic of
its own, tests/test_run_folders.py proves what `auto` does)."""

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
    for name in ("Makefile", "pyproject.toml", "project/runtime/hf_reference_site.py"):  # what make's rules name
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_make_train_starts_or_resumes_its_experiments_run_with_ckpt_path_auto(repo):
    train, generate = make_train(repo)
    assert train.rstrip().endswith("experiment=shakespeare hydra.run.dir=outputs/runs/train-shakespeare ckpt_path=auto")
    assert "ckpt_path=outputs/runs/train-shakespeare/checkpoints/last.ckpt" in generate
    # Whatever the folder holds: the command is the same, and project.train decides.
    (repo / "outputs" / "runs" / "train-shakespeare" / "checkpoints").mkdir(parents=True)
    (repo / "outputs" / "runs" / "train-shakespeare" / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert make_train(repo) == [train, generate]


def test_make_train_trains_in_a_folder_of_the_users_choice(repo):
    train, generate = make_train(repo, "RUN_DIR=outputs/runs/mine", "EXPERIMENT=debug")
    assert train.rstrip().endswith("experiment=debug hydra.run.dir=outputs/runs/mine ckpt_path=auto")
    assert "ckpt_path=outputs/runs/mine/checkpoints/last.ckpt" in generate


def test_a_finished_run_ends_its_log_with_a_done_line(single_reference):
    lines = (single_reference / "train.log").read_text().splitlines()
    assert any(line.startswith("done: ") for line in lines)
