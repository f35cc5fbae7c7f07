"""Crashes: a run killed at any point, even while it saves, resumes from `ckpt_path=last` exactly as if it had
never stopped; one rank failing ends the whole job soon, names that rank, and leaves no process behind.
Faults come from tests/faults.py."""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from warm_start import shared_server

from project.checkpoint.files import checkpoint_step, resolve_ckpt_path
from project.checkpoint.reshard import read_whole
from tests.conftest import PARITY_RUN, PIPELINE_RUN, ROOT, read_metrics, run_train, train_overrides

pytestmark = pytest.mark.slow

# The parity tests' runs (tests/test_*parity.py, tests/test_pipeline.py), which serve as the uninterrupted runs here.
# One per checkpoint format and strategy family: tp_fsdp saves what fsdp2 and tp save (DTensor shards over both).
LAYOUTS = {
    "ddp": [*PARITY_RUN, "strategy=ddp", "trainer.devices=2", "micro_batch_size=null"],
    "tp_fsdp": [*PARITY_RUN, "strategy=tp_fsdp", "trainer.devices=4"],
    "pipeline": [*PIPELINE_RUN, "strategy=pipeline", "trainer.devices=2", "strategy.schedule=1f1b"],
}
TRAINED_TOGETHER = list(LAYOUTS.values())  # trained together before the first test (tests/conftest.py: trained)


@dataclass
class Ended:
    returncode: int
    stderr: str
    seconds: float
    survivors: list[str]  # processes of the job still alive once its first process has ended
    lingered: float  # seconds from its end until the last process holding its console had gone


def processes_in_session(session: int) -> list[str]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended while we looked
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == session and fields[0] != "Z":
            found.append(f"{stat.parent.name}: {text[: text.rindex(')') + 1]}")
    return found


