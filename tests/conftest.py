"""Shared fixtures: a small generated corpus, its shards, and a way to run training as a subprocess."""

from __future__ import annotations

import csv
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "the king queen lord lady sword crown night day love death war peace heart blood fair foul sweet "
    "bitter speak answer gentle noble villain honest fortune grave merry sorrow"
).split()


def write_corpus(directory: Path, documents: int = 8, lines: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for d in range(documents):
        text = "\n".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(lines)
        )
        (directory / f"doc{d}.txt").write_text(text + "\n")
    return directory


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Path:
    """Shards of a generated corpus: BPE vocab 300, 32-token sequences (blocks of 33)."""
    from project.data.prepare import prepare_shards

    root = tmp_path_factory.mktemp("tiny")
    corpus = write_corpus(root / "raw")
    prepare_shards([str(corpus / "*.txt")], root / "shards", vocab_size=300, seq_len=32, num_workers=1)
    return root / "shards"


def train_overrides(shards: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "experiment=debug",
        f"data.dir={shards}",
        "data.seq_len=32",
        "data.vocab_size=300",
        f"hydra.run.dir={run_dir}",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        *extra,
    ]


def run_module(module: str, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `python -m module args` in a fresh process; Lightning's DDP re-launches this same command per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    env.pop("PYTEST_CURRENT_TEST", None)
    result = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    return result


def run_train(shards: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    result = run_module("project.train", train_overrides(shards, run_dir, *extra))
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def read_metrics(run_dir: Path, column: str) -> dict[int, float]:
    """{step: value} for the rows of metrics.csv that carry `column`; a step logged twice fails the test."""
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [(int(row["step"]), float(row[column])) for row in csv.DictReader(f) if row.get(column)]
    steps = [step for step, _ in rows]
    assert len(steps) == len(set(steps)), f"{column} logged twice for a step in {run_dir / 'metrics.csv'}: {steps}"
    return dict(rows)


PARITY_RUN = ["trainer.max_steps=12", "global_batch_size=8"]


@pytest.fixture(scope="session")
def single_reference(tiny_shards, tmp_path_factory) -> Path:
    """The one-process run every parallel layout must reproduce (12 steps, global batch 8)."""
    run_dir = tmp_path_factory.mktemp("single-reference")
    run_train(tiny_shards, run_dir, *PARITY_RUN)
    return run_dir


# The schedule's length is fixed so that stopping early does not change the learning rates; micro
# batches of 2 make 4 accumulation steps on one process and 2 on two.
RESUME_RUN = ["optim.decay_steps=20", "global_batch_size=8", "micro_batch_size=2", "ckpt_every_n_steps=5"]


@pytest.fixture(scope="session")
def uninterrupted_reference(tiny_shards, tmp_path_factory) -> dict[int, float]:
    """Per-step train/loss of 20 uninterrupted single-process steps, which resumed runs must reproduce."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run_train(tiny_shards, run_dir, *RESUME_RUN, "trainer.max_steps=20")
    return read_metrics(run_dir, "train/loss")
