"""A run's data settings are those its shards were prepared from, or it is refused: your own text is never
silently replaced by shards already in data.dir (data.overwrite=true prepares them again instead)."""

import json
import re
import shutil

import pytest
from conftest import read_metrics, run_module, run_train, train_overrides, write_corpus
from hydra import compose, initialize_config_dir

from project.config.checks import preflight
from project.config.command_line import CONF
from project.config.data import refuse_shards_of_other_settings
from project.runtime.errors import ConfigError


def compose_run(shards, tmp_path, *overrides):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=train_overrides(shards, tmp_path / "run", "trainer.devices=1", *overrides))


def test_the_shards_own_settings_pass(tiny_shards, tmp_path):
    assert preflight(compose_run(tiny_shards, tmp_path)) is not None


def test_a_run_whose_data_settings_differ_from_the_shards_is_refused_naming_both(tiny_shards, tmp_path):
    mine = write_corpus(tmp_path / "my-text", documents=2, lines=20, seed=5)
    raw, tokenizer = re.escape(str(tiny_shards.parent / "raw")), re.escape(str(tiny_shards / "tokenizer.json"))
    cases = {
        f"data.sources=[{mine}/]": rf"data.sources: 8 files in {raw} \(doc0.txt, doc1.txt, ...\) there, "
        rf"2 files in {re.escape(str(mine))} \(doc0.txt, doc1.txt\) here",
        "data.vocab_size=512": r"data.vocab_size: 300 there, 512 here",
        f"data.tokenizer={tiny_shards / 'tokenizer.json'}": (
            r"tokenizer: a BPE trained on the sources \(data.tokenizer=null\) there, "
            rf"data.tokenizer={tokenizer} here"
        ),
        "data.seq_len=16": r"data.seq_len: 32 there, 16 here",
    }
    for override, differs in cases.items():
        with pytest.raises(
            ConfigError,
            match=rf"data.dir={re.escape(str(tiny_shards))} holds shards prepared from other data settings than this "
            rf"run's: {differs}\. Point data.dir at a folder of your own .*, or give the settings the shards "
            r"were prepared from to train on them as they are\. Only if those shards are yours to lose: "
            r"data.overwrite=true prepares them again in place .*, replacing the shards \(8 files in .*\)\.$",
        ):
            preflight(compose_run(tiny_shards, tmp_path, override))
        # A dry run plans a job, whose shards these are not: it says so (tests/test_dry_run.py) and goes on.
        preflight(compose_run(tiny_shards, tmp_path, override), dry_run=True)