def launch(
    fault: str,
    shards: Path,
    run_dir: Path,
    *extra: str,
    torchrun: bool = False,
    timeout: float = 300,
    max_file_size: int | None = None,
) -> Ended:
    """`python -m tests.faults` (or under torchrun) in its own session, so that its processes can be found; started
    warm (tests/warm_start.py), as tests.conftest.run_module starts a run."""
    module, args = "tests.faults", train_overrides(shards, run_dir, *extra)
    if torchrun:
        module, args = "torch.distributed.run", ["--standalone", "--nproc-per-node=2", "-m", "tests.faults", *args]
    env = {**os.environ, "FAULT": fault, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    env["PYTHONFAULTHANDLER"] = (
        "1"  # a rank that crashes (SIGSEGV) prints its stack, as tests.conftest.run_module has it
    )
    env.pop("PYTEST_CURRENT_TEST", None)
    start = time.monotonic()
    process = shared_server().start(module, args, ROOT, env, max_file_size)
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    ended = time.monotonic()
    deadline = ended + 10  # a rank killed with its launcher takes a moment to go
    while (survivors := processes_in_session(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if survivors:
        os.killpg(process.pid, signal.SIGKILL)
    _, stderr = process.communicate(timeout=60)  # once every process that held its streams has gone
    return Ended(process.returncode, stderr, ended - start, survivors, time.monotonic() - ended)


def assert_same_run(run_dir: Path, reference: Path, checkpoints: tuple[str, str] | None = None) -> None:
    """Bit for bit: every step's loss and gradient norm, and the final weights (`checkpoints`: the two runs'
    checkpoint folders, where not in their run directories)."""
    for column in ("train/loss", "train/grad_norm"):
        assert read_metrics(run_dir, column) == read_metrics(reference, column), column
    mine, theirs = checkpoints or (run_dir / "checkpoints", reference / "checkpoints")
    weights = read_whole(resolve_ckpt_path("last", mine))["state_dict"]
    expected = read_whole(resolve_ckpt_path("last", theirs))["state_dict"]
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=list(LAYOUTS))
def test_a_run_killed_after_a_checkpoint_resumes_bit_for_bit(trained, tiny_shards, tmp_path, layout):
    step = random.Random(" ".join(layout)).randint(5, 11)  # some steps after the checkpoint of step 4 or 8
    ended = launch(f"kill@{step}", tiny_shards, tmp_path, *layout, "ckpt_every_n_steps=4")
    assert ended.returncode == -signal.SIGKILL and not ended.survivors, ended.stderr[-3000:]
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == step // 4 * 4

    run_train(tiny_shards, tmp_path, *layout, "ckpt_every_n_steps=4", "ckpt_path=last")
    assert_same_run(tmp_path, trained(*layout))  # checkpoints are written in between, and change nothing


# Each killed run moves a few steps on (written in the background, a save is put in place a step or more after its
# own); no validation, so that saves follow each other quickly.
SAVE_STEPS = 24
SAVE_RUN = [
    f"trainer.max_steps={SAVE_STEPS}",
    f"optim.decay_steps={SAVE_STEPS}",
    "global_batch_size=8",
    "ckpt_every_n_steps=1",
    "val_every_n_steps=1000",
]


# One process writes the sharded format too (a folder of shards and metadata, swapped in as a folder), at half
# the cost of two; what several ranks do differently is covered above and below.
# Written in the background (ckpt_async) the same holds, whenever the kill comes: while the step copies the state,
# while the writer thread writes it, or while rank 0 swaps it in at a later step.
SAVES = {
    "single-file": [],
    "sharded": ["strategy=fsdp2", "trainer.devices=1"],
    "single-file-async": ["ckpt_async=true"],
    "sharded-async": ["strategy=fsdp2", "trainer.devices=1", "ckpt_async=true"],
}


@pytest.mark.parametrize("layout", SAVES.values(), ids=list(SAVES))
def test_a_run_killed_while_it_saves_resumes_every_time(tiny_shards, tmp_path, layout):
    reference = tmp_path / "reference"
    counted = launch("count-save-ops", tiny_shards, reference, *SAVE_RUN, *layout)
    assert counted.returncode == 0, counted.stderr[-3000:]
    # Rank 0 makes the most changes (it also writes the metadata and swaps the folders); from the second
    # save on, an earlier checkpoint is replaced, which is when a kill can do harm.
    changes = min(
        int(n) for s, n in re.findall(r"faults: save (\d+) of rank 0 made (\d+) changes", counted.stderr) if int(s) > 1
    )
    moments = sorted({round(1 + i * (changes - 1) / 3) for i in range(4)})  # the first, the last, and between
    assert len(moments) == 4, f"a save makes only {changes} changes to the file system"

    run = tmp_path / "run"
    for kill in moments:  # ckpt_path=auto: the first start trains anew, the others resume
        ended = launch(f"kill-in-save@2:{kill}", tiny_shards, run, *SAVE_RUN, *layout, "ckpt_path=auto")
        assert ended.returncode == -signal.SIGKILL and not ended.survivors, (
            f"killed before change {kill}: {ended.stderr[-3000:]}"
        )
        # Its loader worker goes with it (project.data.loader_workers.start_worker), not at torch's next look at
        # its parent, up to five seconds later.
        assert ended.lingered < 4, f"a process of the run lived {ended.lingered:.1f} s on"
        found = resolve_ckpt_path("last", run / "checkpoints")  # as the next run does
        assert 1 <= checkpoint_step(found) < SAVE_STEPS and read_whole(found)["state_dict"], (
            f"killed before change {kill}"
        )
    run_train(tiny_shards, run, *SAVE_RUN, *layout, "ckpt_path=last")
    assert_same_run(run, reference)


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


FULL_DISK = {
    "single-file": [],
    "sharded": ["strategy=fsdp2", "trainer.devices=2"],
    "sharded-async": ["strategy=fsdp2", "trainer.devices=2", "ckpt_async=true"],  # said at the next save
}


@pytest.mark.parametrize("layout", FULL_DISK.values(), ids=list(FULL_DISK))
def test_a_full_disk_while_saving_is_one_clear_error_and_keeps_the_checkpoints(tiny_shards, tmp_path, layout):
    steps = ["global_batch_size=8", "ckpt_every_n_steps=1", "val_every_n_steps=1000", "optim.decay_steps=4"]
    run_train(tiny_shards, tmp_path, *steps, *layout, "trainer.max_steps=2")
    before = digest(tmp_path / "checkpoints")

    # A checkpoint (or each rank's shard of one) is larger than 512 KiB; the logs stay well under.
    ended = launch(
        "", tiny_shards, tmp_path, *steps, *layout, "trainer.max_steps=4", "ckpt_path=last", max_file_size=512 * 1024
    )
    assert ended.returncode == 2 and not ended.survivors, ended.stderr[-3000:]
    said = (
        r"error: the checkpoint written in the background to .*checkpoints/last.ckpt.partial failed \(.*File too large"
        if "ckpt_async=true" in layout
        else r"error: last.ckpt of step 3 could not be written to .*checkpoints \(OSError: \[Errno 27\] File too large"
    )
    assert re.search(said, ended.stderr), ended.stderr[-3000:]
    assert "Traceback" not in ended.stderr, ended.stderr[-3000:]
    assert digest(tmp_path / "checkpoints") == before  # nothing half written left, nothing earlier touched
    run_train(tiny_shards, tmp_path, *steps, *layout, "trainer.max_steps=4", "ckpt_path=last")  # once there is room
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == 4


# What names the failed rank: under Lightning's launcher, rank 0's line for the child that ended (or
# Lightning's own observer, when it sees the child first); torchrun's summary of its workers (rank 1 as the root
# cause, or among the failures when torchrun saw rank 0's end in the same second: it orders by whole seconds);
# and project.train's own line for a rank that raised.
NAMED = {
    ("killed", "lightning"): r"because rank 1 \(PID \d+\) ended: killed by SIGKILL"
    r"|\[rank: 1\] Child process with PID \d+ terminated with code -9",
    ("killed", "torchrun"): r"\n\s+rank\s+: 1 \(local_rank: 1\)\n\s+exitcode\s+: -9 \(pid: \d+\)",
    ("raising", "lightning"): r"error: rank 1 of 2 failed: RuntimeError: fault injected at step 3",
    ("raising", "torchrun"): r"error: rank 1 of 2 failed: RuntimeError: fault injected at step 3",
}


@pytest.mark.parametrize("failure, launcher", NAMED, ids=[f"{f}-{launcher}" for f, launcher in NAMED])
def test_one_failed_rank_ends_the_job_names_it_and_leaves_no_process(tiny_shards, tmp_path, failure, launcher):
    fault = {"killed": "kill@3:rank=1", "raising": "raise@3:rank=1"}[failure]
    # The default collective timeout (10 minutes): the job ends because the failure is seen, not waited out.
    ended = launch(fault, tiny_shards, tmp_path, *LAYOUTS["ddp"], torchrun=launcher == "torchrun")
    assert ended.returncode != 0 and not ended.survivors, ended.stderr[-3000:]
    assert ended.seconds < 90, f"the job took {ended.seconds:.0f} s to end"
    assert re.search(NAMED[failure, launcher], ended.stderr), ended.stderr[-3000:]


# A rank that stops answering: in its fourth step, past start-up, the job ends after collective_timeout_minutes (12 s),
# on every group of the run (tp_fsdp: rank 0 waits on its tensor-parallel group, which its mesh made); before its first
# step has ended, after startup_timeout_minutes (30 s: also the longest the ranks may take to meet at start, which a
# loaded test machine needs), the steady bound not applying yet. Gloo names each wait in milliseconds.
HANGS = {
    "in-a-step": ("hang@3:rank=1", "ddp", 12),
    "in-a-step-tp_fsdp": ("hang@3:rank=1", "tp_fsdp", 12),
    "at-start-up": ("hang@0:rank=1", "ddp", 30),
}


@pytest.mark.parametrize("fault, layout, seconds", HANGS.values(), ids=list(HANGS))
def test_a_rank_that_stops_answering_ends_the_job_after_the_collective_timeout(
    tiny_shards, tmp_path, fault, layout, seconds
):
    timeouts = ["strategy.collective_timeout_minutes=0.2", "strategy.startup_timeout_minutes=0.5"]
    ended = launch(fault, tiny_shards, tmp_path, *LAYOUTS[layout], *timeouts)
    assert ended.returncode != 0 and not ended.survivors, ended.stderr[-3000:]
    assert seconds <= ended.seconds < seconds + 120, f"the job took {ended.seconds:.0f} s to end"
    # The rank whose wait times out first may be any waiting one: with four, rank 0 may instead wait on a rank that
    # waits on the hung one, and see its peer's connection close. Its log says so; the first to time out, its own.
    consoles = ended.stderr + "".join(log.read_text() for log in sorted(tmp_path.glob("train.rank*.log")))
    assert f"Timed out waiting {seconds * 1000}ms" in consoles, ended.stderr[-3000:]
    assert re.search(r"error: rank 0 of \d failed: a collective operation failed", ended.stderr), ended.stderr[-3000:]
    if fault.startswith("hang@0") or layout != "ddp":
        return
    # Where each rank was: the hung one in the fault's sleep, from the stack its watchdog wrote into its log.
    assert re.search(
        r"the ranks were in: rank 0 in \w+ \(.*\); rank 1 in on_train_batch_start \(tests/faults.py:", ended.stderr
    ), ended.stderr[-3000:]
    assert "(most recent call first)" in (tmp_path / "train.rank1.log").read_text()
