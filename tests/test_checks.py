"""Settings are checked before the heavy imports, so a mistake is answered in about a second."""

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from project.config.checks import preflight
from project.parallel.mesh import MeshShape
from project.runtime.errors import ConfigError
from tests.conftest import ROOT


def test_the_train_command_checks_settings_without_importing_torch_or_lightning():
    code = "import sys, project.train; print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_settings_error_is_reported_before_torch_is_imported(tmp_path):
    # `python -m project.train` with a batch that cannot split; `-X importtime` lists every module imported.
    args = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "project.train",
        "experiment=debug",
        "strategy=ddp",
        "trainer.devices=2",
        "global_batch_size=7",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "error: global_batch_size=7 does not divide over 2 data-parallel ranks" in result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported and "torch" not in imported and "lightning" not in imported


def compose_train(*overrides: str):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=["experiment=debug", *overrides])


def test_preflight_plans_the_layout_when_the_device_count_is_given():
    layout = preflight(compose_train("strategy=pipeline", "trainer.devices=2", "global_batch_size=8"))
    assert layout.shape == MeshShape(2, 1, 1) and layout.plan.pipeline_microbatches == 8
    assert preflight(compose_train("trainer.devices=auto")) is None  # the Trainer resolves it; training plans it then


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["strategy=tp", "trainer.devices=2", "model.n_heads=3", "model.dim=96", "model.n_kv_heads=3"],
            "n_heads=3 is not divisible",
        ),
        (
            [
                "strategy=pipeline",
                "strategy.schedule=zbv",
                "strategy.data_parallel_size=2",
                "trainer.devices=4",
                "model.n_layers=4",
            ],
            "splits each backward pass",
        ),
        (["data.seq_len=4096"], "exceeds model.max_seq_len"),
        (["+trainer.gradient_clip_val=1.0"], "set optim.grad_clip instead"),
    ],
)
def test_preflight_refuses_settings_that_cannot_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        preflight(compose_train(*overrides))


def test_a_layout_names_the_run_and_describes_it_in_numbers():
    layout = preflight(
        compose_train("strategy=tp_fsdp", "trainer.devices=4", "global_batch_size=8", "micro_batch_size=2")
    )
    assert layout.name("debug", "tp_fsdp") == "debug_dp2-tp2-pp1_mb2_tp_fsdp"
    facts = layout.facts()
    assert (
        facts["layout/world_size"] == 4 and facts["layout/accumulation"] == 2 and facts["layout/global_batch_size"] == 8
    )
