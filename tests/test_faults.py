"""Faults: a NaN loss stops the run before the update, with the step, and leaves the checkpoints as they
were, or, if asked, that step is skipped and counted (tests/faults.py injects it); SIGTERM or Ctrl-C, to rank 0 or to
the whole process group, saves at the next step and stops, and the resumed run continues exactly."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from project.checkpoint.files import checkpoint_step
from project.checkpoint.reshard import read_whole
from tests.conftest import ROOT, read_metrics, run_module, run_train, train_overrides

pytestmark = pytest.mark.slow


def run_with_fault(fault: str, shards, run_dir, *extra: str) -> subprocess.CompletedProcess:
    args = train_overrides(shards, run_dir, "trainer.max_steps=8", "ckpt_every_n_steps=1", *extra)
    return run_module("tests.faults", args, env={"FAULT": fault})


@pytest.mark.parametrize("layout", [[], ["strategy=ddp", "trainer.devices=2"]], ids=["single", "ddp"])
def test_a_nan_loss_stops_the_run_before_the_update_and_keeps_the_checkpoint(tiny_shards, tmp_path, layout):
    result = run_with_fault("nan@3", tiny_shards, tmp_path, *layout)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "error: step 3: the gradient norm is nan" in result.stderr and "Traceback" not in result.stderr
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == 3  # the last good step's, not overwritten by the faulty one
    assert all(torch.isfinite(t).all() for t in read_whole(last)["state_dict"].values())


def test_a_nan_at_a_step_that_does_not_log_stops_the_run_before_the_next_checkpoint(tiny_shards, tmp_path):
    """The guard decides on the device; the host reads it where it waits anyway: here, before the checkpoint after
    step 3 (the next logging step is 4), which is then not written."""
    settings = ["trainer.max_steps=8", "ckpt_every_n_steps=2", "trainer.log_every_n_steps=5"]
    result = run_module("tests.faults", train_overrides(tiny_shards, tmp_path, *settings), env={"FAULT": "nan@2"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert "error: step 2: the gradient norm is nan" in result.stderr and "Traceback" not in result.stderr
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == 2  # written after step 1; the one after step 3 was refused
    assert all(torch.isfinite(t).all() for t in read_whole(last)["state_dict"].values())


def test_with_max_skipped_steps_a_nan_step_is_skipped_counted_and_training_goes_on(tiny_shards, tmp_path):
    result = run_with_fault("nan@3", tiny_shards, tmp_path, "optim.max_skipped_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 3: gradient norm nan, update skipped (1 of optim.max_skipped_steps=2)" in result.stderr
    skipped, losses = read_metrics(tmp_path, "train/skipped_steps"), read_metrics(tmp_path, "train/loss")
    assert skipped[2] == 0 and skipped[3] == 1 and skipped[7] == 1
    assert math.isnan(losses[3]) and all(math.isfinite(losses[s]) for s in (0, 1, 2, 4, 5, 6, 7))
    assert all(
        torch.isfinite(t).all() for t in read_whole(tmp_path / "checkpoints" / "last.ckpt")["state_dict"].values()
    )


SIGNAL_STEPS = ["trainer.max_steps=40", "ckpt_every_n_steps=1000", "val_every_n_steps=1000", "global_batch_size=8"]
SIGNAL_LAYOUTS = {"single": [], "ddp": ["strategy=ddp", "trainer.devices=2"]}


@pytest.fixture(scope="module")
def uninterrupted(tiny_shards, tmp_path_factory):
    """{layout: the run dir of its 40 steps without a signal}, trained when a test first asks for one."""
    runs: dict[str, object] = {}

    def reference(layout: str):
        if layout not in runs:
            runs[layout] = tmp_path_factory.mktemp(f"uninterrupted-{layout}")
            run_train(tiny_shards, runs[layout], *SIGNAL_LAYOUTS[layout], *SIGNAL_STEPS)
        return runs[layout]

    return reference


# How the signal comes: to rank 0 alone (a scheduler's TERM, `kill PID`), or to the whole process group, loader
# workers and the other ranks too (a terminal's Ctrl-C; `timeout`, `kill -TERM -PGID`, scancel without --signal).
STOPS = {
    "single-term": ("single", signal.SIGTERM, False),
    "ddp-term": ("ddp", signal.SIGTERM, False),
    "single-term-group": ("single", signal.SIGTERM, True),
    "ddp-ctrl-c-group": ("ddp", signal.SIGINT, True),
}


@pytest.mark.parametrize("layout, sig, to_group", STOPS.values(), ids=list(STOPS))
def test_a_stop_signal_saves_at_a_step_and_the_resumed_run_continues_exactly(
    tiny_shards, tmp_path, uninterrupted, layout, sig, to_group
):
    run_dir = tmp_path / "run"
    workers = ["data.loader_workers=1"] if to_group else []  # the group's signal reaches them too: they read on
    args = train_overrides(tiny_shards, run_dir, *SIGNAL_LAYOUTS[layout], *SIGNAL_STEPS, *workers)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    process = subprocess.Popen(
        [sys.executable, "-m", "project.train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, as a terminal's job or a batch job has
    )
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.csv").is_file() or len(read_metrics(run_dir, "train/loss")) < 3:
        assert process.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    if to_group:
        os.killpg(process.pid, sig)
    else:
        process.send_signal(sig)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 3, stderr[-3000:]
    stopped = checkpoint_step(run_dir / "checkpoints" / "last.ckpt")
    assert 3 <= stopped < 40 and f"stopped at step {stopped}: resume with ckpt_path=last" in stderr
    assert f"{sig.name} received: the run saves and stops" in stderr
    for broken in ("Traceback", "EOFError", "DataLoader worker", "KeyboardInterrupt"):
        assert broken not in stderr, stderr[-3000:]
    if sig == signal.SIGTERM:  # it first wrote where the rank was, in case it never reached the next step
        assert "(most recent call first)" in (run_dir / "train.log").read_text()  # (project.runtime.stacks)

    run_train(tiny_shards, run_dir, *SIGNAL_LAYOUTS[layout], *SIGNAL_STEPS, "ckpt_path=last")
    reference = read_metrics(uninterrupted(layout), "train/loss")
    assert read_metrics(run_dir, "train/loss") == pytest.approx(reference, abs=1e-6)


def test_checkpoints_by_wall_time_come_between_the_step_checkpoints(tiny_shards, tmp_path):
    # No step checkpoint before step 1000; every step ends more than a microsecond after the last save.
    result = run_with_fault("nan@4", tiny_shards, tmp_path, "ckpt_every_n_steps=1000", "ckpt_every_minutes=1e-8")
    assert result.returncode == 1 and "error: step 4" in result.stderr, result.stderr[-3000:]
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == 4  # saved by time after step 4's predecessor


def test_a_copy_that_drifts_on_one_rank_stops_the_run_before_the_next_checkpoint(tiny_shards, tmp_path):
    """DDP's second rank moves one value of its copy by one unit in the last place as step 3 starts; the copies are
    compared before the checkpoint after it (at step 4), which is then not written."""
    settings = ["strategy=ddp", "trainer.devices=2", "ckpt_every_n_steps=2", "stability.replica_check_every_n_steps=0"]
    result = run_with_fault("drift@3:rank=1", tiny_shards, tmp_path, *settings)
    assert result.returncode == 1, result.stderr[-3000:]
    said = "error: copies of replicated parameters differ at step 4: model.output.weight on rank(s) [1] differs from "
    assert said + "rank(s) [0] (its copies: [0, 1])" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == 2  # the one after step 3 was refused


def test_tensor_parallel_copies_of_a_norm_are_compared_every_n_steps(tiny_shards, tmp_path):
    settings = ["strategy=tp", "trainer.devices=2", "ckpt_every_n_steps=100", "stability.replica_check_every_n_steps=2"]
    result = run_with_fault("drift@4:rank=0", tiny_shards, tmp_path, *settings)
    assert result.returncode == 1, result.stderr[-3000:]
    # Two copies, neither held by more ranks: the first rank's is the reference.
    said = "error: copies of replicated parameters differ at step 6: model.norm.weight on rank(s) [1] differs from "
    assert said + "rank(s) [0] (its copies: [0, 1])" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()
