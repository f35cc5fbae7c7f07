"""Secrets never reach what a run writes: its folder (config, Hydra's record, logs, metrics) or wandb."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from project.redact import REDACTED, redact_text, redacted_container, secret_values
from tests.conftest import run_module, train_overrides

API_KEY = "local-0123456789abcdef0123456789abcdef01234567"  # the shape of a wandb key
TOKEN = "hf_SeCrEtToKeN4242"


def test_secret_looking_settings_are_found_and_redacted_and_others_kept():
    cfg = OmegaConf.create({"optim": {"lr": 0.1}, "api_token": TOKEN, "data": {"access_token": "t2", "tokenizer": None},
                            "logger": {"wandb": {"api_key": "k3", "project": "p"}}})
    assert secret_values(cfg) == {TOKEN, "t2", "k3"}  # `tokenizer` is not a secret, however close its name
    clean = redacted_container(cfg)
    assert clean["api_token"] == clean["data"]["access_token"] == clean["logger"]["wandb"]["api_key"] == REDACTED
    assert clean["optim"]["lr"] == 0.1 and clean["logger"]["wandb"]["project"] == "p"
    assert redact_text(f"+api_token={TOKEN} x", {TOKEN}) == f"+api_token={REDACTED} x"


@pytest.mark.slow
def test_no_file_a_run_writes_holds_a_secret(tiny_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", API_KEY)
    run_dir = tmp_path / "run"
    args = train_overrides(tiny_shards, run_dir, "logger=wandb", "trainer.max_steps=2", f"+api_token={TOKEN}",
                           f"+data.access_token={TOKEN}x")
    result = run_module("project.train", args)
    assert result.returncode == 0, result.stderr[-3000:]
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in written) and (run_dir / "train.log").is_file()  # wandb and the logs wrote
    leaks = [str(p) for p in written if TOKEN.encode() in p.read_bytes() or API_KEY.encode() in p.read_bytes()]
    assert leaks == []
    assert f"api_token: {REDACTED}" in (run_dir / "config.yaml").read_text()  # the setting is recorded, not its value
