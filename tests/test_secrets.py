"""Secrets never reach what a run writes: its folder (config, Hydra's record, logs, metrics, checkpoints) or wandb."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from project.data import datamodule as datamodule_module
from project.data.datamodule import TokenShardDataModule
from project.runtime.secrets import REDACTED, redact_text, redacted_container, secret_values, without_secrets
from tests.conftest import run_module, train_overrides

API_KEY = "local-0123456789abcdef0123456789abcdef01234567"  # the shape of a wandb key
TOKEN = "hf_SeCrEtToKeN4242"
AWS_KEY_ID = "AKIAEXAMPLEKEYID4242"  # the shape of an AWS access key id and secret
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
AWS_ENV_SECRET = "EnvSecretAccessKey0123456789abcdefEXAMPLE"


def test_secret_looking_settings_are_found_and_redacted_and_others_kept():
    cfg = OmegaConf.create(
        {
            "optim": {"lr": 0.1},
            "api_token": TOKEN,
            "data": {"access_token": "t2", "tokenizer": None},
            "logger": {"wandb": {"api_key": "k3", "project": "p"}},
        }
    )
    assert secret_values(cfg) == {TOKEN, "t2", "k3"}  # `tokenizer` is not a secret, however close its name
    clean = redacted_container(cfg)
    assert clean["api_token"] == clean["data"]["access_token"] == clean["logger"]["wandb"]["api_key"] == REDACTED
    assert clean["optim"]["lr"] == 0.1 and clean["logger"]["wandb"]["project"] == "p"
    assert redact_text(f"+api_token={TOKEN} x", {TOKEN}) == f"+api_token={REDACTED} x"


def test_storage_credentials_are_secret_and_the_endpoint_is_not():
    options = {
        "aws_access_key_id": AWS_KEY_ID,
        "aws_secret_access_key": AWS_SECRET,
        "aws_session_token": "s3",
        "endpoint_url": "http://minio:9000",
        "region_name": "eu-west-1",
    }
    cfg = OmegaConf.create({"data": {"storage_options": options}})
    assert secret_values(cfg) == {AWS_KEY_ID, AWS_SECRET, "s3"}
    assert redacted_container(cfg)["data"]["storage_options"] == {
        "aws_access_key_id": REDACTED,
        "aws_secret_access_key": REDACTED,
        "aws_session_token": REDACTED,
        "endpoint_url": "http://minio:9000",
        "region_name": "eu-west-1",
    }
    assert without_secrets({"storage_options": options, "mix": [{"dir": "d", "hf_token": TOKEN}]}) == {
        "storage_options": {"endpoint_url": "http://minio:9000", "region_name": "eu-west-1"},
        "mix": [{"dir": "d"}],
    }


def test_datamodule_reads_with_its_credentials_and_records_none_of_them(tiny_shards, monkeypatch):
    given = []  # the storage options each split is read with

    class RecordingBlocks(datamodule_module.TokenBlocks):
        def __init__(self, *args, **kwargs):
            given.append(args[5])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(datamodule_module, "TokenBlocks", RecordingBlocks)
    endpoint = "http://minio:9000"
    options = {"aws_access_key_id": AWS_KEY_ID, "aws_secret_access_key": AWS_SECRET, "endpoint_url": endpoint}
    dm = TokenShardDataModule(
        str(tiny_shards),
        seq_len=32,
        global_batch_size=2,
        micro_batch_size=2,
        num_workers=0,
        storage_options=dict(options),
    )
    dm.setup("fit")
    assert given == [options, options]  # train and val, read with the credentials as given
    # What Lightning logs (hparams_initial) and checkpoints (hparams) holds the endpoint, not the credentials.
    assert dm.hparams_initial["storage_options"] == dm.hparams["storage_options"] == {"endpoint_url": endpoint}
    assert dm.hparams["data_dir"] == str(tiny_shards) and dm.hparams["seq_len"] == 32  # the rest recorded as before


@pytest.mark.slow
def test_no_file_a_run_writes_holds_a_secret(tiny_shards, tmp_path, monkeypatch):
    # Secrets both ways: in the environment, and as settings (top level, data, and boto3's storage options).
    monkeypatch.setenv("WANDB_API_KEY", API_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_ENV_SECRET)
    run_dir = tmp_path / "run"
    args = train_overrides(
        tiny_shards,
        run_dir,
        "logger=wandb",
        "trainer.max_steps=2",
        f"+api_token={TOKEN}",
        f"+data.access_token={TOKEN}x",
        f"+data.storage_options.aws_access_key_id={AWS_KEY_ID}",
        f"+data.storage_options.aws_secret_access_key={AWS_SECRET}",
        "+data.storage_options.region_name=eu-west-1",
    )
    result = run_module("project.train", args)
    assert result.returncode == 0, result.stderr[-3000:]
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    names = {p.name for p in written}
    # wandb (its logs and transaction log), the console log, hyperparameters and a checkpoint were all written
    assert {"debug.log", "debug-internal.log", "train.log", "hparams.yaml", "last.ckpt"} <= names
    assert any(p.suffix == ".wandb" for p in written)
    secrets = [s.encode() for s in (API_KEY, TOKEN, AWS_KEY_ID, AWS_SECRET, AWS_ENV_SECRET)]
    leaks = [(str(p.relative_to(run_dir)), s.decode()) for p in written for s in secrets if s in p.read_bytes()]
    assert leaks == []
    config = OmegaConf.load(run_dir / "config.yaml")  # the settings are recorded, not their values
    assert config.api_token == config.data.storage_options.aws_secret_access_key == REDACTED
    assert config.data.storage_options.region_name == "eu-west-1"
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["datamodule_hyper_parameters"]["storage_options"] == {"region_name": "eu-west-1"}
