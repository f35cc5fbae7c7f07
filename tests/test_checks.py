"""Settings are checked before the heavy imports, so a mistake is answered in about a second."""

import re
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


@pytest.fixture
def as_run():
    """Compose like `project.train` does, Hydra's runtime choices (the group names errors cite) included."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    def compose_run(*overrides: str):
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=["experiment=debug", *overrides], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    yield compose_run
    HydraConfig.instance().cfg = None


GIB = 2**30


def test_a_model_that_cannot_fit_the_host_is_refused_with_its_need_and_what_is_there(as_run, monkeypatch):
    import project.planning.fits
    from project.config.values import model_config
    from project.model.flops import count_parameters
    from project.planning.fits import check_host_memory

    monkeypatch.setattr(project.planning.fits, "host_memory_available", lambda: 24.0 * GIB)
    cfg = as_run("model=llama3_8b", "trainer.devices=1")
    layout = preflight(cfg)  # the layout itself is fine: its memory is what project.train checks next
    with pytest.raises(ConfigError) as refused:
        check_host_memory(cfg, layout)
    said = str(refused.value)
    # Model states in float32 with AdamW, by hand: parameters, gradients and two moments of 4 bytes each.
    states = 16 * count_parameters(model_config(cfg)) / GIB
    assert f"model states {states:.1f}" in said and "is 24.0 GiB" in said
    assert "model=llama3_8b (8.03B parameters) does not fit" in said
    assert "No layout of the 1 device(s) here fits it" in said and "memory_check=false" in said
    check_host_memory(as_run("model=llama3_8b", "trainer.devices=1", "memory_check=false"), layout)  # started anyway


def test_a_refused_layout_names_the_planners_best_layout_that_fits_the_same_devices(as_run, monkeypatch):
    import project.planning.fits
    from project.planning.fits import check_host_memory

    monkeypatch.setattr(project.planning.fits, "host_memory_available", lambda: 24.0 * GIB)
    # llama3_2_1b replicated on 2 processes needs about 2 x 18 GiB of model states; sharded over both, half.
    cfg = as_run("model=llama3_2_1b", "data.vocab_size=512", "strategy=ddp", "trainer.devices=2")
    with pytest.raises(ConfigError, match=r"x 2 processes on this machine") as refused:
        check_host_memory(cfg, preflight(cfg))
    best = str(refused.value).split("the same command with ")[1]
    assert "strategy=fsdp2" in best or "strategy=tp" in best or "strategy=pipeline" in best, best
    assert "trainer=cpu" not in best and "data.seq_len" not in best  # only what changes is named
    layout_of_best = as_run(
        "model=llama3_2_1b", "data.vocab_size=512", "trainer.devices=2", *best.split(". To start")[0].split()
    )
    check_host_memory(layout_of_best, preflight(layout_of_best))  # and it passes the same check


def test_a_gpu_whose_memory_is_too_small_refuses_the_run_before_it_starts(as_run):
    from project.planning.fits import check_fits

    cfg = as_run("model=llama3_8b", "trainer.precision=bf16-mixed")
    layout = preflight(as_run("model=llama3_8b", "trainer.precision=bf16-mixed", "memory_check=false"))
    with pytest.raises(ConfigError, match=r"one NVIDIA H100 80GB HBM3's memory is 79.2 GiB"):
        check_fits(cfg, layout, 79.2 * GIB, 1, "gpu", "one NVIDIA H100 80GB HBM3's memory")
    check_fits(as_run("model=small4m", "trainer.precision=bf16-mixed"), layout, 79.2 * GIB, 1, "gpu", "a GPU")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["strategy=single", "trainer.devices=2"],
            "strategy=single runs one process on one device, not trainer.devices=2",
        ),
        (["trainer.num_nodes=2"], "not trainer.num_nodes=2"),
        (["trainer.precision=fp8"], "trainer.precision=fp8 is not a precision a run trains in. Choose one of: 32-true"),
    ],
)
def test_settings_that_lightning_would_refuse_after_its_imports_are_refused_before(as_run, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(as_run(*overrides))


def test_a_computed_trainer_setting_is_answered_with_the_setting_to_use_at_once():
    from project.config.command_line import check_command_line

    with pytest.raises(ConfigError, match="computed by project.train: set global_batch_size and micro_batch_size"):
        check_command_line(["experiment=debug", "trainer.accumulate_grad_batches=4"])


def test_a_run_directory_the_file_system_refuses_is_answered_before_hydra_makes_it():
    from project.config.command_line import check_command_line

    with pytest.raises(ConfigError, match=r"hydra.run.dir=/proc/nope: cannot make the run directory there"):
        check_command_line(["experiment=debug", "hydra.run.dir=/proc/nope"])


def test_a_group_added_with_a_plus_is_answered_with_the_way_to_choose_it():
    from project.config.command_line import check_command_line

    with pytest.raises(ConfigError, match=re.escape("write callbacks=NAME to choose another or callbacks=[a,b]")):
        check_command_line(["experiment=debug", "+callbacks=early_stopping"])


def test_the_train_command_refuses_a_model_too_large_for_this_machine_before_importing_torch(tmp_path):
    args = [sys.executable, "-X", "importtime", "-m", "project.train", "experiment=debug", "model=llama3_405b"]
    result = subprocess.run([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "error: model=llama3_405b (405." in result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and not (tmp_path / "run").exists()
