"""A run folder is never overwritten by a slip: a new run into a folder that holds checkpoints is refused, and
`ckpt_path=auto` resumes where there is a checkpoint and starts otherwise; a resume says which of the checkpoint's
settings it changes (project.config.checkpoints, project.training.callbacks.run_settings)."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import PARITY_RUN, run_module, train_overrides
from omegaconf import OmegaConf

from project.config.checkpoints import check_ckpt_path, resume_point
from project.runtime.errors import ConfigError
from project.training.callbacks.run_settings import RECORD, RunSettings, settings_changed


def settings(**values) -> OmegaConf:
    return OmegaConf.create({"ckpt_path": None, "ckpt_dir": None, "strategy": {}, **values})


def saved_run(run_dir: Path, *names: str) -> Path:
    (run_dir / "checkpoints").mkdir(parents=True)
    for name in names:
        (run_dir / "checkpoints" / name).write_bytes(b"")
    (run_dir / "metrics.csv").write_text("step\n")
    return run_dir


def test_a_new_run_into_a_folder_that_holds_checkpoints_is_refused_naming_both_ways_on(tmp_path):
    run = saved_run(tmp_path / "run", "last.ckpt", "best-step000010.ckpt")
    with pytest.raises(ConfigError) as refused:
        check_ckpt_path(settings(), run)
    said = str(refused.value)
    assert f"hydra.run.dir={run} holds the checkpoints of an earlier run" in said
    assert "best-step000010.ckpt, last.ckpt" in said
    assert "ckpt_path=last" in said and "ckpt_path=auto" in said and "hydra.run.dir=outputs/runs/NAME" in said
    # A checkpoint folder of one's own choosing is named as that setting.
    with pytest.raises(ConfigError, match=r"ckpt_dir=.*checkpoints holds the checkpoints"):
        check_ckpt_path(settings(ckpt_dir=str(run / "checkpoints")), tmp_path / "elsewhere")


def test_a_folder_without_checkpoints_a_resume_and_a_dry_run_are_not_refused(tmp_path):
    check_ckpt_path(settings(), saved_run(tmp_path / "no-saves"))  # a run that stopped before its first save
    run = saved_run(tmp_path / "run", "last.ckpt")
    check_ckpt_path(settings(ckpt_path="last"), run)
    check_ckpt_path(settings(ckpt_path="auto"), run)
    check_ckpt_path(settings(), run, new_runs_checked=False)  # a dry run writes none of the run's files


@pytest.mark.parametrize(
    "saves, resumes",
    [([], None), (["last.ckpt"], "last"), (["last.ckpt.old"], "last")],
    ids=["empty", "last", "mid-swap"],
)
def test_ckpt_path_auto_resumes_from_last_where_there_is_one_and_starts_otherwise(tmp_path, saves, resumes):
    assert resume_point(settings(ckpt_path="auto"), saved_run(tmp_path / "run", *saves)) == resumes
    assert resume_point(settings(ckpt_path="last"), tmp_path / "run") == "last"  # other values as they are
    assert resume_point(settings(), tmp_path / "run") is None


def whole_file(path: Path) -> None:
    """A save whose writing ended, as the check reads one: a whole zip archive (torch.save's format)."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("data.pkl", b"")


def test_ckpt_path_auto_without_last_resumes_from_the_newest_whole_save(tmp_path):
    """Saves, but no last.ckpt (~callbacks.last_checkpoint, or removed by hand): the newest whole one by its step,
    a file or a sharded folder; one cut short (no zip directory, no .metadata) is passed over."""
    run = saved_run(tmp_path / "run", "step-000012.ckpt", "step-000020.ckpt")
    folder = run / "checkpoints"
    whole_file(folder / "best-step000008.ckpt")
    whole_file(folder / "step-000012.ckpt")  # step-000020.ckpt stays an empty file: its save was cut short
    (folder / "step-000016.ckpt").mkdir()  # a sharded save without its .metadata
    assert resume_point(settings(ckpt_path="auto"), run) == str(folder / "step-000012.ckpt")
    (folder / "step-000016.ckpt" / ".metadata").write_bytes(b"")
    assert resume_point(settings(ckpt_path="auto"), run) == str(folder / "step-000016.ckpt")
    check_ckpt_path(settings(ckpt_path="auto"), run)
    check_ckpt_path(settings(ckpt_path=str(folder / "step-000016.ckpt")), run)  # a save of this run's own


def test_ckpt_path_auto_refuses_a_folder_of_saves_none_of_them_whole(tmp_path):
    run = saved_run(tmp_path / "run", "best-step000010.ckpt")
    for check in (
        lambda: resume_point(settings(ckpt_path="auto"), run),
        lambda: check_ckpt_path(settings(ckpt_path="auto"), run),
    ):
        with pytest.raises(
            ConfigError,
            match=r"ckpt_path=auto: .* holds checkpoints \(best-step000010.ckpt\) but none that is whole "
            r".*cut short.*give this run a folder of its own",
        ):
            check()


def test_a_run_resumed_from_another_runs_checkpoint_into_a_folder_of_saves_is_refused(tmp_path):
    run, other = saved_run(tmp_path / "run", "last.ckpt"), saved_run(tmp_path / "other")
    whole_file(other / "checkpoints" / "last.ckpt")
    with pytest.raises(ConfigError, match=r"holds the checkpoints of an earlier run .*ckpt_path=.*other.*another run"):
        check_ckpt_path(settings(ckpt_path=str(other / "checkpoints" / "last.ckpt")), run)
    check_ckpt_path(settings(ckpt_path=str(other / "checkpoints" / "last.ckpt")), tmp_path / "new")  # a new folder


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def test_a_rerun_in_a_trained_run_directory_is_refused_and_changes_none_of_its_files(
    single_reference, tiny_shards, tmp_path
):
    run = Path(shutil.copytree(single_reference, tmp_path / "run"))
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "metrics.csv").is_file()
    before = digests(run)
    result = run_module("project.train", train_overrides(tiny_shards, run, *PARITY_RUN, "trainer.max_steps=5"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("error: ") == 1 and "holds the checkpoints of an earlier run" in result.stderr
    assert digests(run) == before


def flat(**values) -> dict[str, str]:
    return {k: json.dumps(v) for k, v in values.items()}


def test_a_resume_warns_once_of_the_settings_that_change_what_the_run_computes(single_reference):
    """The checkpoint a run wrote keeps its settings; a resume with another batch, without float8 and on another
    learning rate names the three in one warning, with the values that continue the checkpoint's run (the schedule's
    in its own words, with the resumed step's learning rate), and the layout's changes only as information."""
    checkpoint = torch.load(single_reference / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    saved = checkpoint[RECORD]
    assert json.loads(saved["global_batch_size"]) == 8 and json.loads(saved["model.dim"]) > 0
    schedule = {**checkpoint["schedule"], "optim.lr": 0.5}
    now = {**saved, "global_batch_size": "16", "strategy.float8": '"tensorwise"', "trainer.devices": "2"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RunSettings({**now, "optim.lr": "0.5"}, schedule).on_load_checkpoint(None, None, checkpoint)  # type: ignore[arg-type]
    said = [str(w.message) for w in caught]
    assert len(said) == 1, said
    assert 'global_batch_size: 8 there, 16 here; strategy.float8: null there, "tensorwise" here' in said[0]
    assert "set global_batch_size=8 strategy.float8=null" in said[0]
    lr = checkpoint["schedule"]["optim.lr"]
    assert f"Resuming on another learning-rate schedule than the checkpoint's: optim.lr: {lr:g} there" in said[0]
    assert "0.5 here" in said[0] and "trainer.devices" not in said[0]
    # The schedule alone, from a checkpoint without the settings' record, is said as it was.
    del checkpoint[RECORD]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RunSettings(now, schedule).on_load_checkpoint(None, None, checkpoint)  # type: ignore[arg-type]
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith("resuming on another learning-rate schedule"), said


def test_the_same_settings_written_apart_compare_equal_and_a_setting_is_given_back_as_typed():
    """A checkout moved (paths under the project's root), `1` against `1.0`; the fix is one shell word a setting,
    with `+` where this run has no such key."""
    from project.training.callbacks.run_settings import as_override, flat_settings

    here = flat_settings({"paths": {"root_dir": "/a/repo"}, "data": {"dir": "/a/repo/data/x"}, "optim": {"clip": 1}})
    there = flat_settings({"paths": {"root_dir": "/b/repo"}, "data": {"dir": "/b/repo/data/x"}, "optim": {"clip": 1.0}})
    assert settings_changed(there, here) == ([], []) and here["data.dir"] == '"data/x"'
    elsewhere = flat_settings(
        {"paths": {"root_dir": "/b/repo"}, "data": {"dir": "/b/repo/data/y"}, "optim": {"clip": 1}}
    )
    assert settings_changed(elsewhere, here)[0] == ["data.dir"]
    assert as_override("optim.betas", flat_settings({"b": [0.9, 0.95]})["b"], {"optim.betas": ""}) == (
        "optim.betas=[0.9,0.95]"
    )
    assert as_override("strategy.float8", '"rowwise"', {}) == "+strategy.float8=rowwise"


def test_settings_a_resume_may_change_freely_are_told_apart_from_those_that_change_the_run():
    saved = flat(**{"global_batch_size": 8, "strategy.tensor_parallel_size": 1, "data.loader_workers": 0})
    now = flat(**{"global_batch_size": 8, "strategy.tensor_parallel_size": 2, "data.loader_workers": 1})
    assert settings_changed(saved, now) == ([], ["data.loader_workers", "strategy.tensor_parallel_size"])
    # A key one run lacks is null there: a strategy without float8 against one with it.
    assert settings_changed(flat(**{"strategy.float8": "rowwise"}), {}) == (["strategy.float8"], [])
    assert settings_changed({"strategy.float8": "null"}, {}) == ([], [])


def test_ranks_that_find_different_checkpoints_stop_before_anything_loads(tiny_shards, tmp_path):
    """Checkpoint folders on each node's own disk (each rank its own here): under ckpt_path=auto rank 0 finds a save
    to resume and rank 1 none, and would train a model of its own beside it. Once the ranks can talk, before anything
    loads, every rank stops with one error naming what each decided and the fix."""
    from in_process import train_in_process

    first = train_overrides(tiny_shards, tmp_path / "first", f"ckpt_dir={tmp_path / 'node0'}", "trainer.max_steps=2")
    train_in_process(1, [(tmp_path / "first", first)])
    per_rank = f"ckpt_dir={tmp_path}/node${{oc.env:LOCAL_RANK}}"
    resumed = train_overrides(tiny_shards, tmp_path / "second", per_rank, "ckpt_path=auto", "strategy=ddp",
                              "trainer.devices=2", "trainer.max_steps=4")  # fmt: skip
    with pytest.raises(pytest.fail.Exception) as stopped:
        train_in_process(2, [(tmp_path / "second", resumed)], timeout=300)  # without the check: a hang
    said = str(stopped.value)
    assert f"the ranks do not start from the same checkpoint: rank 0 resumes from {tmp_path / 'node0'}" in said, said
    assert "and rank(s) 1 decided otherwise" in said
    assert "put hydra.run.dir and ckpt_dir on a file system every node shares" in said
    assert not (tmp_path / "node1").exists() or not any((tmp_path / "node1").iterdir())  # nothing trained
