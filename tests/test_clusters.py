"""Multi-node launches: torchrun, hand-started nodes and a real SLURM cluster train like one node, and a preempted
SLURM job checkpoints, requeues itself and resumes exactly."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from warm_start import shared_server

from tests.conftest import ROOT, read_metrics, run_train, train_overrides
from tests.local_slurm import FINAL_STATES, LocalSlurm, free_port, why_not_available

pytestmark = pytest.mark.slow

DDP = ["strategy=ddp", "global_batch_size=8"]


@pytest.fixture(scope="module")
def reference(tiny_shards, tmp_path_factory):
    """One node, two processes (Lightning's own launcher): the per-step losses every launch must match."""
    run_dir = tmp_path_factory.mktemp("one-node")
    run_train(tiny_shards, run_dir, *DDP, "trainer.devices=2", "trainer.max_steps=40", "val_every_n_steps=100")
    return read_metrics(run_dir, "train/loss")


def launch_command(launcher: str, node_rank: int, port: int) -> tuple[list[str], dict[str, str]]:
    """How each of two one-device nodes starts: through torchrun, or by hand with the variables Lightning
    reads (MASTER_ADDR, MASTER_PORT, NODE_RANK, WORLD_SIZE), one process per node."""
    python, warm = shared_server().python()  # started warm, as tests/conftest.py's runs are
    if launcher == "torchrun":
        return [
            python,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "project.train",
        ], warm
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node_rank), "WORLD_SIZE": "2"}
    return [python, "-m", "project.train"], {**warm, **env}


@pytest.mark.parametrize("launcher", ["torchrun", "environment"])
def test_two_nodes_train_like_one_node_with_two_processes(tiny_shards, tmp_path, reference, launcher):
    port = free_port()
    args = train_overrides(
        tiny_shards,
        tmp_path,
        *DDP,
        "trainer.num_nodes=2",
        "trainer.devices=1",
        "trainer.max_steps=40",
        "val_every_n_steps=100",
    )
    nodes = []
    for node_rank in (0, 1):
        command, variables = launch_command(launcher, node_rank, port)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **variables}
        nodes.append(
            subprocess.Popen(
                [*command, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert read_metrics(tmp_path, "train/loss") == pytest.approx(reference, abs=1e-6)
    assert (tmp_path / "train.rank1.log").is_file()  # the second node's rank kept its own record


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = why_not_available()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()


def submit(slurm: LocalSlurm, run_dir, overrides, *sbatch_args: str) -> str:
    python, warm = shared_server().python()
    env = {
        **slurm.env,
        "RUN_DIR": str(run_dir),
        "PYTHON": python,
        **warm,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        # Lightning derives the rendezvous port from the job id (15000 + its last digits), and every test cluster
        # numbers its jobs from 1: a port left in use by an earlier cluster's job would refuse this one's.
        "MASTER_PORT": str(free_port()),
    }
    result = subprocess.run(
        ["sbatch", "--parsable", f"--output={run_dir}.out", *sbatch_args, "experiments/slurm/train.sbatch", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip().split(";")[0]


def slurm_overrides(tiny_shards, run_dir, *extra):
    # The run directory comes from train.sbatch (RUN_DIR); trainer.num_nodes and devices from SLURM.
    return [a for a in train_overrides(tiny_shards, run_dir, *DDP, *extra) if not a.startswith("hydra.run.dir=")]


def test_a_two_node_slurm_job_trains_like_one_node(slurm, tiny_shards, tmp_path, reference):
    run_dir = tmp_path / "run"
    job = submit(slurm, run_dir, slurm_overrides(tiny_shards, run_dir, "trainer.max_steps=40", "val_every_n_steps=100"))
    [record] = slurm.wait_until_finished(job, timeout=300)
    log = (tmp_path / "run.out").read_text()
    assert record["JobState"] == "COMPLETED", log[-3000:]
    assert "on n[1-2]" in log and "rank 0 at 127.0.0.1" in log, log[-3000:]
    assert read_metrics(run_dir, "train/loss") == pytest.approx(reference, abs=1e-6), log[-3000:]


def test_a_preempted_slurm_job_saves_requeues_and_resumes_exactly(slurm, tiny_shards, tmp_path, reference):
    run_dir = tmp_path / "run"
    # No periodic checkpoint: the one the job resumes from is the one it saves on the signal.
    overrides = slurm_overrides(
        tiny_shards, run_dir, "trainer.max_steps=40", "val_every_n_steps=100", "ckpt_every_n_steps=1000"
    )
    job = submit(slurm, run_dir, overrides)
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.csv").is_file() or len(read_metrics(run_dir, "train/loss")) < 3:
        assert time.monotonic() < deadline and slurm.job_state(job) not in {"", *FINAL_STATES}, (
            "the job did not start training"
        )
        time.sleep(0.5)
    slurm.run("scancel", "--signal=USR1", job)  # what SLURM sends ahead of a preemption or the time limit
    [record] = slurm.wait_until_finished(job, timeout=300)
    log = (tmp_path / "run.out").read_text()
    assert (record["JobState"], record["Restarts"]) == ("COMPLETED", "1"), log[-3000:]
    assert "resume with ckpt_path=last (exit status 3)" in log and "requeueing job" in log, log[-3000:]
    assert "(restart 1)" in log and "Restored all states from the checkpoint" in log, log[-3000:]
    assert read_metrics(run_dir, "train/loss") == pytest.approx(reference, abs=1e-6), log[-3000:]


def test_a_slurm_job_array_prepares_the_corpus_as_one_machine_does(slurm, tiny_shards, tmp_path):
    from project.data.prepare import prepare_shards

    settings = [
        "data.sources=" + str(tiny_shards.parent / "raw" / "*.txt"),
        f"data.tokenizer={tiny_shards / 'tokenizer.json'}",
        "data.seq_len=32",
        "data.prepare_part_mb=0.01",
        "data.fetch=null",
        "data.val_fraction=0.3",
    ]
    python, warm = shared_server().python()
    env = {**slurm.env, "PYTHON": python, **warm, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--array=0-1",
            "--cpus-per-task=1",
            f"--output={tmp_path}/prepare-%a.out",
            "experiments/slurm/prepare_array.sbatch",
            *settings,
            f"data.dir={tmp_path / 'shards'}",
            f"paths.log_dir={tmp_path}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    records = slurm.wait_until_finished(result.stdout.strip().split(";")[0], timeout=300)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("prepare-*.out")))
    assert [r["JobState"] for r in records] == ["COMPLETED", "COMPLETED"] and "prepare task 1 of 2" in logs, logs[
        -3000:
    ]
    one = prepare_shards(
        [str(tiny_shards.parent / "raw" / "*.txt")],
        tmp_path / "one",
        tokenizer=tiny_shards / "tokenizer.json",
        seq_len=32,
        part_mb=0.01,
        num_workers=1,
        val_fraction=0.3,
        name="shakespeare",  # data.name, which the job's config gives and the manifest records
    )
    assert one["parts"] >= 3, "each task had parts of its own"
    files = {p.relative_to(tmp_path / "one"): p.read_bytes() for p in (tmp_path / "one").rglob("*") if p.is_file()}
    assert {
        p.relative_to(tmp_path / "shards"): p.read_bytes() for p in (tmp_path / "shards").rglob("*") if p.is_file()
    } == files, logs[-3000:]
