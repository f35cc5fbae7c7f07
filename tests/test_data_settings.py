"""A run's data settings are those its shards were prepared from, or it is refused: your own text is never
silently replaced by shards already in data.dir (data.overwrite=true prepares them again instead)."""

import json
import re
import shutil

import pytest
from hydra import compose, initialize_config_dir

from conftest import read_metrics, run_module, run_train, train_overrides, write_corpus
from project.checks import CONF, preflight
from project.errors import ConfigError


def compose_run(shards, tmp_path, *overrides):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=train_overrides(shards, tmp_path / "run", "trainer.devices=1", *overrides))


def test_the_shards_own_settings_pass(tiny_shards, tmp_path):
    assert preflight(compose_run(tiny_shards, tmp_path)) is not None


@pytest.mark.parametrize("dry_run", [False, True], ids=["start", "dry-run"])
def test_a_run_whose_data_settings_differ_from_the_shards_is_refused_naming_both(tiny_shards, tmp_path, dry_run):
    mine = write_corpus(tmp_path / "my-text", documents=2, lines=20, seed=5)
    raw, tokenizer = re.escape(str(tiny_shards.parent / "raw")), re.escape(str(tiny_shards / "tokenizer.json"))
    cases = {
        f"data.sources=[{mine}/]": rf"data.sources: 8 files in {raw} \(doc0.txt, doc1.txt, ...\) there, "
        rf"2 files in {re.escape(str(mine))} \(doc0.txt, doc1.txt\) here",
        "data.vocab_size=512": r"data.vocab_size: 300 there, 512 here",
        f"data.tokenizer={tiny_shards / 'tokenizer.json'}": r"tokenizer: a BPE trained on the sources \(data.tokenizer=null\) there, "
        rf"data.tokenizer={tokenizer} here",
        "data.seq_len=16": r"data.seq_len: 32 there, 16 here",
    }
    for override, differs in cases.items():
        with pytest.raises(ConfigError, match=rf"data.dir={re.escape(str(tiny_shards))} holds shards prepared from other data settings than this "
                           rf"run's: {differs}\. Point data.dir at a new folder .* or set data.overwrite=true"):
            preflight(compose_run(tiny_shards, tmp_path, override), dry_run=dry_run)


def test_a_source_file_changed_since_preparing_is_named(tiny_shards, tmp_path):
    shards = shutil.copytree(tiny_shards, tmp_path / "shards")
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["sources"][3]["bytes"] -= 10  # as if doc3.txt had grown since
    (shards / "manifest.json").write_text(json.dumps(manifest))
    sources = f"data.sources=[{tiny_shards.parent / 'raw'}/*.txt]"
    with pytest.raises(ConfigError, match=r"data.sources: \S*doc3.txt held \d+ bytes when prepared, \d+ now"):
        preflight(compose_run(shards, tmp_path, sources))


def test_shards_without_their_raw_text_are_taken_as_they_are(tiny_shards, tmp_path):
    assert preflight(compose_run(tiny_shards, tmp_path, f"data.sources=[{tmp_path / 'not-here'}/*.txt]")) is not None


@pytest.mark.slow
def test_your_own_text_is_refused_then_prepared_in_place_with_overwrite(tiny_shards, tmp_path):
    shards = shutil.copytree(tiny_shards, tmp_path / "shards")
    mine = write_corpus(tmp_path / "my-text", documents=3, lines=100, seed=5)
    own_text = [f"data.sources=[{mine}/]", "trainer.max_steps=2", "global_batch_size=4"]
    refused = run_module("project.train", train_overrides(shards, tmp_path / "refused", *own_text))
    assert refused.returncode == 2 and refused.stderr.startswith("error: ") and "Traceback" not in refused.stderr
    assert f"2 files in {mine}" not in refused.stderr and f"3 files in {mine}" in refused.stderr
    assert json.loads((shards / "manifest.json").read_text())["sources"][0]["path"].startswith(str(tiny_shards.parent))
    run_train(shards, tmp_path / "run", *own_text, "data.overwrite=true")
    assert {s["path"] for s in json.loads((shards / "manifest.json").read_text())["sources"]} == {
        str(mine / f"doc{d}.txt") for d in range(3)
    }
    assert sorted(read_metrics(tmp_path / "run", "train/loss")) == [0, 1]
