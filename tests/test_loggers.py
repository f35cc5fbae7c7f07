import pytest
from conftest import read_metrics, run_train

from project.training.loggers import RunCSVLogger, RunIdentity, wandb_mode


def run_identity(folder):
    return RunIdentity(dir=folder, name="run", group=None, tags=[], config={}, has_secrets=False)


def test_wandb_auto_mode_is_offline_unless_logged_in(monkeypatch, tmp_path):
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"
    assert wandb_mode("disabled") == "disabled"


def test_wandb_auto_mode_sees_a_wandb_login_netrc_entry(monkeypatch, tmp_path):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_mode("auto") == "online"


@pytest.mark.slow
def test_wandb_logger_records_an_offline_run_with_the_resolved_config(tiny_shards, tmp_path):
    run_train(tiny_shards, tmp_path, "logger=wandb", "trainer.max_steps=3")
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    record = runs[0].read_bytes()
    assert b"global_batch_size" in record and b"train/loss" in record
    assert (
        b"debug_dp1-tp1-pp1_mb8_single" in record and b"layout/world_size" in record
    )  # named and described by its layout
    assert read_metrics(tmp_path, "layout/world_size") == {0: 1.0}  # CSV is kept beside wandb, with the same facts
    assert read_metrics(tmp_path, "layout/micro_batch_size") == {0: 8.0}


def test_a_run_killed_while_a_new_column_rewrites_metrics_csv_keeps_its_rows(monkeypatch, tmp_path):
    """A column that first appears (val/loss, checkpoint/*) makes the CSV writer rewrite every row; the new file is
    made whole beside metrics.csv and renamed into place, so a failure (a kill) midway leaves the old rows."""
    import csv

    logger = RunCSVLogger(run_identity(tmp_path))
    for step in range(3):
        logger.log_metrics({"train/loss": 1.0 + step}, step)
    before = (tmp_path / "metrics.csv").read_text()

    def killed(self, rows):
        raise KeyboardInterrupt("killed while writing the rows")

    with monkeypatch.context() as patched:
        patched.setattr(csv.DictWriter, "writerows", killed)
        with pytest.raises(KeyboardInterrupt):
            logger.log_metrics({"checkpoint/gigabytes": 0.5}, 2)
    assert (tmp_path / "metrics.csv").read_text() == before

    # Not killed, the new column joins every row.
    again = RunCSVLogger(run_identity(tmp_path / "again"))
    for step, metrics in enumerate([{"train/loss": 1.0}, {"train/loss": 2.0}, {"checkpoint/gigabytes": 0.5}]):
        again.log_metrics(metrics, step)
    assert read_metrics(tmp_path / "again", "train/loss") == {0: 1.0, 1: 2.0}
    assert read_metrics(tmp_path / "again", "checkpoint/gigabytes") == {2: 0.5}


def test_a_resumed_run_continues_metrics_csv_from_its_first_step_and_keeps_hparams_beside_it(tmp_path):
    """The interrupted run logged steps 0 to 4 and saved after step 2: the resumed run replays steps 3 and 4, whose
    old rows go (not only the rows of the step it logs first), and the earlier rows and columns stay."""
    first = RunCSVLogger(run_identity(tmp_path))
    first.log_hyperparams({"lr": 0.1})
    for step in range(5):
        first.log_metrics({"train/loss": 10.0 + step, **({"val/loss": 5.0} if step == 1 else {})}, step)
    resumed = RunCSVLogger(run_identity(tmp_path))
    resumed.log_metrics({"train/loss": 30.0}, 3)
    resumed.log_metrics({"train/loss": 40.0}, 4)
    assert read_metrics(tmp_path, "train/loss") == {0: 10.0, 1: 11.0, 2: 12.0, 3: 30.0, 4: 40.0}
    assert read_metrics(tmp_path, "val/loss") == {1: 5.0}
    assert "lr: 0.1" in (tmp_path / "hparams.yaml").read_text()