@pytest.fixture
def as_run():
    """Compose as `project.train` does, Hydra's runtime choices and command line included (where data.dir came from)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    def compose_as_run(*overrides: str):
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    yield compose_as_run
    HydraConfig.instance().cfg = None


def test_shards_the_experiment_pins_are_refused_naming_it_and_a_folder_of_your_own_before_overwrite(
    tiny_shards, tmp_path, as_run
):
    data = tmp_path / "data"
    shutil.copytree(tiny_shards, data / "shakespeare-debug")  # the folder experiment=debug sets, prepared
    mine = write_corpus(tmp_path / "my_code", documents=2, lines=20, seed=5)
    own_text = ["experiment=debug", f"paths.data_dir={data}", "data.name=mycode", f"data.sources=[{mine}/]"]
    settings = [*own_text, "data.fetch=null", "data.seq_len=32", "data.vocab_size=300", "trainer.devices=1"]
    pinned = re.escape(str(data / "shakespeare-debug"))
    with pytest.raises(ConfigError) as refused:
        preflight(as_run(*settings))
    assert re.fullmatch(
        rf"data.dir={pinned}, which experiment=debug sets, holds shards prepared from other data settings than this "
        rf"run's: data.sources: 8 files in \S+ \(.*\) there, 2 files in {re.escape(str(mine))} \(doc0.txt, doc1.txt\) "
        r"here\. "
        rf"Point data.dir at a folder of your own to prepare yours there and keep both, e.g. "
        rf"data.dir={re.escape(str(data / 'mycode'))}, or give the settings .* as they are\. Only if those shards are "
        r"yours to lose: data.overwrite=true prepares them again in place \(.*\), replacing the shards "
        rf"experiment=debug trains on \(8 files in {re.escape(str(tiny_shards.parent / 'raw'))} "
        r"\(doc0.txt, doc1.txt, ...\), a BPE of 300 tokens, data.seq_len=32\)\.",
        str(refused.value),
    )
    # python -m project.prepare with the same settings is refused in the same words, before it reads the sources.
    with pytest.raises(ConfigError) as preparing:
        refuse_shards_of_other_settings(as_run(*settings))
    said = str(preparing.value)
    assert said.startswith(f"data.dir={data / 'shakespeare-debug'}, which experiment=debug sets, holds shards "), said
    assert f"e.g. data.dir={data / 'mycode'}," in said and "replacing the shards experiment=debug trains on" in said
    refuse_shards_of_other_settings(as_run(*settings, "data.overwrite=true"))  # which says whose, as it replaces
    (data / "mycode").mkdir()
    (data / "mycode" / "notes.txt").write_text("not shards")  # a folder of that name, taken: the next name is offered
    with pytest.raises(ConfigError, match=rf"e.g. data.dir={re.escape(str(data / 'mycode-seq32'))}, or give"):
        preflight(as_run(*settings))
    # data.dir given on the command line is the user's choice: no experiment is named.
    with pytest.raises(ConfigError) as chosen:
        preflight(as_run(*settings, f"data.dir={data / 'shakespeare-debug'}"))
    assert "experiment=debug" not in str(chosen.value) and "e.g. data.dir=" in str(chosen.value)


def test_a_source_file_changed_since_preparing_is_named(tiny_shards, tmp_path):
    shards = shutil.copytree(tiny_shards, tmp_path / "shards")
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["sources"][3]["bytes"] -= 10  # as if doc3.txt had grown since
    (shards / "manifest.json").write_text(json.dumps(manifest))
    sources = f"data.sources=[{tiny_shards.parent / 'raw'}/*.txt]"
    with pytest.raises(ConfigError, match=r"data.sources: \S*doc3.txt held \d+ bytes when prepared, \d+ now"):
        preflight(compose_run(shards, tmp_path, sources))


def test_shards_whose_raw_text_is_not_on_this_machine_are_taken_as_they_are(tiny_shards, tmp_path):
    shards = shutil.copytree(tiny_shards, tmp_path / "shards")  # as if prepared on another machine, or before a move
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["sources"] = [{**source, "path": f"/elsewhere/{source['path']}"} for source in manifest["sources"]]
    (shards / "manifest.json").write_text(json.dumps(manifest))
    assert preflight(compose_run(shards, tmp_path, f"data.sources=[{tmp_path / 'not-here'}/*.txt]")) is not None
    with pytest.raises(ConfigError, match=r"data.sources: 8 files in \S*raw \(.*\) there, no files here"):
        preflight(
            compose_run(tiny_shards, tmp_path, f"data.sources=[{tmp_path / 'not-here'}/*.txt]")
        )  # its own raw text is here


def test_only_the_first_process_reads_the_sources(tiny_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank Lightning started: rank 0 has compared them already
    assert preflight(compose_run(tiny_shards, tmp_path, f"data.sources=[{tmp_path / 'not-here'}/*.txt]")) is not None


def test_a_tokenizer_is_the_same_by_its_content_wherever_it_lies(tiny_shards, tmp_path):
    from project.data.prepare import prepare_shards

    tokenizer = shutil.copytree(tiny_shards, tmp_path / "a-folder") / "tokenizer.json"
    raw = tiny_shards.parent / "raw"
    prepare_shards([str(raw / "*.txt")], tmp_path / "shards", tokenizer=tokenizer, seq_len=32, num_workers=1)
    elsewhere = shutil.copy(tokenizer, tmp_path / "moved.json")
    sources = f"data.sources=[{raw}/*.txt]"
    for given in (tokenizer, tokenizer.parent, elsewhere):  # the file, its folder, a copy
        assert preflight(compose_run(tmp_path / "shards", tmp_path, sources, f"data.tokenizer={given}")) is not None
    other = tmp_path / "other.json"
    other.write_text(tokenizer.read_text().replace('"<|end_of_text|>"', '"<|eot|>"'))
    with pytest.raises(
        ConfigError, match=rf"tokenizer: data.tokenizer={re.escape(str(tokenizer))} there, data.tokenizer={other} here"
    ):
        preflight(compose_run(tmp_path / "shards", tmp_path, sources, f"data.tokenizer={other}"))


def test_a_mixture_is_checked_by_its_corpora_not_by_the_data_settings(tiny_shards, tmp_path):
    mix = f"data.mix=[{{dir: {tiny_shards}, weight: 1.0}}]"
    assert preflight(compose_run(tiny_shards, tmp_path, mix, "data.vocab_size=512", "data.sources=[]")) is not None


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
