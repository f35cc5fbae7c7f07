"""strategy=horovod under `horovodrun -np 2` (gloo, CPU): the optimization of one process with the same
global batch, summed gradients twice the mean, resume; and clear refusals of what cannot run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    PARITY_RUN,
    RESUME_RUN,
    ROOT,
    assert_continues,
    assert_reproduces,
    read_metrics,
    run_module,
    run_train,
    train_overrides,
)
from warm_start import shared_server

HOROVODRUN = Path(sys.executable).parent / "horovodrun"
needs_horovod = pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None or not HOROVODRUN.exists(),
    reason=(
        "Horovod is not installed in this environment: `make install-horovod` builds it (make test does), "
        "about 3 minutes once"
    ),
)


def horovodrun(shards: Path, run_dir: Path, *extra: str, processes: int = 2) -> subprocess.CompletedProcess:
    """`horovodrun -np N -H localhost:N python -m project.train strategy=horovod ...` on this machine."""
    python, warm = shared_server().python()  # each rank started warm, as tests/conftest.py's runs are
    env = {**os.environ, **warm, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    env.pop("PYTEST_CURRENT_TEST", None)
    command = [
        str(HOROVODRUN),
        "-np",
        str(processes),
        "-H",
        f"localhost:{processes}",
        python,
        "-m",
        "project.train",
    ]
    args = train_overrides(shards, run_dir, "strategy=horovod", *extra)
    return subprocess.run([*command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def trained_by_horovod(shards: Path, run_dir: Path, *extra: str) -> Path:
    result = horovodrun(shards, run_dir, *extra)
    assert result.returncode == 0, f"horovodrun failed:\n{result.stdout[-5000:]}\n{result.stderr[-3000:]}"
    return run_dir


@pytest.mark.slow
@needs_horovod
def test_two_horovod_processes_with_accumulation_optimize_like_one_process(tiny_shards, single_reference, tmp_path):
    # micro batch 2: each process accumulates 2 micro batches (backward_passes_per_step) per step of global batch 8
    run_dir = trained_by_horovod(tiny_shards, tmp_path, *PARITY_RUN, "micro_batch_size=2")
    assert_reproduces(run_dir, single_reference)  # per-step loss, gradient norm and final weights
    assert read_metrics(run_dir, "val/loss")[9] == pytest.approx(
        read_metrics(single_reference, "val/loss")[9], rel=1e-5
    )


@pytest.mark.slow
@needs_horovod
def test_summed_horovod_gradients_are_twice_the_mean_on_two_processes(tiny_shards, single_reference, tmp_path):
    trained_by_horovod(tiny_shards, tmp_path, *PARITY_RUN, "trainer.max_steps=1", "strategy.grad_reduction=sum")
    summed = read_metrics(tmp_path, "train/grad_norm")[0]
    assert summed == pytest.approx(2 * read_metrics(single_reference, "train/grad_norm")[0], rel=1e-4)


@pytest.mark.slow
@needs_horovod
def test_fp16_compressed_gradients_stay_within_fp16_rounding_and_an_unbuilt_hierarchy_is_named(
    tiny_shards, single_reference, tmp_path
):
    result = horovodrun(
        tiny_shards,
        tmp_path,
        *PARITY_RUN,
        "trainer.max_steps=1",
        "strategy.compression=fp16",
        "strategy.hierarchical_allreduce=true",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # This build has no NCCL: the setting is said to do nothing, once (rank 0), instead of being ignored silently.
    assert (result.stdout + result.stderr).count("strategy.hierarchical_allreduce=true has no effect here") == 1
    norm, reference = read_metrics(tmp_path, "train/grad_norm")[0], read_metrics(single_reference, "train/grad_norm")[0]
    assert norm == pytest.approx(reference, rel=2e-3)  # fp16 keeps 11 significant bits


@pytest.mark.slow
@needs_horovod
def test_validation_over_shares_of_unequal_size_is_the_mean_over_every_sequence(tiny_shards, tmp_path):
    validated = [
        "trainer.max_steps=1",
        "global_batch_size=8",
        "val_sequences=5",
        "val_every_n_steps=1",
    ]  # 3 and 2 sequences
    run_train(tiny_shards, tmp_path / "one", *validated)
    trained_by_horovod(tiny_shards, tmp_path / "two", *validated)
    [one], [two] = (list(read_metrics(tmp_path / run, "val/loss").values()) for run in ("one", "two"))
    assert two == pytest.approx(one, rel=1e-5)  # not the mean of the two ranks' means


@pytest.mark.slow
@needs_horovod
def test_a_run_moves_from_one_process_to_horovod_and_on_to_ddp_and_continues_exactly(
    tiny_shards, uninterrupted_reference, tmp_path
):
    run_train(tiny_shards, tmp_path, *RESUME_RUN, "trainer.max_steps=7")
    # Horovod loads another layout's checkpoint: weights, optimizer state (then broadcast) and the schedule, whose
    # learning rates would stay behind from step 9 on if it lost the optimizer's parameter groups.
    trained_by_horovod(tiny_shards, tmp_path, *RESUME_RUN, "trainer.max_steps=13", "ckpt_path=last")
    run_train(
        tiny_shards,
        tmp_path,
        *RESUME_RUN,
        "trainer.max_steps=20",
        "ckpt_path=last",
        "strategy=ddp",
        "trainer.devices=2",
    )
    assert_continues(tmp_path, uninterrupted_reference, 20)


@pytest.mark.parametrize("run_dir", [["hydra.run.dir=/shared/runs/one"], []], ids=["shared-run-dir", "none"])
def test_the_layout_takes_horovodruns_process_count_and_its_processes_one_run_directory(monkeypatch, run_dir):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    import project.parallel.strategies.horovod as horovod
    from project.config.checks import preflight
    from project.runtime.errors import ConfigError

    monkeypatch.setattr(horovod, "horovod_world", lambda strategy_cfg: 2)  # as under horovodrun -np 2
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train", ["experiment=debug", "strategy=horovod", "global_batch_size=8", *run_dir], return_hydra_config=True
        )
    monkeypatch.setattr(HydraConfig.instance(), "cfg", cfg)  # what project.train's processes see
    if run_dir:
        layout = preflight(cfg)
        assert (layout.shape.data_parallel, layout.plan.accumulate_grad_batches * layout.plan.micro_batch_size) == (
            2,
            4,
        )
    else:  # each process would name its own from its clock
        with pytest.raises(ConfigError, match="hydra.run.dir=outputs/runs/NAME"):
            preflight(cfg)


@pytest.mark.parametrize(
    "setting, fix",
    [
        ("trainer.devices=2", "leave trainer.devices=1"),  # horovodrun (-np N) says how many processes, not the trainer
        ("trainer.precision=bf16-true", "trainer.precision=bf16-mixed"),  # Horovod 0.28 has no bfloat16 operations
    ],
)
def test_horovod_settings_that_cannot_run_are_refused_naming_the_fix(tiny_shards, tmp_path, setting, fix):
    result = run_module("project.train", train_overrides(tiny_shards, tmp_path / "run", "strategy=horovod", setting))
    assert result.returncode == 2 and fix in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_dry_run_of_horovod_points_to_the_ddp_dry_run(tiny_shards, tmp_path):
    result = run_module(
        "project.train", train_overrides(tiny_shards, tmp_path / "run", "strategy=horovod", "dry_run=true")
    )
    assert result.returncode == 2 and "strategy=ddp" in result.stderr and "Traceback" not in result.stderr


def test_without_horovod_installed_the_strategy_says_how_to_install_it(monkeypatch):
    from project.parallel.strategies.horovod import start_horovod
    from project.runtime.errors import ConfigError

    monkeypatch.setitem(
        sys.modules, "horovod.torch", None
    )  # what `import horovod.torch` finds where it is not installed
    with pytest.raises(ConfigError, match="make install-horovod"):
        start_horovod()
